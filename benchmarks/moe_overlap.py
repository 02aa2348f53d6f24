"""How much of DeepSeek-V3-671B's expert all-to-all each overlap schedule hides, on 384 devices of three machines.

For each machine (384 NPUs of ``cloudmatrix384``, one unified bus; 384 GPUs of ``dgx-h100`` and 384 NPUs of
``ascend910c-cluster``, 8-device nodes on a scale-out network) it prices, with the cost model only:

- DeepSeek's own kind of layout (the config's: expert 64, pipeline 6, 1F1B, micro-batches of one
  sequence) without overlap and with ``fb-pair`` (DualPipe's F-B pairing);
- the same with micro-batches of two sequences, without overlap and with ``two-microbatch`` (which
  splits a micro-batch into halves, so it needs at least two sequences);
- the strategy search's best without overlap (``where={"parallel.overlap": "none"}``) and its best with the
  overlap schedules free.

Per row: step time, the all-to-all per step on the slowest stage (dispatch and combine of forward and
backward), what of it the compute waits for, the hidden fraction, and the gain over the same layout
without overlap. Writes ``benchmarks/results/moe_overlap.json`` and a Perfetto trace of the fastest
overlapped layout on ``cloudmatrix384`` (``moe_overlap.trace.json``, its all-to-all lane included).

    python benchmarks/moe_overlap.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax
from hyperjax.cost import write_trace

HERE = Path(__file__).parent
CONFIG = HERE.parent / "configs" / "deepseek-v3-671b.yaml"
MACHINES = ("cloudmatrix384", "dgx-h100", "ascend910c-cluster")
DEVICES = 384
LAYOUTS = {
    "deepseek layout (mb 1)": ([], ("none", "fb-pair")),
    "deepseek layout (mb 2)": (["train.micro_batch=2"], ("none", "two-microbatch", "fb-pair")),
}


def row(machine: str, layout: str, overlap: str, est: hyperjax.Estimate, plain: hyperjax.Estimate) -> dict:
    a = est.all_to_all
    return {
        "machine": machine,
        "layout": layout,
        "overlap": overlap,
        "strategy": est.run.describe(),
        "step_s": est.step_time_s,
        "all_to_all_s": a["total_s"],
        "exposed_s": a["exposed_s"],
        "hidden_fraction": a["hidden_fraction"],
        "gain": plain.step_time_s / est.step_time_s - 1,
        "peak_gib": est.memory_per_device_gib["peak"],
        "fits": est.fits,
    }


def machine_rows(machine: str) -> tuple[list[dict], hyperjax.Estimate]:
    rows, best = [], None
    for layout, (sets, overlaps) in LAYOUTS.items():
        ests = {}
        for overlap in overlaps:
            cfg = hyperjax.load_config(CONFIG, [f"hardware={machine}", *sets, f"parallel.overlap={overlap}"])
            ests[overlap] = hyperjax.estimate(hyperjax.resolve(cfg, DEVICES))
        for overlap, est in ests.items():
            rows.append(row(machine, layout, overlap, est, ests["none"]))
            if overlap != "none" and est.fits and (best is None or est.step_time_s < best.step_time_s):
                best = est
    cfg = hyperjax.load_config(CONFIG, [f"hardware={machine}"])
    start = time.perf_counter()
    plain = hyperjax.plan(cfg, DEVICES, keep=1, where={"parallel.overlap": "none"}).best[0].estimate
    free = hyperjax.plan(cfg, DEVICES, keep=1).best[0].estimate
    seconds = time.perf_counter() - start
    rows.append(row(machine, "searched, no overlap", "none", plain, plain))
    rows.append(row(machine, "searched, overlap free", free.run.overlap, free, plain))
    rows[-1]["search_s"] = seconds
    return rows, best


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    console = Console(width=200)
    rows, traced = [], None
    for machine in MACHINES:
        found, best = machine_rows(machine)
        rows += found
        if machine == "cloudmatrix384":
            traced = best
    table = Table(title=f"DeepSeek-V3-671B, {DEVICES} devices: the expert all-to-all under each overlap schedule")
    for col in ("machine", "layout", "overlap", "step s", "a2a s", "exposed s", "hidden", "gain", "peak GiB"):
        table.add_column(col, justify="left" if col in ("machine", "layout", "overlap") else "right")
    for r in rows:
        table.add_row(
            r["machine"],
            r["layout"],
            r["overlap"],
            f"{r['step_s']:.2f}",
            f"{r['all_to_all_s']:.2f}",
            f"{r['exposed_s']:.2f}",
            f"{r['hidden_fraction']:.0%}",
            f"{r['gain']:+.1%}",
            f"{r['peak_gib']:.0f}" + ("" if r["fits"] else " (over)"),
        )
    console.print(table)
    for r in rows:
        if r["layout"].startswith("searched"):
            console.print(f"{r['machine']}, {r['layout']}: {r['strategy']}", soft_wrap=True)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "moe_overlap.json").write_text(json.dumps({"devices": DEVICES, "rows": rows}, indent=2) + "\n")
    if traced is not None:
        write_trace(traced, out / "moe_overlap.trace.json", title=f"DeepSeek-V3-671B, {traced.run.describe()}")
    console.print(f"wrote {out / 'moe_overlap.json'} and {out / 'moe_overlap.trace.json'}")


if __name__ == "__main__":
    main()
