"""Reliability on the emulated supernode: resident memory over a long run, and the cost of losing a process.

1. **Memory.** A 200-step run on 8 emulated devices, writing a checkpoint every 20 steps, records the
   resident memory of its process after every step (``rss_bytes`` in ``--metrics-out``). After the
   warm-up (compilation and the first two checkpoints, 40 steps) the resident memory must not grow.
   Reported: the resident memory every 20 steps, the growth from the first 20 steps after warm-up to the
   last 20 (window means, as the resident memory moves by tens of MiB from step to step) and the
   least-squares slope. The run is made twice: with a checkpoint every 20 steps, and every 4 steps (50
   checkpoints), where anything a checkpoint leaks would show five times as fast. "No growth" means less
   than 2 % between the two windows.
2. **Recovery.** The same model in 2 processes (4 devices each). One process is killed with SIGKILL
   after the checkpoint of step 8; the launcher (``--max-restarts 1``) stops the other and restarts the
   job from that checkpoint. Reported: the wall time against an uninterrupted run, the steps replayed, and
   whether every step's loss equals the uninterrupted run's (it must, bitwise). Then again with
   ``--elastic``: the restart drops the lost process's 4 devices and continues on 4 (losses within 1e-4).

Writes ``benchmarks/results/reliability.json``.

    python benchmarks/reliability.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hyperjax.files import write_json
from hyperjax.train import saved_steps

RESULTS = Path(__file__).parent / "results"
CONFIG = str(Path(__file__).parents[1] / "configs" / "quickstart.yaml")
MODEL = ["model.layers=2", "model.d_model=128", "model.heads=4", "model.d_ff=512", "model.seq_len=64"]
MODEL += ["train.global_batch=16"]
WARMUP = 40
WINDOW = 20
EVERY = {"checkpoint every 20 steps": 20, "checkpoint every 4 steps": 4}
MiB = 2**20


def _sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _train(args: list[str], *, kill_after: int | None = None, ckpt: Path | None = None) -> tuple[float, str]:
    """Run ``hyperjax train ARGS``; with ``kill_after``, SIGKILL process 1 once that checkpoint exists."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyperjax", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    if kill_after is not None:
        while True:
            pids = [re.findall(r"pid (\d+)", x) for x in list(lines) if "[launcher] started process 0" in x]
            if pids and kill_after in saved_steps(ckpt):
                os.kill(int(pids[0][1]), signal.SIGKILL)
                break
            if proc.poll() is not None:
                raise SystemExit("the run ended before it could be interrupted:\n" + "".join(lines)[-3000:])
            time.sleep(0.05)
    proc.wait()
    reader.join(timeout=10)
    proc.stdout.close()
    out = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"hyperjax train failed ({proc.returncode}):\n{out[-3000:]}")
    return time.perf_counter() - start, out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def memory(steps: int, tmp: Path, console: Console) -> dict:
    if steps < WARMUP + 2 * WINDOW:
        raise SystemExit(f"--steps {steps}: the memory run needs at least {WARMUP + 2 * WINDOW} steps")
    runs = {}
    for name, every in EVERY.items():
        tag = f"every{every}"
        args = [CONFIG, *_sets([*MODEL, f"train.steps={steps}", f"train.checkpoint_every={every}"])]
        args += ["--checkpoint-dir", str(tmp / f"mem-{tag}"), "--metrics-out", str(tmp / f"{tag}.jsonl")]
        wall, _ = _train([*args, "--out-dir", str(tmp)])
        records = _records(tmp / f"{tag}.jsonl")
        runs[name] = (wall, records, np.array([r["rss_bytes"] for r in records], dtype=float))
    table = Table(title=f"resident memory (MiB), {steps} steps on 8 emulated devices")
    table.add_column("step", justify="right")
    for name in runs:
        table.add_column(name, justify="right")
    for s in range(20, steps + 1, 20):
        table.add_row(str(s), *(f"{rss[s - 1] / MiB:.1f}" for _, _, rss in runs.values()))
    console.print(table)
    out = {"steps": steps, "warmup_steps": WARMUP, "window_steps": WINDOW, "runs": {}}
    for name, (wall, records, rss) in runs.items():
        after = np.arange(WARMUP, steps)  # indices of steps WARMUP+1 .. steps
        first, last = rss[WARMUP : WARMUP + WINDOW].mean(), rss[-WINDOW:].mean()
        slope = float(np.polyfit(after + 1, rss[after], 1)[0])
        growth = float(last - first)
        flat = abs(growth) < 0.02 * first
        console.print(
            f"{name}: mean of steps {WARMUP + 1}-{WARMUP + WINDOW} {first / MiB:.1f} MiB, of steps "
            f"{steps - WINDOW + 1}-{steps} {last / MiB:.1f} MiB: {growth / MiB:+.1f} MiB "
            f"({100 * growth / first:+.2f} %); "
            f"slope {slope / 1024:+.1f} KiB/step; peak-to-peak {np.ptp(rss[after]) / MiB:.1f} MiB "
            f"-> {'no growth (< 2 %)' if flat else 'GROWS'}"
        )
        out["runs"][name] = {
            "wall_s": wall,
            "median_step_time_s": float(np.median([r["step_time_s"] for r in records[1:]])),
            "rss_mib": [round(x / MiB, 2) for x in rss],
            "after_warmup_mib": first / MiB,
            "final_mib": last / MiB,
            "growth_mib": growth / MiB,
            "growth_fraction": growth / first,
            "slope_kib_per_step": slope / 1024,
            "peak_to_peak_mib": float(np.ptp(rss[after])) / MiB,
            "no_growth": bool(flat),
        }
    return out


def recovery(tmp: Path, console: Console) -> dict:
    steps, kill_after = 16, 8
    base = [CONFIG, *_sets([*MODEL, f"train.steps={steps}", "train.checkpoint_every=4", "emulate.processes=2"])]
    whole_s, _ = _train([*base, "--metrics-out", str(tmp / "whole.jsonl"), "--out-dir", str(tmp)])
    whole = [r["loss"] for r in _records(tmp / "whole.jsonl")]
    out: dict = {"steps": steps, "killed_after_checkpoint": kill_after, "uninterrupted_wall_s": whole_s, "runs": {}}
    table = Table(title=f"losing process 1 of 2 after the checkpoint of step {kill_after} ({steps} steps)")
    for col in ("restart", "wall (s)", "lost (s)", "steps replayed", "losses vs uninterrupted"):
        table.add_column(col, justify="right")
    table.add_row("(uninterrupted)", f"{whole_s:.1f}", "", "", "")
    for name, extra in (("same devices", []), ("elastic", ["--elastic"])):
        ckpt = tmp / f"ckpt-{name.replace(' ', '-')}"
        metrics = tmp / f"{name.replace(' ', '-')}.jsonl"
        args = [*base, "--checkpoint-dir", str(ckpt), "--max-restarts", "1", *extra]
        wall, log = _train(
            [*args, "--metrics-out", str(metrics), "--out-dir", str(tmp)], kill_after=kill_after, ckpt=ckpt
        )
        event = re.search(r"\[launcher\] (restart 1/1: .*)", log)
        replayed = re.search(r"(\d+) step\(s\) replayed", log)
        losses = [r["loss"] for r in _records(metrics)]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, whole, strict=True))
        same = "bitwise" if losses == whole else f"max rel {worst:.1e}"
        table.add_row(name, f"{wall:.1f}", f"{wall - whole_s:+.1f}", replayed.group(1) if replayed else "?", same)
        out["runs"][name] = {
            "wall_s": wall,
            "lost_s": wall - whole_s,
            "event": event.group(1) if event else None,
            "steps_replayed": int(replayed.group(1)) if replayed else None,
            "bitwise": losses == whole,
            "max_rel_loss_diff": worst,
        }
    console.print(table)
    for name, run in out["runs"].items():
        console.print(f"  {name}: [launcher] {run['event']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of the memory run")
    args = parser.parse_args()
    console = Console(width=120, highlight=False)
    with tempfile.TemporaryDirectory(prefix="hyperjax-reliability-") as tmp:
        result = {"memory": memory(args.steps, Path(tmp), console), "recovery": recovery(Path(tmp), console)}
    RESULTS.mkdir(exist_ok=True)
    write_json(RESULTS / "reliability.json", result)
    console.print(f"wrote {RESULTS / 'reliability.json'}")


if __name__ == "__main__":
    main()
