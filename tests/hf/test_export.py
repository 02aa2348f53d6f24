"""``export-hf`` of models trained here: transformers loads the folder as the same model (equal logits);
a model no Hugging Face type describes exits 2 naming what differs."""

import json
from pathlib import Path

import numpy as np
import pytest

from hyperjax.cli.main import main
from tests.hf.models import logits

pytest.importorskip("transformers")

QUICK = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
SMALL = ["--set", "model.layers=2", "--set", "model.d_model=64", "--set", "model.heads=4", "--set", "model.d_ff=128"]
LLAMA_MOE = ["model.family=llama", "model.moe={experts: 4, top_k: 2, d_ff: 64}"]
FAMILIES = {"gpt": [], "llama": ["--set", "model.family=llama", "--set", "model.kv_heads=2"]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_trained_model_exports_to_transformers_with_equal_logits(tmp_path, family):
    import jax
    import transformers

    from hyperjax import load_config, resolve
    from hyperjax.train.generate import restored_model

    sets = [*SMALL, *FAMILIES[family]]
    train = ["train", QUICK, *sets, "--steps", "2", "--out-dir", str(tmp_path / "o"), "--checkpoint-dir"]
    assert main([*train, str(tmp_path / "ck")]) == 0
    export = ["export-hf", QUICK, *sets, "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]
    assert main(export) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    # no source config: no special tokens, rather than the type's defaults (GPT-2's 50256 lies past this vocabulary)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert [written[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None, None, None]
    assert (theirs.config.bos_token_id, theirs.config.eos_token_id) == (None, None)
    tokens = np.arange(40, dtype=np.int32).reshape(2, 20) * 3
    run = resolve(load_config(QUICK, [*sets[1::2], "emulate.devices=1", "parallel.tensor=1"]))
    ours = np.asarray(restored_model(run, tmp_path / "ck")[0](jax.numpy.asarray(tokens)))
    want = logits(theirs, tokens)
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model.block=parallel"], "block=parallel"),
        (["model.family=llama", "model.norm=layernorm"], "layernorm outside gpt2's parts"),
        (["model.family=llama", "model.bias=true", "model.qkv_bias=false"], "model.bias without model.qkv_bias"),
        (["model.family=llama", "model.rope_interleave=true"], "model.rope_interleave with multi-head attention"),
        # experts without per-head norms are Mixtral's: in every layer, with renormalised weights
        ([*LLAMA_MOE, "model.moe.first_dense=1"], "must renormalise its top-k weights and have experts in every"),
        ([*LLAMA_MOE, "model.moe.balance=bias"], "a routing bias, expert groups or routed scaling"),
        ([*LLAMA_MOE, "model.qk_norm=true", "model.moe.routed_scaling=2.0"], "routed scaling"),
    ],
    ids=[
        "parallel-block",
        "llama-layernorm",
        "bias-without-qkv",
        "interleave",
        "mixtral-dense-first",
        "bias",
        "scaling",
    ],
)
def test_a_model_no_type_describes_exits_2(capsys, tmp_path, sets, message):
    args = ["export-hf", QUICK, "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "hf")]
    assert main([*args, *[x for s in sets for x in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_out_may_not_replace_the_checkpoint_or_the_config(capsys, tmp_path):
    (tmp_path / "ck").mkdir()
    args = ["export-hf", QUICK, "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*args, "--out", str(tmp_path / "ck")]) == 2
    assert "--out" in capsys.readouterr().err and (tmp_path / "ck").is_dir()
    assert main([*args, "--out", str(Path(QUICK).parent)]) == 2
    assert "the config's folder" in capsys.readouterr().err and Path(QUICK).is_file()
    for inside in ("hf", "100/hf"):  # read as a step, or deleted with one
        assert main([*args, "--out", str(tmp_path / "ck" / inside)]) == 2
        assert "lies inside --checkpoint-dir" in capsys.readouterr().err and not (tmp_path / "ck" / inside).exists()
    (tmp_path / "elsewhere").mkdir()  # a link is replaced by the folder written, not followed: refused
    for link, to in (("linked", tmp_path / "elsewhere"), ("dangling", tmp_path / "none")):
        (tmp_path / link).symlink_to(to)
        assert main([*args, "--out", str(tmp_path / link)]) == 2
        assert f"is a link (to {str(to)!r})" in capsys.readouterr().err and (tmp_path / link).is_symlink()
    (tmp_path / "a-file").write_text("keep")
    assert main([*args, "--out", str(tmp_path / "a-file" / "hf")]) == 2  # before the checkpoint is read
    err = capsys.readouterr().err
    assert f"cannot be written ({str(tmp_path / 'a-file')!r} is a file)" in err and "Traceback" not in err


@pytest.mark.parametrize("gib", ["inf", "nan", "0"])
def test_a_shard_size_that_is_no_finite_positive_number_exits_2(capsys, tmp_path, gib):
    args = ["export-hf", QUICK, "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]
    assert main([*args, "--max-shard-gib", gib]) == 2
    err = capsys.readouterr().err
    assert f"--max-shard-gib {float(gib)} must be a finite number > 0" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_a_shard_size_below_the_largest_tensor_exits_2(capsys, tmp_path):
    """A tensor is not split over files: a --max-shard-gib below the largest is refused before anything is read."""
    args = ["export-hf", QUICK, "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]
    assert main([*args, "--max-shard-gib", "0.00001"]) == 2
    err = capsys.readouterr().err
    assert "a file holds at most 10,737 bytes, but tensor 'transformer.h.0.mlp.c_fc.weight' [256, 1024]" in err, err
    assert "is 1,048,576 bytes as float32" in err and "pass --max-shard-gib 0.000977 or more" in err
    assert "Traceback" not in err
    assert not (tmp_path / "hf").exists()
    assert main([*args, "--max-shard-gib", "0.00001", "--dtype", "bfloat16"]) == 2
    assert "524,288 bytes as bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["train.lr=3", "parallel.zero_stage=1", "offload.policy=auto"])
def test_a_setting_export_does_not_read_exits_2(capsys, tmp_path, key):
    args = ["export-hf", QUICK, "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]
    assert main([*args, "--set", key]) == 2
    err = capsys.readouterr().err
    assert f"--set {key.split('=')[0]}: export-hf does not read this setting" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # a training run and two exports, about 15 s
def test_a_float16_export_holds_the_weights_rounded_to_float16(tmp_path):
    """``--dtype float16`` writes each weight as float32's export rounded to the nearest float16 (what
    ``torch.Tensor.half`` gives), and says so in ``config.json``."""
    import torch
    import transformers

    train = ["train", QUICK, *SMALL, "--steps", "2", "--out-dir", str(tmp_path / "o"), "--checkpoint-dir"]
    assert main([*train, str(tmp_path / "ck")]) == 0
    export = ["export-hf", QUICK, *SMALL, "--checkpoint-dir", str(tmp_path / "ck"), "--out"]
    assert main([*export, str(tmp_path / "f32")]) == 0
    assert main([*export, str(tmp_path / "f16"), "--dtype", "float16"]) == 0
    assert json.loads((tmp_path / "f16" / "config.json").read_text())["torch_dtype"] == "float16"
    load = lambda name: transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, torch_dtype=torch.float32)
    wide, half = load("f32").state_dict(), load("f16").state_dict()
    assert wide.keys() == half.keys()
    for name, w in wide.items():
        assert torch.equal(half[name], w.half().float()), name
    assert any(not torch.equal(half[n], w) for n, w in wide.items())  # float16 did round something


def test_a_weight_past_float16_s_range_is_refused_by_name(tmp_path):
    """A float32 weight beyond float16's 65,504 would be written as infinity: the export names the tensor and
    the value instead, and writes nothing."""
    from flax import nnx

    from hyperjax import load_config
    from hyperjax.errors import ConfigError
    from hyperjax.hf.convert import _flatten
    from hyperjax.hf.io import export_weights
    from hyperjax.models import build_model

    m = load_config(QUICK, ["model.layers=1"]).model
    params = dict(_flatten(nnx.to_pure_dict(nnx.state(build_model(m), nnx.Param))))
    params[("blocks", 0, "mlp", "w_in")] = np.asarray(params[("blocks", 0, "mlp", "w_in")]).copy()
    params[("blocks", 0, "mlp", "w_in")][3, 5] = 70000.0
    with pytest.raises(ConfigError, match=r"tensor 'transformer.h.0.mlp.c_fc.weight' \[256, 1024\] holds 70000"):
        export_weights(m, params, tmp_path, max_shard_bytes=1 << 30, dtype="float16")
    assert not list(tmp_path.iterdir())
    assert export_weights(m, params, tmp_path, max_shard_bytes=1 << 30, dtype="bfloat16") == ["model.safetensors"]


@pytest.mark.slow  # an import and two exports, about 15 s
def test_export_hf_float16_of_an_overflowing_weight_exits_2_naming_it(capsys, tmp_path):
    """Through the command line: a checkpoint whose weight the float16 cast would overflow exits 2 from
    ``export-hf --dtype float16`` with the tensor's name and value, no traceback and no folder written; bfloat16
    (float32's range) exports it."""
    from safetensors.numpy import load_file, save_file

    from tests.hf.models import make

    make("llama", tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    big = "model.layers.1.mlp.up_proj.weight"
    weights[big] = weights[big].copy()
    weights[big][2, 7] = -70000.0
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    args = ["export-hf", str(tmp_path / "q" / "config.yaml"), "--checkpoint-dir", str(tmp_path / "q" / "checkpoint")]
    assert main([*args, "--out", str(tmp_path / "f16"), "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert f"tensor '{big}' [48, 32] holds -70000" in err and "Traceback" not in err, err
    assert not (tmp_path / "f16").exists()
    assert main([*args, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "bf16" / "model.safetensors").is_file()
