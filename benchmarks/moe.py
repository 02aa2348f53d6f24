"""DeepSeek-V3-671B on one supernode against conventional clusters of the same size, across expert degrees.

For each machine (384 NPUs of ``cloudmatrix384``: one unified bus; 384 GPUs of ``dgx-h100`` and 384 NPUs of
``ascend910c-cluster``: 8-device nodes joined by a 50 GB/s-per-device scale-out network) and each expert
degree the model's 256 experts allow (8 to 256), the strategy search (``hyperjax.plan`` with
``where={"parallel.expert": EP}``) finds the fastest layout that fits, searching data, fsdp, ZeRO, tensor
(with the experts' hidden widths split over it or the experts spread over it too), pipeline schedules,
micro-batch sizes and recomputation. Everything is predicted by the cost model; nothing runs.

Reported per row: the step time, tokens per second per device, the all-to-all time (dispatch and combine,
forward and backward, on the busiest device) and its share of the step, which tier carries it, and the peak
memory per device. Writes ``benchmarks/results/moe.json`` and ``benchmarks/results/moe.png``.

    python benchmarks/moe.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

import hyperjax

HERE = Path(__file__).parent
CONFIG = HERE.parent / "configs" / "deepseek-v3-671b.yaml"
MACHINES = ("cloudmatrix384", "dgx-h100", "ascend910c-cluster")
EXPERT_DEGREES = (8, 16, 32, 64, 128, 256)
DEVICES = 384


def best(machine: str, expert: int) -> dict | None:
    """The fastest fitting strategy with ``expert`` as its expert degree on 384 devices of ``machine``."""
    cfg = hyperjax.load_config(CONFIG, [f"hardware={machine}"])
    try:
        found = hyperjax.plan(cfg, DEVICES, keep=1, where={"parallel.expert": expert})
    except hyperjax.HyperjaxError as e:
        return {"machine": machine, "expert": expert, "fits": False, "why": str(e).split(";")[0]}
    top = found.best[0]
    est, run = top.estimate, top.run
    tokens = cfg.train.global_batch * cfg.model.seq_len
    stage = est.stages[est.critical]
    spans = stage.spans
    exchange = spans["expert+tensor"] if not run.expert_tensor_split else spans["expert"]
    a2a = est.communication_s["expert_parallel"]
    return {
        "machine": machine,
        "expert": expert,
        "fits": True,
        "strategy": ", ".join(f"{k}={v}" for k, v in run.parallel.items() if v > 1 and k != "expert_tensor")
        + (f", {run.schedule}" if run.pipelined else "")
        + (", experts spread over tensor too" if not run.expert_tensor_split else ""),
        "experts_over": run.parallel["expert"] * (1 if run.expert_tensor_split else run.parallel["tensor"]),
        "recompute": run.recompute,
        "step_time_s": est.step_time_s,
        "tokens_per_s_per_device": tokens / est.step_time_s / DEVICES,
        "mfu": est.mfu,
        "all_to_all_s": a2a,
        "all_to_all_share": a2a / est.step_time_s,
        "exchange_tiers": [f"{name} x{ranks}" for name, ranks in exchange.levels],
        "peak_gib": est.memory_per_device_gib["peak"],
        "breakdown_s": est.breakdown_s,
        "searched": found.searched,
        "seconds": found.seconds,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    start = time.perf_counter()
    rows = [best(machine, ep) for machine in MACHINES for ep in EXPERT_DEGREES]
    table = Table(title=f"DeepSeek-V3-671B, {DEVICES} devices, 1536 x 4096 tokens per step (predicted)")
    for col in ("machine", "EP", "step s", "tok/s/dev", "MFU", "all-to-all s", "share", "exchange over", "peak GiB"):
        table.add_column(col, justify="left" if col in ("machine", "exchange over") else "right")
    for r in rows:
        if not r["fits"]:
            why = r["why"] if len(r["why"]) <= 40 else r["why"][:39] + "…"  # in full below the table
            table.add_row(r["machine"], str(r["expert"]), "-", "-", "-", "-", "-", why, "-")
            continue
        table.add_row(
            r["machine"],
            str(r["expert"]),
            f"{r['step_time_s']:.2f}",
            f"{r['tokens_per_s_per_device']:.0f}",
            f"{r['mfu']:.1%}",
            f"{r['all_to_all_s']:.2f}",
            f"{r['all_to_all_share']:.1%}",
            ", ".join(r["exchange_tiers"]),
            f"{r['peak_gib']:.0f}",
        )
    console = Console(width=160)
    console.print(table)
    for r in rows:
        if not r["fits"] and len(r["why"]) > 40:
            console.print(f"{r['machine']}, EP {r['expert']}: {r['why']}", highlight=False)
    for machine in MACHINES:
        fitting = [r for r in rows if r["machine"] == machine and r["fits"]]
        if fitting:
            top = min(fitting, key=lambda r: r["step_time_s"])
            console.print(f"{machine}: fastest at EP {top['expert']}: {top['strategy']}, {top['recompute']} recompute")
    out = HERE / "results" / "moe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"devices": DEVICES, "rows": rows}, indent=2))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for machine in MACHINES:
        fitting = [r for r in rows if r["machine"] == machine and r["fits"]]
        eps = [r["expert"] for r in fitting]
        left.plot(eps, [r["tokens_per_s_per_device"] for r in fitting], marker="o", label=machine)
        right.plot(eps, [r["all_to_all_share"] * 100 for r in fitting], marker="o", label=machine)
    for ax, label in ((left, "tokens/s per device"), (right, "all-to-all, % of the step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("expert-parallel degree")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle("DeepSeek-V3-671B on 384 devices, best strategy per expert degree (predicted)")
    fig.tight_layout()
    fig.savefig(HERE / "results" / "moe.png", dpi=120)
    print(f"wrote {out} and moe.png in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
