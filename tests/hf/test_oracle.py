"""The oracle against transformers: a model made by ``transformers``, imported by ``hyperjax import-hf``,
gives transformers' logits (fp32, 1e-4 relative) and greedy ids on one device and under tensor, fsdp and
expert layouts; import then export gives back the same tensors bit for bit."""

import json
from pathlib import Path

import numpy as np
import pytest

from hyperjax.cli.main import main
from tests.hf.models import ARCHS, greedy, logits, make
from tests.tiers import sweep

pytest.importorskip("transformers")

PROMPT = [1, 2, 3]
TOKENS = np.array([[5, 9, 1, 33, 60, 2, 7, 14, 21, 3], [44, 12, 8, 0, 63, 25, 31, 6, 18, 50]], np.int32)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each architecture: its transformers model, its folder and the folder import-hf wrote."""
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            model = make(arch, root / "hf")
            assert main(["import-hf", str(root / "hf"), "--out", str(root / "hj"), "--set", "model.seq_len=64"]) == 0
            made[arch] = (model, root / "hf", root / "hj")
        return made[arch]

    return get


def our_logits(folder, tokens, sets=()):
    """hyperjax's logits of ``tokens`` for the imported model in ``folder``, on the layout ``sets`` give."""
    import jax

    from hyperjax import load_config, resolve
    from hyperjax.train.generate import generate_on_mesh, restored_model

    run = resolve(load_config(folder / "config.yaml", list(sets)))
    model, _, laid_out = restored_model(run, folder / "checkpoint")
    if run.devices == 1:
        return np.asarray(model(jax.numpy.asarray(tokens)))
    return np.asarray(generate_on_mesh(run, model, tokens, 1, laid_out=laid_out).first_logits)


def close(ours, theirs):
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_equal_transformers_on_one_device(imported, arch):
    model, _, folder = imported(arch)
    close(our_logits(folder, TOKENS, ["emulate.devices=1"]), logits(model, TOKENS))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_then_generate_gives_transformers_greedy_ids(imported, capsys, arch):
    """All 16 tokens with ``--ignore-eos``; by default the continuation ends at the first end-of-sequence id of
    the generation_config.json import-hf copied, where transformers' generate stops (keeping that token)."""
    model, _, folder = imported(arch)
    capsys.readouterr()
    args = ["generate", str(folder / "config.yaml"), "--checkpoint-dir", str(folder / "checkpoint")]
    args += ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16", "--temperature", "0", "--json"]
    assert main([*args, "--ignore-eos"]) == 0
    want = greedy(model, PROMPT, 16)
    assert json.loads(capsys.readouterr().out)["tokens"] == [want]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    stop = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [want[:stop]]
    assert main([*args, "--eos-id", str(want[5])]) == 0  # a token the continuation reaches: it ends there
    assert json.loads(capsys.readouterr().out)["tokens"] == [want[: want.index(want[5]) + 1]]


LAYOUTS = [
    ("deepseek_v3", ("parallel.expert=4", "parallel.tensor=2")),
    ("llama", ("parallel.tensor=2",)),
    ("qwen3", ("parallel.fsdp=8",)),
    ("mixtral", ("parallel.expert=4", "parallel.data=2")),
    ("qwen2", ("parallel.tensor=2", "parallel.data=4")),
    ("gpt2", ("parallel.tensor=4", "parallel.data=2")),
    ("qwen3_moe", ("parallel.expert=2", "parallel.tensor=2", "parallel.data=2")),
    ("llama3-scaled", ("parallel.fsdp=4", "parallel.tensor=2")),
    ("mixtral", ("parallel.fsdp=8",)),
]


@pytest.mark.parametrize(("arch", "sets"), sweep(LAYOUTS, fast={0, 2}), ids=[f"{a}-{'-'.join(s)}" for a, s in LAYOUTS])
def test_layouts_give_the_same_logits(imported, arch, sets):
    model, _, folder = imported(arch)
    last = logits(model, TOKENS)[:, -1]
    close(our_logits(folder, TOKENS, ["emulate.devices=8", *sets]), last)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_then_export_round_trips_bit_for_bit(imported, tmp_path, arch):
    from safetensors.numpy import load_file

    _, hf, folder = imported(arch)
    args = ["export-hf", str(folder / "config.yaml"), "--checkpoint-dir", str(folder / "checkpoint")]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    before, after = load_file(hf / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].tobytes() == value.tobytes(), name
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["model_type"]
        == hf.joinpath("config.json").read_text().split('"model_type": "')[1].split('"')[0]
    )


def test_sharded_export_writes_an_index_transformers_loads(imported, tmp_path, capsys):
    import transformers

    model, _, folder = imported("mixtral")
    args = ["export-hf", str(folder / "config.yaml"), "--checkpoint-dir", str(folder / "checkpoint"), "--json"]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "out"), "--max-shard-gib", str(20_000 / 2**30)]) == 0
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    listed = json.loads(capsys.readouterr().out)["files"]  # every file written, the index too
    assert sorted(listed) == sorted(p.name for p in (tmp_path / "out").iterdir())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    close(logits(back, TOKENS), logits(model, TOKENS))
    # and the shards import again, read through their index
    assert (
        main(["import-hf", str(tmp_path / "out"), "--out", str(tmp_path / "again"), "--set", "model.seq_len=64"]) == 0
    )
    close(our_logits(tmp_path / "again", TOKENS, ["emulate.devices=1"]), logits(model, TOKENS))


def test_train_resumes_from_imported_weights_at_transformers_loss(imported, tmp_path):
    import shutil

    import torch

    from hyperjax.train.data import Batches

    model, _, folder = imported("qwen2")
    ck = tmp_path / "ck"
    shutil.copytree(folder / "checkpoint", ck)
    args = ["train", str(folder / "config.yaml"), "--checkpoint-dir", str(ck), "--resume", "--steps", "2"]
    args += ["--set", "train.global_batch=8", "--metrics-out", str(tmp_path / "m.jsonl"), "--out-dir", str(tmp_path)]
    assert main(args) == 0
    first = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    batch = Batches(source="synthetic", global_batch=8, seq_len=64, vocab=64, seed=0).batch(0)
    theirs = torch.nn.functional.cross_entropy(
        torch.tensor(logits(model, batch["inputs"])).reshape(-1, 64), torch.tensor(batch["targets"]).reshape(-1).long()
    )
    assert first["loss"] == pytest.approx(float(theirs), rel=1e-4)
    assert (ck / "2").is_dir()  # the run goes on writing its own checkpoints


def test_checkpoints_as_published_import(imported, tmp_path, capsys):
    """GPT-2 saved from its base model (no ``transformer.`` prefix); DeepSeek-V3 with its multi-token-
    prediction layer after the model's own (left out, as transformers leaves it); a Mixtral config.json
    relying on transformers' defaults (rope_theta 1e6, rms_norm_eps 1e-5)."""
    import shutil

    import transformers
    from safetensors.numpy import load_file, save_file

    def rewrite(arch, name, tensors=None, config=None):
        _, hf, _ = imported(arch)
        folder = tmp_path / name
        folder.mkdir()
        raw = json.loads((hf / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config(raw) if config else raw))
        weights = load_file(hf / "model.safetensors")
        save_file(
            tensors(weights) if tensors else weights, str(folder / "model.safetensors"), metadata={"format": "pt"}
        )
        return folder

    def imports(folder):
        return main(["import-hf", str(folder), "--out", str(folder) + "-hj", "--set", "model.seq_len=64"])

    bare = rewrite("gpt2", "gpt2", tensors=lambda w: {k.removeprefix("transformer."): v for k, v in w.items()})
    assert imports(bare) == 0
    close(our_logits(Path(str(bare) + "-hj"), TOKENS, ["emulate.devices=1"]), logits(imported("gpt2")[0], TOKENS))

    mtp = lambda w: {**w, "model.layers.2.eh_proj.weight": np.zeros((32, 64), np.float32)}
    with_mtp = rewrite("deepseek_v3", "ds", tensors=mtp, config=lambda c: {**c, "num_nextn_predict_layers": 1})
    assert imports(with_mtp) == 0
    close(
        our_logits(Path(str(with_mtp) + "-hj"), TOKENS, ["emulate.devices=1"]),
        logits(imported("deepseek_v3")[0], TOKENS),
    )
    stray = rewrite("deepseek_v3", "ds-stray", tensors=mtp)  # the layer without num_nextn_predict_layers
    capsys.readouterr()
    assert imports(stray) == 2 and "'model.layers.2.eh_proj.weight'" in capsys.readouterr().err

    def bare_config(c):
        return {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_theta", "rms_norm_eps")}

    defaulted = rewrite("mixtral", "mixtral", config=bare_config)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(defaulted).eval()
    assert theirs.config.rms_norm_eps == 1e-5
    assert imports(defaulted) == 0
    close(our_logits(Path(str(defaulted) + "-hj"), TOKENS, ["emulate.devices=1"]), logits(theirs, TOKENS))
    shutil.rmtree(tmp_path)


def test_weights_import_with_the_experts_run_settings_changed(imported, tmp_path, capsys):
    """A capacity factor or a balancing weight changes how the experts run, not their weights: the import takes
    it (the stored names are the config.json model's); a routed top-k of another size is refused."""
    model, hf, _ = imported("mixtral")
    args = ["import-hf", str(hf), "--out", str(tmp_path / "cap"), "--set", "model.seq_len=64"]
    assert main([*args, "--set", "model.moe.capacity_factor=8.0", "--set", "model.moe.aux_loss_weight=0.02"]) == 0
    close(our_logits(tmp_path / "cap", TOKENS, ["emulate.devices=1"]), logits(model, TOKENS))  # nothing dropped
    capsys.readouterr()
    assert main([*args, "--set", "model.moe.top_k=1"]) == 2
    assert "--set model.moe.top_k: 1 changes the model" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_export_writes_back_the_special_tokens_and_the_balancing_weight(imported, tmp_path, arch):
    import transformers

    model, hf, folder = imported(arch)
    original = json.loads((hf / "config.json").read_text())
    args = ["export-hf", str(folder / "config.yaml"), "--checkpoint-dir", str(folder / "checkpoint")]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert written.get(key) == original.get(key), key
    back = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (
        model.config.bos_token_id,
        model.config.eos_token_id,
        model.config.pad_token_id,
    )
    if arch == "qwen3_moe":
        assert written["router_aux_loss_coef"] == original["router_aux_loss_coef"]


def test_export_refuses_a_folder_holding_files_it_does_not_write_and_the_imported_one(imported, tmp_path, capsys):
    _, hf, folder = imported("qwen3")
    args = ["export-hf", str(folder / "config.yaml"), "--checkpoint-dir", str(folder / "checkpoint")]
    download = tmp_path / "download"
    download.mkdir()
    for name in ("config.json", "model.safetensors", "LICENSE", "README.md"):
        (download / name).write_text("keep")
    (download / "original").mkdir()
    capsys.readouterr()
    assert main([*args, "--out", str(download)]) == 2
    assert "holds LICENSE, README.md, original/, which this command does not write" in capsys.readouterr().err
    assert sorted(p.name for p in download.iterdir()) == [
        "LICENSE",
        "README.md",
        "config.json",
        "model.safetensors",
        "original",
    ]
    before = {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()}
    assert main([*args, "--out", str(hf)]) == 2  # the folder the weights were imported from
    assert "the folder the checkpoint was imported from" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()} == before
    assert main([*args, "--out", str(tmp_path / "out")]) == 0  # a folder it wrote is replaced
    assert main([*args, "--out", str(tmp_path / "out")]) == 0


@pytest.mark.slow
def test_generate_stops_at_the_imported_configs_end_of_sequence_without_a_generation_config(imported, tmp_path, capsys):
    import shutil

    model, hf, _ = imported("qwen2")
    bare = tmp_path / "hf"
    shutil.copytree(hf, bare)
    (bare / "generation_config.json").unlink(missing_ok=True)
    want = greedy(model, PROMPT, 8)
    config = json.loads((bare / "config.json").read_text()) | {"eos_token_id": want[3]}
    (bare / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(bare), "--out", str(tmp_path / "hj"), "--set", "model.seq_len=64"]) == 0
    capsys.readouterr()
    for where in (tmp_path / "hj" / "config.yaml", bare):  # the import's folder, and the Hugging Face one
        args = ["generate", str(where), "--checkpoint-dir", str(tmp_path / "hj" / "checkpoint"), "--json"]
        assert main([*args, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8"]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == [want[: want.index(want[3]) + 1]]


@pytest.mark.slow
def test_an_untied_gpt2_imports_and_exports_with_transformers_logits(tmp_path):
    import torch
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_positions=64, attn_pdrop=0.0,
                                     embd_pdrop=0.0, resid_pdrop=0.0, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(0.3 * torch.randn_like(model.lm_head.weight))  # not the embedding
    model.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "hj")]) == 0
    close(our_logits(tmp_path / "hj", TOKENS, ["emulate.devices=1"]), logits(model, TOKENS))
    args = ["export-hf", str(tmp_path / "hj" / "config.yaml"), "--checkpoint-dir", str(tmp_path / "hj" / "checkpoint")]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.tie_word_embeddings is False
    close(logits(back, TOKENS), logits(model, TOKENS))


def test_a_tied_config_beside_a_stored_head_of_its_own_exits_2(imported, tmp_path, capsys):
    """``tie_word_embeddings: true`` with a stored ``lm_head.weight`` that differs from the embedding:
    transformers leaves them untied, so dropping the head would give other logits. A head equal to the
    embedding is the tied model's copy and imports."""
    import shutil

    from safetensors.numpy import load_file, save_file

    _, hf, _ = imported("llama")
    tied = tmp_path / "tied"
    shutil.copytree(hf, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    args = ["import-hf", str(tied), "--out", str(tmp_path / "out"), "--set", "model.seq_len=64"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "tie_word_embeddings true, but the stored 'lm_head.weight' differs from 'model.embed_tokens.weight'" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    tensors = load_file(tied / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, str(tied / "model.safetensors"), metadata={"format": "pt"})
    assert main(args) == 0
