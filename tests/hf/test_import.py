"""``import-hf`` on config.json files: a field hyperjax cannot honour exits 2 naming the field and its value;
``predict`` and ``plan`` take a config.json; a tokenizer.json travels with the model and ``generate`` encodes
and decodes with it."""

import json
import os
from pathlib import Path

import pytest

from hyperjax.cli.main import main

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def write(folder, **changes):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return folder


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "bert"}, "model_type='bert'"),
        ({"model_type": "mixtral", "sliding_window": 4096, "num_local_experts": 8, "num_experts_per_tok": 2},
         "sliding_window=4096"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling.rope_type='longrope'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True, "mlp_bias": False}, "attention_bias=True with mlp_bias=False"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
         "sliding_window=16"),
        ({"logit_softcapping": 30.0}, "logit_softcapping=30.0"),
        ({"num_attention_heads": 5}, "model.d_model=64 is not divisible by model.heads=5"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "decoder_sparse_step": 2, "mlp_only_layers": [1]}, "mlp_only_layers=[1] with decoder_sparse_step=2"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "decoder_sparse_step": 0}, "decoder_sparse_step=0 must be at least 1"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be at least 1"),
        ({"hidden_size": "64"}, "hidden_size='64' has the wrong type: expected an integer, got str"),
        # the base inside rope_parameters is checked, not read by float() or replaced where it is 0
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
         "rope_parameters.rope_theta='abc' must be a number > 0"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta=0 must be"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": True}}, "rope_parameters.rope_theta=True must"),
        ({"rope_scaling": {"rope_type": "linear", "rope_theta": [1]}}, "rope_scaling.rope_theta=[1] must be"),
        # a scaling's required keys are not filled with guesses (transformers refuses them too)
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_type 'linear' lacks factor"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
         "rope_type 'llama3' lacks low_freq_factor, high_freq_factor"),
        ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 512}},
         "rope_scaling of rope_type 'yarn' lacks factor"),
    ],
    ids=["model-type", "sliding", "rope-type", "act", "bias-mix", "qwen3-bias", "layer-types", "qwen-slides", "unknown",
         "shape", "sparse-layers", "sparse-step-0", "no-heads", "string", "theta-string", "theta-0", "theta-bool",
         "theta-list", "linear-no-factor", "llama3-no-freq", "yarn-no-factor"],
)  # fmt: skip
def test_a_field_hyperjax_cannot_honour_exits_2_naming_it(capsys, tmp_path, changes, message):
    folder = write(tmp_path / "hf", **changes)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert main(["predict", str(folder / "config.json")]) == 2


@pytest.mark.parametrize(
    ("changes", "sets", "named"),
    [
        ({"num_attention_heads": 5}, [], "model.d_model is hidden_size=64, model.heads is num_attention_heads=5"),
        ({"num_attention_heads": 5}, ["model.d_model=66"], "model.heads is num_attention_heads=5"),
        ({"model_type": "gpt2", "n_embd": 64, "n_head": 5, "n_layer": 2, "n_positions": 128}, [],
         "model.d_model is n_embd=64, model.heads is n_head=5"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 6, "moe_intermediate_size": 32}, [],
         "model.moe.top_k is num_experts_per_tok=6, model.moe.experts is num_experts=4"),
        # the field the import read: num_local_experts before num_experts; a null field's value is derived
        ({"model_type": "qwen3_moe", "num_local_experts": 4, "num_experts": 8, "num_experts_per_tok": 6,
          "moe_intermediate_size": 32}, [], "model.moe.top_k is num_experts_per_tok=6, model.moe.experts is "
         "num_local_experts=4"),
        ({"num_attention_heads": 5, "head_dim": None}, [], "model.d_model is hidden_size=64, model.heads is "
         "num_attention_heads=5"),
        # a number given as an integer is the model's to check (0 read as "must be at least 1" before)
        ({"rms_norm_eps": 0}, [], "model.norm_eps is rms_norm_eps=0"),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": -1},
         [], "model.moe.aux_loss_weight is router_aux_loss_coef=-1"),
    ],
    ids=["llama", "one-set", "gpt2", "moe", "both-counts", "null-field", "eps", "aux-loss"],
)  # fmt: skip
def test_a_size_the_model_refuses_is_named_as_config_json_names_it(capsys, tmp_path, changes, sets, named):
    hf = {**LLAMA, **changes}
    if hf["model_type"] == "gpt2":
        hf = {k: v for k, v in hf.items() if k not in LLAMA or k in ("vocab_size", "tie_word_embeddings")}
        hf["model_type"] = "gpt2"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    flags = [a for item in sets for a in ("--set", item)]
    assert main(["predict", str(folder), *flags]) == 2
    err = capsys.readouterr().err
    assert f"; in {folder / 'config.json'}, {named}\n" in err, err
    if sets:  # a key the --set gave is not the file's
        assert "model.d_model is" not in err
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out"), *flags]) == 2
    assert f"; in {folder / 'config.json'}, {named}\n" in capsys.readouterr().err


def test_predict_and_plan_take_a_config_json(capsys, tmp_path):
    folder = write(tmp_path / "hf")
    assert main(["predict", str(folder / "config.json"), "--json"]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "out" / "config.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == direct and direct["step_time_s"] > 0
    assert main(["plan", str(folder), "--json", "--devices", "8"]) == 0
    assert json.loads(capsys.readouterr().out)
    assert main(["train", str(folder / "config.json"), "--plan-only", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["devices"] == 8


def test_a_config_only_import_writes_the_model_exactly(tmp_path):
    from hyperjax import load_config

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    folder = write(tmp_path / "hf", rope_scaling={**scaling, "original_max_position_embeddings": 8192})
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out"), "--set", "parallel.tensor=2"]) == 0
    assert not (tmp_path / "out" / "checkpoint").exists()
    cfg = load_config(tmp_path / "out" / "config.yaml")
    m = cfg.model
    assert (m.d_model, m.heads, m.kv_heads, m.head_dim, m.d_ff, m.vocab) == (64, 4, 2, 16, 128, 256)
    assert (m.norm_eps, m.rope_theta, m.rope_scaling.factor, m.rope_scaling.original_max_position) == (
        1e-5, 500000.0, 8.0, 8192)  # fmt: skip
    assert cfg.parallel.tensor == 2
    assert load_config(folder).model == m
    umask = os.umask(0o022)
    os.umask(umask)
    for made in (tmp_path / "out", tmp_path / "out" / "config.yaml"):  # as mkdir and open would make them
        assert made.stat().st_mode & 0o777 == (0o777 if made.is_dir() else 0o666) & ~umask, made


@pytest.mark.parametrize("name", ["model-00001-of-00002.safetensors", "pytorch_model.bin"])
def test_weights_in_a_form_not_read_exit_2_rather_than_import_the_config_alone(capsys, tmp_path, name):
    folder = write(tmp_path / "hf")
    (folder / name).write_bytes(b"weights")
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"holds weights ({name}) but no model.safetensors and no model.safetensors.index.json" in err, err
    assert "save_pretrained(folder, safe_serialization=True)" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_weights_of_another_model_exit_2_naming_the_tensor(capsys, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    folder = write(tmp_path / "hf", num_hidden_layers=1)
    save_file({"model.embed_tokens.weight": np.zeros((256, 32), np.float32)}, str(folder / "model.safetensors"))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'model.embed_tokens.weight' is [256, 32]" in err and "[256, 64]" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("arch", "bos"), [("qwen3", None), ("llama", 1)])
def test_generate_encodes_and_decodes_with_the_tokenizer(capsys, tmp_path, arch, bos):
    """Text is encoded with the special tokens the tokenizer's template adds (a Llama's beginning of sequence),
    as transformers' tokenizer encodes it."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from tests.hf.models import VOCAB, greedy, make

    model = make(arch, tmp_path / "hf")
    words = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"w{bos} $A", special_tokens=[(f"w{bos}", bos)])
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "q3"), "--set", "model.seq_len=64"]) == 0
    assert (tmp_path / "q3" / "tokenizer.json").is_file()
    capsys.readouterr()
    args = ["generate", str(tmp_path / "q3" / "config.yaml"), "--checkpoint-dir", str(tmp_path / "q3" / "checkpoint")]
    assert main([*args, "--prompt", "w5 w9 w12", "--max-new-tokens", "8", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = [*([] if bos is None else [bos]), 5, 9, 12]
    want = greedy(model, ids, 8)
    assert out["tokens"] == [want]
    assert out["text"] == [tok.decode([*ids, *want])]


def test_fields_left_out_read_as_transformers_defaults_them():
    base = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 256, "intermediate_size": 128, "moe_intermediate_size": 32}  # fmt: skip
    m = load_config_json(base).model
    assert (m.moe.groups, m.moe.group_top_k, m.moe.routed_scaling, m.moe.first_dense) == (8, 4, 2.5, 3)
    assert (m.moe.experts, m.moe.shared_experts, m.q_lora_rank, m.kv_lora_rank, m.rope_interleave) == (
        256, 1, 1536, 512, True)  # fmt: skip
    assert load_config_json({**base, "q_lora_rank": None}).model.q_lora_rank is None  # null: uncompressed
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
               "vocab_size": 256, "intermediate_size": 128}  # fmt: skip
    m = load_config_json(mixtral).model
    assert (m.rope_theta, m.norm_eps, m.kv_heads, m.moe.experts, m.moe.top_k) == (1e6, 1e-5, 8, 8, 2)
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 256, "intermediate_size": 128}  # fmt: skip
    assert load_config_json(qwen3).model.head_dim == 128
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    m = load_config_json({**LLAMA, "rope_scaling": scaling}).model
    assert m.rope_scaling.original_max_position == 2048  # as transformers: max_position_embeddings


def load_config_json(raw):
    import tempfile
    from pathlib import Path

    from hyperjax import load_config

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(raw))
    return load_config(folder)


def test_out_may_not_replace_the_model_folder(capsys, tmp_path):
    folder = write(tmp_path / "hf")
    assert main(["import-hf", str(folder), "--out", str(folder)]) == 2
    assert "--out" in capsys.readouterr().err and (folder / "config.json").is_file()
    assert main(["import-hf", str(folder), "--out", str(tmp_path)]) == 2
    assert (folder / "config.json").is_file()
    other = tmp_path / "other"  # a folder no import wrote, or a file: kept, not replaced
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    (tmp_path / "a-file").write_text("keep")
    for out, says in ((other, "no config.yaml, so not one this command wrote"), (tmp_path / "a-file", "is a file")):
        assert main(["import-hf", str(folder), "--out", str(out)]) == 2
        assert says in capsys.readouterr().err and "keep" in (other / "notes.txt").read_text()
    assert (tmp_path / "a-file").read_text() == "keep"
    for out in (tmp_path / "a-file" / "sub", Path("/proc/no-folder-here")):  # checked before any work
        assert main(["import-hf", str(folder), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {str(out)!r} cannot be written (" in err and "Traceback" not in err
    mine = tmp_path / "mine"  # a folder with a config.yaml and files no import writes is not replaced either
    (mine / "ck").mkdir(parents=True)
    (mine / "config.yaml").write_text("model: {}\n")
    (mine / "NOTES.md").write_text("keep")
    (mine / "ck" / "keep.bin").write_text("keep")
    assert main(["import-hf", str(folder), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "holds NOTES.md, ck/, which this command does not write" in err, err
    assert (mine / "NOTES.md").read_text() == (mine / "ck" / "keep.bin").read_text() == "keep"
    again = tmp_path / "again"  # an earlier import's folder is replaced whole
    for _ in range(2):
        assert main(["import-hf", str(folder), "--out", str(again)]) == 0
    assert (again / "config.yaml").is_file()


def test_a_bad_index_exits_2(capsys, tmp_path):
    folder = write(tmp_path / "hf")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "weight_map must map tensor names to file names" in err and "Traceback" not in err


def test_an_index_of_no_tensors_exits_2_naming_it(capsys, tmp_path):
    folder = write(tmp_path / "hf")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors.index.json': weight_map lists no tensors" in err and "Traceback" not in err


def test_weights_not_stored_as_floats_exit_2_naming_the_tensor(capsys, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    folder = write(tmp_path / "hf", num_hidden_layers=1)
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), np.int32)}, str(folder / "model.safetensors"))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tensor 'model.embed_tokens.weight' is stored as I32, not a float type" in err
    assert not (tmp_path / "out").exists()


def test_a_folder_with_both_a_single_file_and_an_index_exits_2(capsys, tmp_path):
    """transformers loads model.safetensors where both are present; hyperjax asks which is meant, unless the
    index names that file alone."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = write(tmp_path / "hf", num_hidden_layers=1)
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), np.float32)}, str(folder / "model.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "holds both model.safetensors and model.safetensors.index.json" in err and "Traceback" not in err
    index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}  # an index of the single file agrees
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert "is missing" in capsys.readouterr().err  # read as one model: its other tensors are what is missing


@pytest.mark.parametrize(("item", "value"), [("model.layers=3", "3"), ("model.mlp=gelu", "'gelu'")])
def test_an_import_of_weights_keeps_the_model_config_json_describes(capsys, tmp_path, item, value):
    import numpy as np
    from safetensors.numpy import save_file

    folder = write(tmp_path / "hf")
    save_file({"model.embed_tokens.weight": np.zeros((256, 64), np.float32)}, str(folder / "model.safetensors"))
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "out"), "--set", item]) == 2
    err = capsys.readouterr().err
    key = item.split("=")[0]
    assert f"--set {key}: {value} changes the model" in err and "whose weights the folder holds; drop it" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_number_field_given_as_an_integer_is_read(tmp_path):
    """``router_aux_loss_coef: 0`` (no auxiliary loss) and ``rope_theta: 10000`` are numbers written as
    integers; the first was refused as "must be at least 1", a count's bound."""
    from hyperjax import load_config

    moe = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    m = load_config(write(tmp_path / "hf", **moe, router_aux_loss_coef=0, rope_theta=10000)).model
    assert (m.moe.aux_loss_weight, m.rope_theta) == (0.0, 10000.0)


def test_a_config_json_given_is_its_folder_for_import_and_export(capsys, tmp_path):
    """``import-hf FOLDER/config.json`` reads the weights and tokenizer beside it (it imported the config alone);
    ``export-hf FOLDER`` (the Hugging Face folder as CONFIG) copies that folder's tokenizer files and will not
    replace the folder (it took the folder's parent as the config's folder)."""
    import numpy as np
    from safetensors.numpy import save_file

    from hyperjax import load_config
    from hyperjax.hf.names import stored_shapes

    folder = write(tmp_path / "hf")
    shapes = stored_shapes(load_config(folder).model)
    rng = np.random.default_rng(0)
    save_file(
        {k: 0.02 * rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
        str(folder / "model.safetensors"),
    )
    for name in ("tokenizer.json", "generation_config.json"):
        (folder / name).write_text("{}")
    sets = ["--set", "model.seq_len=64", "--set", "emulate.devices=1"]
    assert main(["import-hf", str(folder / "config.json"), "--out", str(tmp_path / "hj"), *sets]) == 0
    assert "copied tokenizer.json, generation_config.json" in capsys.readouterr().out
    assert (tmp_path / "hj" / "checkpoint").is_dir() and (tmp_path / "hj" / "tokenizer.json").is_file()
    export = ["export-hf", str(folder), *sets, "--checkpoint-dir", str(tmp_path / "hj" / "checkpoint"), "--out"]
    assert main([*export, str(folder)]) == 2
    assert f"--out {str(folder)!r} holds the config's folder" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert main([*export, str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").is_file() and (tmp_path / "back" / "generation_config.json").is_file()
    assert "max_position_embeddings 64 (model.seq_len), the longest context" in capsys.readouterr().out  # not 2048
    assert json.loads((tmp_path / "back" / "config.json").read_text())["max_position_embeddings"] == 64

    # a tokenizer in another form travels too; generate will not read its prompt text as bytes beside it
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.json").write_text("{}")
    (folder / "merges.txt").write_text("#version: 0.2\n")
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "bpe"), *sets]) == 0
    assert "copied generation_config.json, vocab.json, merges.txt" in capsys.readouterr().out
    gen = ["generate", str(tmp_path / "bpe" / "config.yaml"), "--checkpoint-dir", str(tmp_path / "bpe" / "checkpoint")]
    assert main([*gen, "--prompt", "Hello", "--max-new-tokens", "2"]) == 2
    assert "beside CONFIG is vocab.json, merges.txt, which generate does not read" in capsys.readouterr().err
    assert main([*gen, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json"]) == 0


def test_a_qwen_window_no_layer_reaches_is_full_attention(tmp_path):
    """transformers slides Qwen2/3's layers from ``max_window_layers`` on: at or past the last, none slides."""
    for window_layers in (2, 28):
        hf = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}
        assert load_config_json({**LLAMA, **hf, "max_window_layers": window_layers}).model.layers == 2
