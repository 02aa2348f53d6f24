"""Checkpoints, exact resume, supervised and elastic restarts, and a write cut short by SIGKILL."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from hyperjax import load_config, resolve, train
from hyperjax.cli.main import main
from hyperjax.errors import ConfigError
from hyperjax.train import prepare
from hyperjax.train.checkpoint import Checkpoints, saved_steps
from tests.tiers import SLOW

QUICK = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
# a smaller quickstart: 8 steps, a checkpoint every 2
SMALL = (
    "model.layers=2",
    "model.d_model=64",
    "model.heads=4",
    "model.d_ff=256",
    "model.seq_len=32",
    "train.global_batch=16",
    "train.steps=8",
    "train.checkpoint_every=2",
)


def _cfg(*more: str):
    return load_config(QUICK, [*SMALL, *more])


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@SLOW  # three runs and two resumes: about 20 s
def test_resume_is_bitwise_on_the_same_mesh_and_close_on_another(tmp_path: Path):
    plan = resolve(_cfg())
    whole = train(plan, checkpoint_dir=str(tmp_path / "a"), log=None)
    assert saved_steps(tmp_path / "a") == [4, 6, 8]  # train.keep_checkpoints: 3
    # the run as it stood after step 4: its checkpoint alone
    shutil.copytree(tmp_path / "a" / "4", tmp_path / "b" / "4")
    metrics = tmp_path / "m.jsonl"
    resumed = train(plan, checkpoint_dir=str(tmp_path / "b"), resume=True, metrics_out=str(metrics), log=None)
    assert resumed.losses == whole.losses  # bitwise
    assert _losses(metrics) == whole.losses  # the file covers the whole run, each step once
    # onto 4 devices under another strategy: restored resharded, the same numbers to 1e-4
    shutil.copytree(tmp_path / "a" / "4", tmp_path / "c" / "4")
    other = resolve(_cfg("emulate.devices=4", "parallel.tensor=1", "parallel.fsdp=2"))
    assert other.devices == 4 and other.axes["fsdp"] == 2
    moved = train(other, checkpoint_dir=str(tmp_path / "c"), resume=True, log=None)
    assert moved.losses[:4] == whole.losses[:4]
    np.testing.assert_allclose(moved.losses[4:], whole.losses[4:], rtol=1e-4)


@pytest.mark.parametrize(
    "sets",
    [
        ("parallel.tensor=1", "parallel.pipeline=2"),
        # parameters and optimizer state of layer 0 kept in pinned_host: saved from and restored to the host
        pytest.param(
            ("offload.policy=manual", 'offload.manual={"layers.0.params": host, "layers.0.optimizer": host}'),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["pipeline", "offload"],
)
def test_pipeline_and_offload_runs_resume_bitwise(tmp_path: Path, sets: tuple[str, ...]):
    plan = prepare(resolve(_cfg(*sets, "train.steps=6")))
    assert plan.run.pipelined or plan.offload.placement["layers.0.params"] == "host"
    whole = train(plan, checkpoint_dir=str(tmp_path / "a"), log=None)
    shutil.copytree(tmp_path / "a" / "2", tmp_path / "b" / "2")
    assert train(plan, checkpoint_dir=str(tmp_path / "b"), resume=True, log=None).losses == whole.losses


_WRITER = """
import os, signal, sys
import jax
jax.config.update("jax_platforms", "cpu"); jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from hyperjax.train.checkpoint import Checkpoints
mesh = jax.make_mesh((8,), ("d",))
def state(v):
    return {"w": jax.device_put(np.full((4096, 1024), v, np.float32), NamedSharding(mesh, P("d"))), "step": v}
import time
from pathlib import Path
meta = {"data": {}, "devices": 8, "strategy": "d=8"}
ckpt = Checkpoints(sys.argv[1], keep=3)
ckpt.save(1, state(1), {**meta, "step": 1, "records": [{"step": 1}]})
ckpt._manager.wait_until_finished()
ckpt.save(2, state(2), {**meta, "step": 2, "records": [{"step": 1}, {"step": 2}]})
folder = Path(sys.argv[1])
while not any(p.name.startswith("2.") for p in folder.iterdir()):  # the write has begun
    if (folder / "2").exists():
        sys.exit(3)  # finished before it could be interrupted
    time.sleep(0.001)
os.kill(os.getpid(), signal.SIGKILL)  # while checkpoint 2 is being written in the background
"""


def test_a_write_cut_short_leaves_the_previous_checkpoint(tmp_path: Path):
    done = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("2")]
    assert leftovers and all("tmp" in name for name in leftovers)  # checkpoint 2 was started, never finished
    mesh = jax.make_mesh((8,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    like = {"w": jax.device_put(np.zeros((4096, 1024), np.float32), sharding), "step": 0}
    ckpt = Checkpoints(tmp_path, keep=3)
    try:
        assert ckpt.latest_step() == 1
        restored = ckpt.restore(like)
        assert restored.step == 1 and restored.state["step"] == 1
        assert np.all(np.asarray(restored.state["w"]) == 1.0)
        # the run goes on and writes step 2 again
        ckpt.save(2, like, {"step": 2, "records": [{"step": 1}, {"step": 2}], "data": {}, "devices": 8, "strategy": ""})
    finally:
        ckpt.close()
    assert saved_steps(tmp_path) == [1, 2]


def _bad(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.slow  # a paired run, its resume and two refusals: the other resume tests hold the fast tier
def test_a_paired_runs_checkpoint_resumes_paired_and_is_refused_elsewhere_by_name(tmp_path: Path, capsys):
    """``parallel.overlap: fb-pair`` without a pipeline runs, and saves, as a pipeline of one stage: its
    checkpoint resumes under the same pairing, and an SPMD run or ``generate`` refuses it, naming fb-pair."""
    moe = str(Path(QUICK).parent / "moe-tiny.yaml")
    paired = ["--set", "parallel.expert=2", "--set", "parallel.overlap=fb-pair", "--set", "train.microbatches=2"]
    run = str(tmp_path / "run")
    assert main(["train", moe, *paired, "--steps", "2", "--checkpoint-dir", run, "--out-dir", str(tmp_path)]) == 0
    assert main(["train", moe, *paired, "--steps", "3", "--checkpoint-dir", run, "--resume"]) == 0
    assert re.search(r"resumed from \S+ \(step 2,", capsys.readouterr().out)
    err = _bad(
        ["train", moe, "--set", "parallel.expert=2", "--steps", "4", "--checkpoint-dir", run, "--resume"], capsys
    )
    assert "another pipeline layout" in err and "parallel.overlap=fb-pair runs and saves as a pipeline" in err
    err = _bad(["generate", moe, "--checkpoint-dir", run, "--prompt", "hi", "--max-new-tokens", "2"], capsys)
    assert "one pairing forwards and backwards" in err and "parallel.overlap other than fb-pair" in err


def test_checkpoint_mistakes_exit_2(tmp_path: Path, capsys):
    small = [a for s in SMALL for a in ("--set", s)]
    base = ["train", QUICK, *small]
    assert "--resume needs --checkpoint-dir" in _bad([*base, "--resume"], capsys)
    none = ["--resume", "--checkpoint-dir", str(tmp_path / "none"), "--out-dir", str(tmp_path / "out")]
    assert "--resume: no checkpoint in --checkpoint-dir" in _bad([*base, *none], capsys)
    assert not (tmp_path / "none").exists() and not (tmp_path / "out").exists()  # refused before any folder
    (tmp_path / "file").write_text("x")
    out = ["--out-dir", str(tmp_path / "out")]  # made when first written: a refused run leaves none
    assert "is a file" in _bad([*base, *out, "--checkpoint-dir", str(tmp_path / "file")], capsys)
    err = _bad([*base, *out, "--checkpoint-dir", str(tmp_path / "file" / "sub")], capsys)
    assert f"cannot be written ({str(tmp_path / 'file')!r} is a file)" in err
    assert "cannot be written" in _bad([*base, "--out-dir", "/proc/no/such"], capsys)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # a link to no folder: none can be made there
    for flag in ("--out-dir", "--checkpoint-dir"):
        assert "is not a folder (a link to none?)" in _bad([*base, flag, str(tmp_path / "dangling" / "x")], capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "nowhere").exists()
    assert "must be 0 or more" in _bad([*base, "--max-restarts", "-1", "--checkpoint-dir", str(tmp_path)], capsys)
    assert "needs --checkpoint-dir" in _bad([*base, "--max-restarts", "1"], capsys)
    assert "--devices 0 must be a positive integer" in _bad([*base, "--devices", "0"], capsys)
    joined = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
    err = _bad([*base, "--max-restarts", "1", "--checkpoint-dir", str(tmp_path / "j"), *joined], capsys)
    assert "do not combine it with --coordinator" in err
    run = tmp_path / "run"
    assert main([*base, "--steps", "2", "--checkpoint-dir", str(run), "--out-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert "already holds checkpoints (steps 2)" in _bad([*base, "--checkpoint-dir", str(run)], capsys)
    # another model, named by the key of the checkpoint's record that differs, before anything is read (generate,
    # which checks the arrays' shapes first, names the first tensor whose shape differs)
    err = _bad([*base, "--resume", "--checkpoint-dir", str(run), "--set", "model.d_ff=128"], capsys)
    assert "was written for a model with model.d_ff=256, but this config has model.d_ff=128" in err
    err = _bad([*base, "--resume", "--checkpoint-dir", str(run), "--set", "train.seed=1"], capsys)
    assert "train.seed=0 but this run has train.seed=1" in err
    # the optimizer's settings and schedule too: AdamW's state would go on under another learning rate
    err = _bad([*base, "--resume", "--checkpoint-dir", str(run), "--set", "train.lr=0.5"], capsys)
    assert re.search(r"train.lr=[\d.e-]+ but this run has train.lr=0.5: the optimizer would go on", err)
    err = _bad([*base, "--resume", "--checkpoint-dir", str(run), "--set", "train.warmup_steps=7"], capsys)
    assert "but this run has train.warmup_steps=7" in err
    # another model of the same tensor shapes, refused from the checkpoint's record before any folder is made
    relu = ["--resume", "--checkpoint-dir", str(run), "--set", "model.mlp=relu", "--out-dir", str(tmp_path / "o")]
    err = _bad([*base, *relu], capsys)
    assert "was written for a model with model.mlp=gelu, but this config has model.mlp=relu" in err
    assert not (tmp_path / "o").exists()
    as_pipeline = ["--set", "parallel.pipeline=2", "--set", "parallel.tensor=1"]
    err = _bad([*base, "--resume", "--checkpoint-dir", str(run), *as_pipeline], capsys)
    assert "no tensor params/0/" in err and "another pipeline layout" in err and "parallel.pipeline" in err
    # moved to 4 devices: the strategy is re-derived (data=4, tensor=2 -> data=2, tensor=2)
    moved = ["--resume", "--elastic", "--devices", "4", "--steps", "3", "--checkpoint-dir", str(run)]
    assert main([*base, *moved, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "training gpt on 4 emulated cloudmatrix384 devices" in out and "strategy: data=2, tensor=2" in out
    assert f"resumed from {run / '2'} (step 2, written on 8 devices under data=4, tensor=2)" in out
    assert saved_steps(run) == [2, 3]
    assert "--elastic changes the device count" in _bad([*base, "--elastic"], capsys)
    for f in (run / "3" / "state").rglob("*"):  # corrupt every array file
        if f.is_file() and f.name != "_METADATA":
            f.write_bytes(b"garbage")
    # from the shell: orbax's abandoned concurrent reads must not print over the one-line error
    done = subprocess.run(
        [sys.executable, "-m", "hyperjax", *base, "--resume", "--checkpoint-dir", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "cannot be read" in done.stderr and "to resume from step 2" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_reads_a_failed_restore_abandoned_are_not_reported_but_other_failures_are(tmp_path: Path, caplog, monkeypatch):
    """asyncio reports a failed future or task collected unread; those naming a file of a checkpoint whose
    restore did not finish are dropped, every other one (another folder, a sibling named alike, a checkpoint
    read whole) is kept."""
    import asyncio
    import gc
    import logging

    from hyperjax.train import quiet_reads

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the hooks it installs go with the test
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    try:
        with quiet_reads.reading(tmp_path / "run" / "2"):
            pass  # a restore that read the whole checkpoint leaves nothing of it quiet
        with pytest.raises(ConfigError), quiet_reads.reading(tmp_path / "run" / "3"):
            raise ConfigError("cannot be read")  # a failed restore: its abandoned reads end silently
        loop = asyncio.new_event_loop()
        for file in ("run/3/state/manifest.ocdbt", "run/31/state/x", "run/2/state/x", "other/x"):
            future = loop.create_future()
            future.set_exception(ValueError(f'DATA_LOSS: Error reading "{tmp_path / file}"'))
            del future
        gc.collect()
        loop.close()
    finally:
        logging.getLogger("asyncio").removeFilter(quiet_reads.reported_unread)
        quiet_reads.READ.discard(quiet_reads.folder_key(tmp_path / "run" / "3"))
    reported = sorted(str(r.exc_info[1]) for r in caplog.records if r.name == "asyncio")
    assert len(reported) == 3, reported
    assert "other/x" in reported[0] and "run/2/" in reported[1] and "run/31/" in reported[2], reported


class _Job:
    """``hyperjax train`` launched as emulated processes; kill one of them once a checkpoint is written."""

    def __init__(self, args: list[str], ckpt: Path) -> None:
        self.ckpt, self.lines = ckpt, []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hyperjax", "train", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def pids(self) -> list[int]:
        for line in list(self.lines):
            if "[launcher] started process 0" in line:
                return [int(p) for p in re.findall(r"pid (\d+)", line)]
        return []

    def kill_after_checkpoint(self, step: int, process: int) -> None:
        deadline = time.monotonic() + 600
        while not (self.pids() and step in saved_steps(self.ckpt)):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)[-3000:]
            time.sleep(0.02)
        assert self.proc.poll() is None, "the job ended before it could be interrupted"
        os.kill(self.pids()[process], signal.SIGKILL)

    def finish(self) -> str:
        self.proc.wait(timeout=900)
        self.reader.join(timeout=10)
        self.proc.stdout.close()
        out = "".join(self.lines)
        assert self.proc.returncode == 0, out[-4000:]
        return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("whole")
    args = [QUICK, *(a for s in SMALL for a in ("--set", s)), "--set", "emulate.processes=2"]
    job = _Job([*args, "--metrics-out", str(tmp / "m.jsonl"), "--out-dir", str(tmp)], tmp / "none")
    job.finish()
    return _losses(tmp / "m.jsonl")


@pytest.mark.multiprocess
@pytest.mark.parametrize("elastic", [False, True], ids=["same-devices", "elastic"])
def test_a_killed_process_is_restarted_from_the_checkpoint(tmp_path: Path, uninterrupted, elastic: bool):
    args = [QUICK, *(a for s in SMALL for a in ("--set", s)), "--set", "emulate.processes=2"]
    args += ["--metrics-out", str(tmp_path / "m.jsonl"), "--out-dir", str(tmp_path)]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--max-restarts", "1", *(["--elastic"] if elastic else [])]
    job = _Job(args, tmp_path / "ckpt")
    job.kill_after_checkpoint(4, process=1)  # after its second checkpoint
    out = job.finish()
    event = re.search(r"\[launcher\] restart 1/1: process 1 was killed by SIGKILL after step (\d+); (.*)", out)
    assert event, out[-4000:]
    # killed once checkpoint 4 existed; on a loaded machine a later one may have been written first
    resumed = re.search(r"resuming from the checkpoint of step (\d+)", event.group(2))
    assert resumed and int(resumed.group(1)) in (4, 6), event.group(0)
    assert f"{int(event.group(1)) - int(resumed.group(1))} step(s) replayed" in event.group(2)
    losses = _losses(tmp_path / "m.jsonl")
    assert len(losses) == len(uninterrupted) == 8
    if elastic:
        assert "on 4 devices (4 dropped with process 1" in event.group(2)
        assert "training gpt on 4 emulated cloudmatrix384 devices (1 process(es))" in out
        assert losses[:4] == uninterrupted[:4]
        np.testing.assert_allclose(losses, uninterrupted, rtol=1e-4)
    else:
        assert losses == uninterrupted  # every step, bitwise


@pytest.mark.multiprocess
def test_a_killed_pipeline_process_is_restarted_and_its_checkpoint_moves_between_process_counts(tmp_path: Path):
    """A 2-stage pipeline, one stage per process: each stage's state reaches the checkpoint from the process
    that holds it, a restart after SIGKILL replays the steps since it bitwise, and the checkpoint restores
    onto one process."""
    args = [QUICK, *(a for s in (*SMALL, "parallel.tensor=1", "parallel.pipeline=2") for a in ("--set", s))]
    whole = _Job(
        [
            *args,
            "--set",
            "emulate.processes=2",
            "--metrics-out",
            str(tmp_path / "whole.jsonl"),
            "--out-dir",
            str(tmp_path),
        ],
        tmp_path / "none",
    )
    whole.finish()
    uninterrupted = _losses(tmp_path / "whole.jsonl")
    ckpt = tmp_path / "ckpt"
    killed = [*args, "--set", "emulate.processes=2", "--metrics-out", str(tmp_path / "m.jsonl")]
    job = _Job([*killed, "--out-dir", str(tmp_path), "--checkpoint-dir", str(ckpt), "--max-restarts", "1"], ckpt)
    job.kill_after_checkpoint(4, process=1)
    out = job.finish()
    assert re.search(r"\[launcher\] restart 1/1: process 1 was killed by SIGKILL", out), out[-4000:]
    assert _losses(tmp_path / "m.jsonl") == uninterrupted  # every step, bitwise
    # the same checkpoint continued in one process
    shutil.copytree(ckpt / "4", tmp_path / "one" / "4")
    one = [*args, "--set", "emulate.processes=1", "--metrics-out", str(tmp_path / "one.jsonl")]
    assert main(["train", *one, "--out-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "one"), "--resume"]) == 0
    moved = _losses(tmp_path / "one.jsonl")
    assert moved[:4] == uninterrupted[:4]  # read back from the checkpoint's records
    np.testing.assert_allclose(moved[4:], uninterrupted[4:], rtol=1e-6)


def test_a_checkpoint_of_parameters_alone_or_another_model_names_the_fix():
    """A checkpoint an rl: run wrote holds parameters alone: resuming from it names that and the fix, not
    another pipeline layout; a shape mismatch read through rl.init_checkpoint names that key, not a flag."""
    import numpy as np

    from hyperjax.train.checkpoint import _check_shapes

    w = np.zeros((4, 4), np.float32)
    like = {"params": {"w": w}, "opt_state": {"mu": {"w": w}}}
    with pytest.raises(
        ConfigError, match=r"holds parameters only, no opt_state \(what an rl: run writes\), so it cannot"
    ):
        _check_shapes(like, {"params": {"w": w}}, "checkpoint 'ck/2'", verb="train --resume")
    with pytest.raises(ConfigError, match=r"rl.init_checkpoint with the model config it was written with, or point "):
        _check_shapes(
            {"params": {"w": w}}, {"params": {"w": np.zeros((2, 4))}}, "checkpoint 'ck/2'", "rl.init_checkpoint"
        )


def test_a_resumed_runs_step_time_leaves_out_both_compiling_steps_and_the_summary_names_each_stage():
    from hyperjax import load_config, resolve
    from hyperjax.train.loop import RunResult, summary

    times = [9.0, 1.0, 1.0, 7.0, 1.2, 1.2]  # compiled at the first step and at the resumed run's first, the 4th
    result = RunResult(losses=[1.0] * 6, step_times_s=times, memory_per_device=1, params=1, compiled=(0, 3))
    assert result.step_time_s == pytest.approx(1.1)
    run = resolve(load_config(Path(__file__).parents[2] / "configs/vlm-tiny-mpmd.yaml"))
    stages = summary(run, result)["stages"]
    assert [s["name"] for s in stages] == [s.name for s in run.stages] and len(stages) == 2
    assert [s["mesh"] for s in stages] == [dict(s.axes) for s in run.stages] and stages[0]["mesh"] != stages[1]["mesh"]
