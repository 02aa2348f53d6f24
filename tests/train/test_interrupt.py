"""Ctrl-C while training: the run stops after a whole step, that step's checkpoint written and every write
finished, exit 130 with one line and no traceback; ``--resume`` goes on from it. A step folder an interrupted
deletion of an old checkpoint left (no ``_CHECKPOINT_METADATA``) is not a checkpoint, and is cleared away."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hyperjax.train.checkpoint import FINISHED, saved_steps
from tests.tiers import SLOW

CONFIG = """\
hardware: cloudmatrix384
emulate: {devices: 4}
model: {family: gpt, layers: 2, d_model: 64, heads: 4, d_ff: 128, vocab: 256, seq_len: 32}
train: {global_batch: 8, steps: 100000, data: text, checkpoint_every: 1}
parallel: {tensor: 2}
"""


AS_IN_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('hyperjax', run_name='__main__', alter_sys=True)"
)
"""``hyperjax`` with Python's own SIGINT handler, as a terminal's Ctrl-C meets it: a job started in the background
(CI's, say) ignores SIGINT, as would the run it starts (hyperjax keeps that), which would then train on."""


@SLOW  # a training process started and interrupted: about 20 s
def test_ctrl_c_stops_after_a_whole_step_with_its_checkpoint_written(tmp_path: Path):
    (tmp_path / "run.yaml").write_text(CONFIG)
    ck, out = tmp_path / "ck", tmp_path / "out"
    cli = [sys.executable, "-m", "hyperjax", "train", str(tmp_path / "run.yaml"), "--checkpoint-dir", str(ck)]
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_IN_A_TERMINAL, *cli[3:], "--out-dir", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while len(saved_steps(ck)) < 3:  # training, and deleting old checkpoints (train.keep_checkpoints: 3)
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "ERROR" not in err, err
    last = saved_steps(ck)[-1]
    assert f"hyperjax train: interrupted after step {last} of 100000; its checkpoint is {ck / str(last)}" in err
    folders = [p for p in ck.iterdir() if p.name.isdigit()]
    assert all((p / FINISHED).is_file() for p in folders) and len(folders) == 3  # none half-deleted
    assert (out / "loss.png").is_file()
    # a husk of an interrupted deletion is neither listed nor left; the run resumes from the last step
    (ck / "1" / "state").mkdir(parents=True)
    assert saved_steps(ck)[-1] == last and 1 not in saved_steps(ck)
    resumed = subprocess.run(
        [*cli, "--resume", "--steps", str(last + 1), "--out-dir", str(out)], capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ck / str(last)} (step {last}," in resumed.stdout
    assert not (ck / "1").exists() and saved_steps(ck)[-1] == last + 1
