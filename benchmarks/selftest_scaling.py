"""How the emulated supernode scales on this machine: the collective selftest at growing device counts.

Runs ``hyperjax selftest`` (the public command line) for each device count, records the wall time from
launch to verdict, the processes the planner chose, and the slowest collective, prints one table and
writes ``benchmarks/results/selftest_scaling.json``.

    python benchmarks/selftest_scaling.py                      # 8, 256, 384 and 512 devices
    python benchmarks/selftest_scaling.py --devices 8 384      # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax

RESULTS = Path(__file__).parent / "results"


def run(hardware: str, devices: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "selftest.json"
        start = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hyperjax",
                "selftest",
                "--hardware",
                hardware,
                "--devices",
                str(devices),
                "--json",
                str(out),
            ],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            return {"devices": devices, "wall_s": wall, "passed": False, "error": (proc.stderr or proc.stdout)[-2000:]}
        data = json.loads(out.read_text())
    slowest = max(data["checks"], key=lambda c: c["time_s"])
    return {
        "devices": devices,
        "processes": data["processes"],
        "axes": data["axes"],
        "wall_s": wall,
        "passed": data["passed"],
        "collectives": len(data["checks"]),
        "slowest": f"{slowest['collective']} over {slowest['axis']}",
        "slowest_ms": slowest["time_s"] * 1e3,
        "checks": data["checks"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="cloudmatrix384")
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 256, 384, 512])
    parser.add_argument("--out", type=Path, default=RESULTS / "selftest_scaling.json")
    args = parser.parse_args()
    try:
        hyperjax.load_hardware(args.hardware)
    except hyperjax.HyperjaxError as e:
        parser.error(f"--hardware {args.hardware}: {e}")
    if min(args.devices) < 1:
        parser.error(f"--devices {min(args.devices)}: each run needs at least 1 device")

    rows = [run(args.hardware, n) for n in args.devices]
    table = Table(title=f"collective selftest on emulated {args.hardware} ({os.cpu_count()} CPU cores)")
    for col in ("devices", "processes", "mesh", "wall s", "checks", "slowest collective", "its ms"):
        table.add_column(col, justify="left" if col in ("mesh", "slowest collective") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(str(r["devices"]), "-", "-", f"{r['wall_s']:.1f}", "[red]FAILED[/red]", r["error"][-60:], "-")
            continue
        mesh = ",".join(f"{k}={v}" for k, v in r["axes"].items())
        verdict = f"{r['collectives']}/{r['collectives']} ok" if r["passed"] else "[red]FAIL[/red]"
        table.add_row(
            str(r["devices"]),
            str(r["processes"]),
            mesh,
            f"{r['wall_s']:.1f}",
            verdict,
            r["slowest"],
            f"{r['slowest_ms']:.1f}",
        )
    Console(width=140).print(table)
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"\n{r['devices']} devices failed:\n{r['error']}", file=sys.stderr)
    if failed:  # the committed results stay those of a run that completed
        sys.exit(f"{len(failed)} of {len(rows)} runs failed; {args.out} not written")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"hardware": args.hardware, "cpu_cores": os.cpu_count(), "machine": platform.machine(), "runs": rows},
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    if not all(r["passed"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
