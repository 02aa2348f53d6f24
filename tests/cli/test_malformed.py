"""Random malformed configs and command lines: every one exits 2 with a short message, quickly, no traceback."""

import dataclasses
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperjax.cli.main import main
from hyperjax.config import Config, EmulateConfig, ModelConfig, OffloadConfig, ParallelConfig, TrainConfig

QUICK = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
BASE = yaml.safe_load(QUICK.read_text())
SECTIONS = {"emulate": EmulateConfig, "model": ModelConfig, "train": TrainConfig, "parallel": ParallelConfig}
SECTIONS["offload"] = OffloadConfig
FOLDER = Path(tempfile.mkdtemp(prefix="hyperjax-malformed-"))

names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
junk = st.one_of(
    st.text("xyz!@# ", min_size=1, max_size=8).map(lambda s: "not a number " + s),
    st.lists(st.integers(), min_size=1, max_size=3),
    st.dictionaries(names, st.integers(), min_size=1, max_size=2),
)


def _fields(section: str, kind: type) -> list[str]:
    hints = typing.get_type_hints(SECTIONS[section])
    return [f.name for f in dataclasses.fields(SECTIONS[section]) if hints[f.name] in (kind, kind | None)]


@st.composite
def unknown_key(draw):
    section = draw(st.sampled_from(["", *SECTIONS]))
    fields = [f.name for f in dataclasses.fields(SECTIONS[section] if section else Config)]
    key = draw(names.filter(lambda k: k not in fields))
    return ((section, key), draw(st.integers())), "unknown config key"


@st.composite
def wrong_type(draw):
    section = draw(st.sampled_from(list(SECTIONS)))
    ints, floats, strs = _fields(section, int), _fields(section, float), _fields(section, str)
    key = draw(st.sampled_from(ints + floats + strs))
    value = draw(junk if key not in strs else st.one_of(st.integers(), st.lists(st.integers(), min_size=1)))
    if key in ints and not isinstance(value, str):
        value = draw(st.one_of(st.just(value), st.floats(0.1, 9.9).filter(lambda x: x != int(x)), st.booleans()))
    return ((section, key), value), f"{section}.{key}"


@st.composite
def out_of_range(draw):
    key, value = draw(
        st.one_of(
            st.tuples(
                st.sampled_from(
                    [
                        ("train", "global_batch"),
                        ("train", "steps"),
                        ("train", "checkpoint_every"),
                        ("model", "layers"),
                        ("model", "d_model"),
                        ("parallel", "tensor"),
                        ("emulate", "devices"),
                    ]
                ),
                st.integers(max_value=0),
            ),
            st.tuples(st.just(("train", "lr")), st.floats(max_value=0.0, allow_nan=False)),
            st.tuples(st.sampled_from([("train", "beta1"), ("train", "beta2")]), st.floats(1.0, 1e6)),
        )
    )
    return (key, value), f"{key[0]}.{key[1]}"


presets = names.map(
    lambda s: ("", "hardware"),
).flatmap(lambda k: names.map(lambda s: ((k, f"no-such-machine-{s}"), "hardware")))
# degrees and dimensions that no strategy splits (train and predict; plan searches its own degrees)
inconsistent = st.one_of(
    st.sampled_from([3, 5, 6, 7, 16]).map(lambda t: ((("parallel", "tensor"), t), "divide")),
    st.sampled_from([3, 5, 7]).map(lambda h: ((("model", "heads"), h), "heads")),
)


def _write(raw: object) -> str:
    path = FOLDER / f"c{time.monotonic_ns()}.yaml"
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return str(path)


def _check(args: list[str], capsys, expect: str) -> None:
    args = [*args, "--devices", "8"] if args[0] == "plan" else args
    start = time.monotonic()
    status = main(args)
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert status == 2, (args, err)
    assert "Traceback" not in err and err.startswith(f"hyperjax {args[0]}: error: "), err
    assert expect.lower() in err.lower() or (expect in ("", "hardware") and "hardware" in err.lower()), (expect, err)
    assert len(err) < 1200, err  # short
    assert took < 10, f"{args} took {took:.1f} s"


def _mutated(change: tuple) -> dict:
    (section, key), value = change
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    (raw.setdefault(section, {}) if section else raw)[key] = value
    return raw


every = st.one_of(unknown_key(), wrong_type(), out_of_range(), presets)
slow = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("command", ["train", "predict", "plan"])
@slow
@given(case=every)
def test_malformed_configs_exit_2(command: str, case, capsys):
    change, expect = case
    _check([command, _write(_mutated(change))], capsys, expect)


@pytest.mark.parametrize("command", ["train", "predict"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=inconsistent)
def test_inconsistent_degrees_exit_2(command: str, case, capsys):
    change, _ = case
    _check([command, _write(_mutated(change))], capsys, "")


@pytest.mark.parametrize("command", ["train", "predict", "plan"])
@slow
@given(
    case=st.one_of(
        st.sampled_from(["model: [1, 2", "{{", "model: {layers: 1}: 2", "- a\n- b"]).map(lambda t: (t, [])),
        st.sampled_from(["5", "model: 7", "train: [1]"]).map(lambda t: (t, [])),
        st.one_of(names, names.map(lambda s: f"={s}"), names.map(lambda s: f"train.steps.x{s}=1")).map(
            lambda s: (yaml.safe_dump(BASE), ["--set", s])
        ),
    )
)
def test_malformed_files_and_overrides_exit_2(command: str, case, capsys):
    text, extra = case
    _check([command, _write(text), *extra], capsys, "")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["predict", "BINARY"], "is not UTF-8 text"),
        (["predict", "FOLDER"], "is a folder with no config.json in it"),
        (["predict", "QUICK", "--set", "train.lr=.nan"], "train.lr=nan must be a finite number"),
        (["train", "QUICK", "--plan-only", "--set", "train.grad_clip=.inf"], "train.grad_clip=inf must be a finite"),
        (["predict", "QUICK", "--set", "train.weight_decay=-0.1"], "train.weight_decay=-0.1 must be >= 0"),
        (["predict", "QUICK", "--trace", "/proc/version"], "no file can be created in folder '/proc'"),
        (["train", "QUICK", "--plan-only", "--set", "shard={embd: [tensor]}"], "shard.embd: 'embd' is not a logical"),
        (["train", "GRPO", "--plan-only", "--set", "train.global_batch=7"], "rl.group_size = 8 x 8 = 64 sequences"),
        (["predict", "QUICK", "--set", "parallel.dispatcher=alltoall"], "but the model has no MoE layers"),
        (["predict", "QUICK", "--set", "train.fp8={recipe: rowwise, block: 64}"], "train.fp8.block=64 sets its tiles"),
        (["predict", "QUICK", "--hardware", ""], "--hardware '' names no preset"),
        (["predict", "QUICK", "--set", "model.rope_interleave=true"], "model.rope_interleave pairs rotary dim"),
        (["predict", "MOE", "--set", "model.moe.group_top_k=5"], "group_top_k=5 keeps that many of model.moe.groups=1"),
        # a setting of a part the model does not have: learned positions, the other balance method
        (["predict", "QUICK", "--set", "model.rope_theta=5e5"], "model.rope_theta=500000.0 is the rotary base frequ"),
        (
            ["predict", "MOE", "--set", "model.moe.balance=bias", "--set", "model.moe.aux_loss_weight=0.001"],
            "aux_loss_weight=0.001 applies to model.moe.balance=aux_loss, but model.moe.balance='bias' adds no",
        ),
        (
            ["predict", "MOE", "--set", "model.moe.bias_update_rate=0.01"],
            "bias_update_rate=0.01 applies to model.moe.balance=bias, but model.moe.balance='aux_loss' keeps no",
        ),
        (
            ["predict", "QUICK", "--set", "parallel.stage_layers=[3]"],
            "stage_layers=[3] gives each pipeline chunk its layers, but parallel.pipeline=1",
        ),
        (
            ["predict", "QUICK", "--set", "parallel.schedule=interleaved", "--set", "parallel.virtual_stages=2"],
            "parallel.virtual_stages=2 interleaves pipeline chunks, but parallel.pipeline=1",
        ),
        (["train", "QUICK", "--plan-only", "--metrics-out", "m.jsonl"], "--metrics-out names where training writes"),
        (["train", "GRPO", "--plan-only", "--checkpoint-dir", "ck"], "--checkpoint-dir names where training writes"),
        (["train", "QUICK", "--plan-only", "--out-dir", "out"], "--out-dir names where training writes"),
        (
            ["predict", "QUICK", "--inference", "--set", "serve.prompt_len=128"],
            "leaves none of it; set serve.new_tokens",
        ),
        # a built-in reward is checked by the commands that price the run too; a module:function only by train
        (["predict", "GRPO", "--set", "rl.reward=match:("], "rl.reward='match:(': '(' is not a regular expression"),
        (["plan", "GRPO", "--devices", "8", "--set", "rl.reward=word"], "the built-in 'word' takes an argument"),
        (["predict", "GRPO", "--set", "rl.reward=mach:x"], "did you mean the built-in 'match' (rl.reward: match:x)?"),
        # serve: is read by predict --inference alone
        (["predict", "QUICK", "--set", "serve.batch=4"], "would have no effect: drop it, or add --inference"),
        (["plan", "QUICK", "--devices", "8", "--set", "serve={batch: 2}"], "--set serve: serve: is the serving"),
        (["train", "QUICK", "--plan-only", "--set", "serve.new_tokens=3"], "train does not read it"),
        (
            ["generate", "QUICK", "--checkpoint-dir", "FOLDER", "--max-new-tokens", "2", "--set", "serve.batch=2"],
            "generate does not read it",
        ),
        # an rl: config's rollout derives its own: no --inference to add (predict refuses it for rl:)
        (["predict", "GRPO", "--set", "serve.batch=2"], "would have no effect: drop it\n"),
    ],
)
def test_files_and_values_that_cannot_be_used_exit_2(args, says, capsys, tmp_path):
    """A file that is not text, a folder, a number that is not finite, a --trace no file can be written
    beside (/proc takes none), a misspelt logical axis, an rl: config's batch set apart from its rollouts and
    settings no part of the run reads (a dispatcher without experts, an FP8 key of another recipe) exit 2
    naming what is wrong, before any work."""
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe model: {}")
    paths = {
        "BINARY": tmp_path / "binary.yaml",
        "FOLDER": tmp_path,
        "QUICK": QUICK,
        "GRPO": QUICK.parent / "grpo-tiny.yaml",
        "MOE": QUICK.parent / "moe-tiny.yaml",
    }
    _check([str(paths.get(a, a)) for a in args], capsys, says)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["predict", "--trace", ""], "argument --trace: '' names no file or folder"),
        (["train", "--plan-only", "--metrics-out", " "], "argument --metrics-out: ' ' names no file or folder"),
        (["train", "--out-dir", ""], "argument --out-dir: '' names no file or folder"),
    ],
)
def test_an_empty_path_is_refused_not_read_as_left_out(args, says, capsys):
    """A file or folder flag given an empty path exits 2 naming the flag (it once wrote nothing, silently)."""
    with pytest.raises(SystemExit) as e:
        main([args[0], str(QUICK), *args[1:]])
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "predict", "plan"])
def test_from_the_shell(command: str):
    path = _write(_mutated((("train", "global_batch"), "thirty-two")))
    done = subprocess.run(
        [sys.executable, "-m", "hyperjax", command, path, *(["--devices", "8"] if command == "plan" else [])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "train.global_batch" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""
