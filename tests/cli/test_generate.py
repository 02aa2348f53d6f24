"""``hyperjax generate``: a trained checkpoint restored onto any SPMD layout continues byte-level prompts;
greedy tokens do not depend on the layout; bad input exits 2 with the key named."""

import importlib
import json
from pathlib import Path

import pytest

from hyperjax.cli.main import main

QUICK = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
SMALL = ["--set", "model.layers=2", "--set", "model.d_model=64", "--set", "model.heads=4", "--set", "model.d_ff=128"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("gen")
    args = ["train", QUICK, *SMALL, "--steps", "3", "--out-dir", str(d / "out"), "--checkpoint-dir", str(d / "ck")]
    assert main(args) == 0
    return str(d / "ck")


def generate(capsys, checkpoint: str, *extra: str) -> dict:
    capsys.readouterr()
    args = ["generate", QUICK, *SMALL, "--checkpoint-dir", checkpoint, "--max-new-tokens", "12", "--json", *extra]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_prints_text_tokens_and_speeds(capsys, checkpoint):
    out = generate(capsys, checkpoint, "--prompt", "In the beginning", "--prompt", "And God said")
    assert set(out) >= {"text", "tokens", "prefill_s", "decode_tokens_per_s"}
    assert [len(t) for t in out["tokens"]] == [12, 12]
    assert out["text"][0].startswith("In the beginning") and out["text"][1].startswith("And God said")
    assert out["prefill_s"] > 0 and out["decode_tokens_per_s"] > 0 and out["step"] == 3


@pytest.mark.parametrize(
    "layout",
    [
        ["--devices", "1", "--set", "parallel.tensor=1"],
        ["--set", "parallel.tensor=4"],
        ["--set", "parallel.fsdp=8", "--set", "parallel.tensor=1"],
    ],
    ids=["one-device", "tensor4", "fsdp8"],
)
def test_greedy_tokens_do_not_depend_on_the_layout(capsys, checkpoint, layout):
    """The checkpoint written under data 4 x tensor 2 restores onto another mesh and decodes the same tokens."""
    prompts = ["--prompt", "In the beginning", "--prompt", "And the LORD spake"]
    ref = generate(capsys, checkpoint, *prompts)
    assert generate(capsys, checkpoint, *prompts, *layout)["tokens"] == ref["tokens"]


def test_a_continuation_stops_after_its_end_of_sequence_token(capsys, checkpoint, tmp_path):
    """As transformers and vLLM do: a continuation ends with the first end-of-sequence token it generates
    (``--eos-id``, else ``eos_token_id`` of generation_config.json beside the config, where import-hf copies
    it), each sequence on its own; ``--ignore-eos`` generates them all. The greedy tokens before it are the same."""
    prompts = ["--prompt", "In the beginning", "--prompt", "And God said"]
    full = generate(capsys, checkpoint, *prompts)["tokens"]
    eos = full[0][4]  # a token the first continuation reaches at its fifth
    cut = [row[: row.index(eos) + 1] if eos in row else row for row in full]
    assert cut[0] == full[0][: full[0].index(eos) + 1] and len(cut[0]) <= 5
    assert generate(capsys, checkpoint, *prompts, "--eos-id", str(eos))["tokens"] == cut
    config = tmp_path / "config.yaml"
    config.write_text(Path(QUICK).read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, eos]}))
    capsys.readouterr()
    args = ["generate", str(config), *SMALL, "--checkpoint-dir", checkpoint, "--max-new-tokens", "12", "--json"]
    assert main([*args, *prompts]) == 2  # 999 is past the 256-token vocabulary
    assert (
        "generation_config.json': end-of-sequence id 999 is not a token of model.vocab=256" in capsys.readouterr().err
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert main([*args, *prompts]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == cut
    assert main([*args, *prompts, "--ignore-eos"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == full
    assert main([*args, *prompts, "--ignore-eos", "--eos-id", "3"]) == 2
    assert "--eos-id 3 names a token to stop at, but --ignore-eos" in capsys.readouterr().err
    (tmp_path / "generation_config.json").write_text("[2]")
    assert main([*args, *prompts]) == 2
    assert "generation_config.json' must hold a JSON object, got list; fix it, or give --eos-id" in (
        capsys.readouterr().err
    )
    (tmp_path / "generation_config.json").write_text("{")
    assert main([*args, *prompts]) == 2
    assert "generation_config.json' is not valid JSON" in capsys.readouterr().err


def test_a_batch_of_ragged_prompts_decodes_each_as_alone(capsys, checkpoint):
    both = generate(capsys, checkpoint, "--prompt", "In", "--prompt", "And the LORD spake unto Moses")
    alone = generate(capsys, checkpoint, "--prompt", "And the LORD spake unto Moses")
    first = generate(capsys, checkpoint, "--prompt", "In")
    assert both["tokens"] == [first["tokens"][0], alone["tokens"][0]]


def test_sampling_is_seeded(capsys, checkpoint):
    args = ("--prompt", "In the", "--temperature", "1.0", "--top-k", "5", "--seed", "3")
    assert generate(capsys, checkpoint, *args)["tokens"] == generate(capsys, checkpoint, *args)["tokens"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0 must be a positive integer"),
        (["--prompt", "x" * 129], "longer than model.seq_len=128"),
        (["--prompt", "x" * 100, "--max-new-tokens", "40"], "learned positions reach model.seq_len=128"),
        (["--set", "model.d_model=128"], "was saved with shape"),
        (
            ["--set", "model.mlp=relu"],
            "was written for a model with model.mlp=gelu, but this config has model.mlp=relu",
        ),
        (["--set", "parallel.pipeline=2", "--set", "parallel.tensor=1"], "parallel.pipeline=2"),
        (["--top-k", "0"], "--top-k 0"),
        (["--top-k", "5"], "--top-k 5 shapes sampling, but --temperature 0 decodes greedily"),
        (["--seed", "7"], "--seed 7 shapes sampling, but --temperature 0 decodes greedily; set --temperature >= 1e-06"),
        (["--seed", "0"], "--seed 0 shapes sampling, but --temperature 0 decodes greedily"),
        (["--temperature", "1", "--seed", "-1"], "--seed -1 must be in [0, 2**63)"),
        (["--temperature", "1", "--seed", str(2**63)], f"--seed {2**63} must be in [0, 2**63)"),
        (["--temperature", "1e-46"], "--temperature 1e-46 must be 0 (greedy) or a finite number >= 1e-06"),
        (["--set", "parallel.context=2"], "parallel.context=2 cannot split over devices; set --set parallel.context=1"),
        (["--set", "parallel.sequence_parallel=true"], "set --set parallel.sequence_parallel=false"),
        (["--prompt-ids", "1,,2"], "--prompt-ids '1,,2' must be comma-separated integers"),
        (["--prompt-ids", "1,2,"], "--prompt-ids '1,2,' must be comma-separated integers"),
        (["--set", "train.lr=5"], "--set train.lr: generate does not read this setting"),
        (["--set", "offload.policy=auto"], "--set offload.policy: generate does not read this setting"),
        (["--set", "rl.group_size=4"], "--set rl.group_size: generate decodes the model with its own flags"),
        (["--tokenizer", "/"], "--tokenizer '/' is a folder; give the path of a tokenizer.json"),
    ],
    ids=[
        "no-new-tokens",
        "long-prompt",
        "past-positions",
        "other-model",
        "other-function",
        "pipeline",
        "top-k",
        "top-k-greedy",
        "seed-greedy",
        "seed-0-greedy",
        "seed-negative",
        "seed-too-large",
        "tiny-temperature",
        "context",
        "sequence-parallel",
        "empty-id",
        "trailing-comma",
        "training-setting",
        "offload",
        "rl-setting",
        "tokenizer-folder",
    ],
)
def test_bad_input_exits_2_naming_it(capsys, checkpoint, extra, message):
    prompt = [] if {"--prompt", "--prompt-ids"} & set(extra) else ["--prompt", "In"]
    base = ["generate", QUICK, *SMALL, "--checkpoint-dir", checkpoint, "--max-new-tokens", "4", *prompt]
    assert main([*base, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_training_settings_of_the_config_do_not_stop_another_layout(capsys, checkpoint, tmp_path):
    """Gradient buckets and FSDP's resharding are training's: on a layout without replicas or FSDP, generate and
    export-hf run as if unset (a run refuses them there, and --set of them is refused as having no effect)."""
    text = (
        Path(QUICK).read_text().replace("zero_stage: 0}", "zero_stage: 0, gradient_buckets: true, fsdp_reshard: false}")
    )
    config = tmp_path / "trained.yaml"
    config.write_text(text)
    one = ["--devices", "1", "--set", "parallel.tensor=1", *SMALL, "--checkpoint-dir", checkpoint]
    assert main(["generate", str(config), *one, "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert main(["predict", str(config), *one[:4], "--inference"]) == 0
    pytest.importorskip("transformers")
    assert main(["export-hf", str(config), *one, "--out", str(tmp_path / "hf")]) == 0


@pytest.mark.parametrize("config", [QUICK, str(Path(QUICK).with_name("grpo-tiny.yaml"))])
def test_no_checkpoint_exits_2(capsys, tmp_path, config):
    # an rl: config's model is generated from as a trained one is: its run is laid out, not refused
    args = ["generate", config, "--checkpoint-dir", str(tmp_path), "--prompt", "In", "--max-new-tokens", "4"]
    assert main(args) == 2
    assert "no checkpoint in --checkpoint-dir" in capsys.readouterr().err


def test_a_tokenizer_that_drops_characters_exits_2_naming_one(capsys, checkpoint, tmp_path):
    """A vocabulary without a prompt's character and without an unknown token drops it silently in
    ``tokenizers``; generate refuses the prompt instead of continuing a different one."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0, "h": 1}, "merges": []}}))
    base = ["generate", QUICK, *SMALL, "--checkpoint-dir", checkpoint, "--max-new-tokens", "2", "--tokenizer", str(tok)]
    assert main([*base, "--prompt", "ahia"]) == 2
    err = capsys.readouterr().err
    assert "drops 'i' of 'ahia'" in err and "Traceback" not in err
    # a word-level vocabulary without an unknown token raises inside tokenizers: named too (it was a traceback),
    # for the whole prompt ('zz') or for one of its characters alone ('a' of 'ab')
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"ab": 0, "b": 1}))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tok))
    for prompt, piece in (("ab zz", "ab zz"), ("ab", "a")):
        assert main([*base, "--prompt", prompt]) == 2
        err = capsys.readouterr().err
        assert f"tokenizer {str(tok)!r} cannot encode {piece!r} of {prompt!r} (" in err and "--prompt-ids" in err, err


def test_a_cache_larger_than_memory_exits_2_naming_the_new_tokens_that_fit(capsys, checkpoint, monkeypatch):
    """A KV cache the memory cannot hold is refused before it is allocated (a traceback from the allocator
    before): 1 prompt padded to the 4 data replicas, 2 layers of 4 heads x 16 fp32 keys and values, 4 KiB a
    position; 256 KiB hold 64 positions, 62 new tokens after a 2-token prompt, and those run."""
    monkeypatch.setattr(importlib.import_module("hyperjax.train.generate"), "machine_memory", lambda: 2**18)
    base = ["generate", QUICK, *SMALL, "--checkpoint-dir", checkpoint, "--prompt", "In"]
    assert main([*base, "--max-new-tokens", "63"]) == 2
    err = capsys.readouterr().err
    assert "the KV cache of 1 prompt(s), padded to 4 for the data-parallel replicas, 65 positions each" in err
    assert "at most 62 new tokens would fit; lower --max-new-tokens" in err and "Traceback" not in err
    assert main([*base, "--max-new-tokens", "62"]) == 0


def test_an_unreadable_checkpoint_exits_2_with_a_fix_for_generate(capsys, checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "ck"
    shutil.copytree(checkpoint, broken)
    for f in (broken / "3" / "state").rglob("*"):  # corrupt every array file of the last step
        if f.is_file() and f.name != "_METADATA":
            f.write_bytes(b"garbage")
    args = ["generate", QUICK, *SMALL, "--checkpoint-dir", str(broken), "--prompt", "In", "--max-new-tokens", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cannot be read" in err and "Traceback" not in err
    # the run kept its last step alone: nothing earlier to read (was advice for train: "train without --resume")
    assert "write the checkpoint again (hyperjax train, or import-hf), then run generate" in err
    assert "--resume" not in err


def test_a_checkpoint_that_lost_its_metadata_is_called_damaged_not_another_models(capsys, checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "ck"
    shutil.copytree(checkpoint, broken)
    (broken / "3" / "state" / "_METADATA").unlink()
    args = ["generate", QUICK, *SMALL, "--checkpoint-dir", str(broken), "--prompt", "In", "--max-new-tokens", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "lists no tensors: its metadata (orbax's _METADATA) is missing or empty" in err, err
    assert "written for another model" not in err and "Traceback" not in err
