"""HyperOffload on cloudmatrix384: the longest sequence and the largest model that fit one device's memory.

A Llama-3-8B-shaped model in bf16 on one CloudMatrix384 supernode (384 devices: 48-way data parallel x
8-way tensor parallel with sequence parallelism, one sequence per replica), every step priced by the cost
model. The device-memory budget is the preset's HBM (128 GB per device). For each policy:

- ``none``: no placement pass, ``train.recompute: none`` (everything kept on the device);
- ``none + selective`` / ``none + full``: the usual recomputation settings, without the pass, as stronger
  baselines;
- ``greedy``: evict by size x reuse distance until it fits (:func:`hyperjax.offload.greedy`);
- ``auto``: the exact pass (:func:`hyperjax.offload.solve_exact`).

Reported: the longest sequence (multiples of 1024 tokens) and the largest layer count (multiples of 4,
at 8192 tokens) that fit (device memory within the budget, host memory within the preset's), the
predicted step time there, and its slowdown against the same step with unlimited device memory (nothing
moved, nothing recomputed). Also the longest sequence and layer count ``auto`` reaches within a 10 %
slowdown, and a plot of step time against the budget at a fixed sequence.

Writes ``benchmarks/results/offload.json`` and ``benchmarks/results/offload-budget.png``.

    python benchmarks/offload.py
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax
from seed_claims import LLAMA_8B

RESULTS = Path(__file__).parent / "results"
HW = hyperjax.load_hardware("cloudmatrix384")
BUDGET_GIB = HW.device.hbm_bytes / 2**30
MODEL = [  # seq_len and layers are set per point
    *LLAMA_8B,
    "train.data=synthetic",
    "train.global_batch=48",
    "parallel.data=48",
    "parallel.tensor=8",
    "parallel.sequence_parallel=true",
]
POLICIES = {  # name: (offload.policy, train.recompute)
    "none": ("none", "none"),
    "none + selective": ("none", "selective"),
    "none + full": ("none", "full"),
    "greedy": ("greedy", "none"),
    "auto": ("auto", "none"),
}
SLOWDOWN = 0.10
SEQ_FOR_MODEL_SIZE = 8192


def config(policy: str, recompute: str, *, seq: int, layers: int = 32, budget: float = BUDGET_GIB):
    sets = [*MODEL, f"model.seq_len={seq}", f"model.layers={layers}", f"train.recompute={recompute}"]
    sets += [f"offload.policy={policy}", f"offload.device_memory_gib={budget}"]
    return hyperjax.resolve(hyperjax.load_config(None, [*sets, "hardware=cloudmatrix384"]))


def price(name: str, *, seq: int, layers: int = 32, budget: float = BUDGET_GIB) -> dict:
    """Step time, peak memory and fit of one policy at one size; ``unlimited_s``: nothing moved or recomputed."""
    policy, recompute = POLICIES[name]
    cfg = config(policy, recompute, seq=seq, layers=layers, budget=budget)
    unlimited = hyperjax.estimate(config("none", "none", seq=seq, layers=layers)).step_time_s
    if policy == "none":
        est = hyperjax.estimate(cfg)
        peak, step = est.memory_per_device_gib["peak"], est.step_time_s
        out = {"fits": peak <= budget, "step_time_s": step, "peak_gib": peak}
    else:
        plan = hyperjax.offload_pass(cfg)
        out = {"fits": plan.fits, "step_time_s": plan.priced.step_time_s, "peak_gib": plan.priced.peak_bytes / 2**30}
        out["host_gib"] = plan.priced.host_bytes / 2**30
        out["exposed_transfer_s"] = plan.priced.exposed_transfer_s
        out["placement"] = {o: len(plan.placement.on(o)) for o in ("host", "recompute")}
    return out | {
        "unlimited_s": unlimited,
        "slowdown": out["step_time_s"] / unlimited - 1,
        "seq": seq,
        "layers": layers,
    }


def largest(ok: Callable[[int], bool], start: int, cap: int) -> int:
    """The largest ``k <= cap`` with ``ok(k)``, assuming ``ok`` holds up to some point: doubling from
    ``start`` until it fails, then bisecting (so the problems priced stay near the answer). 0 if none."""
    lo = start
    if not ok(lo):
        lo = 0
        for k in range(start - 1, 0, -1):  # below the start: step down
            if ok(k):
                lo = k
                break
        return lo
    hi = lo
    while hi < cap:
        nxt = min(cap, 2 * hi)
        if not ok(nxt):
            hi = nxt - 1
            break
        lo = hi = nxt
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    RESULTS.mkdir(exist_ok=True)
    start = time.perf_counter()
    console = Console(width=150)
    seq_rows, size_rows, seq_within, size_within = {}, {}, {}, {}
    step = 4  # layers are searched in steps of 4

    def fits(r: dict, within: bool) -> bool:
        return r["fits"] and (not within or r["slowdown"] <= SLOWDOWN + 1e-12)

    for name in POLICIES:
        for within, seqs, sizes in ((False, seq_rows, size_rows), (True, seq_within, size_within)):
            k = largest(lambda k, name=name, w=within: fits(price(name, seq=1024 * k), w), 4, 1024)
            seqs[name] = price(name, seq=1024 * k) if k else None
            n = largest(
                lambda n, name=name, w=within: fits(price(name, seq=SEQ_FOR_MODEL_SIZE, layers=step * n), w), 8, 160
            )
            sizes[name] = price(name, seq=SEQ_FOR_MODEL_SIZE, layers=step * n) if n else None
        got = [
            (r or {}).get(key, 0)
            for r, key in zip(
                (seq_rows[name], size_rows[name], seq_within[name], size_within[name]),
                ("seq", "layers") * 2,
                strict=True,
            )
        ]
        print(f"{name}: {got[0]:,} tokens, {got[1]} layers; within {SLOWDOWN:.0%}: {got[2]:,} tokens, {got[3]} layers")
    auto_within, auto_size_within = seq_within["auto"], size_within["auto"]

    base_seq, base_layers = seq_rows["none"]["seq"], size_rows["none"]["layers"]
    table = Table(title=f"what fits {BUDGET_GIB:.0f} GiB per device (Llama-8B shape, 384 devices)")
    cols = ("policy", "tokens", "x none", "step s", "slowdown", "peak GiB", "host GiB")
    cols += ("tokens, slowdown <= 10 %", "x none", "layers (8K tokens)", "layers, slowdown <= 10 %", "x none")
    for col in cols:
        table.add_column(col, justify="right")
    for name in POLICIES:
        r, w, m, mw = seq_rows[name], seq_within[name], size_rows[name], size_within[name]
        table.add_row(
            name,
            f"{r['seq']:,}",
            f"{r['seq'] / base_seq:.2f}",
            f"{r['step_time_s']:.3f}",
            f"{r['slowdown']:+.1%}",
            f"{r['peak_gib']:.1f}",
            f"{r.get('host_gib', 0.0):.1f}",
            f"{w['seq']:,}" if w else "-",
            f"{w['seq'] / base_seq:.2f}" if w else "-",
            f"{m['layers']}",
            f"{mw['layers']}" if mw else "-",
            f"{mw['layers'] / base_layers:.2f}" if mw else "-",
        )
    console.print(table)

    # step time against the budget, at the sequence 1.7x the longest that fits without the pass
    seq = 1024 * round(1.7 * base_seq / 1024)
    budgets = [8 * i for i in range(1, 17)]
    curve = {
        name: [price(name, seq=seq, budget=b) for b in budgets] for name in ("none", "none + full", "greedy", "auto")
    }
    _plot(curve, budgets, seq)
    summary = {
        "hardware": HW.name,
        "budget_gib": BUDGET_GIB,
        "model": MODEL,
        "longest_sequence": seq_rows,
        "largest_model_layers_at_8k": size_rows,
        "longest_sequence_within_10pct": seq_within,
        "largest_model_layers_at_8k_within_10pct": size_within,
        "sequence_gain_auto_vs_none": seq_rows["auto"]["seq"] / base_seq,
        "sequence_gain_auto_within_10pct_vs_none": auto_within["seq"] / base_seq,
        "layers_gain_auto_within_10pct_vs_none": auto_size_within["layers"] / base_layers,
        # the strongest baseline without the pass: the best recomputation setting at the same slowdown allowance
        "sequence_gain_auto_within_10pct_vs_best_recompute": auto_within["seq"]
        / max(seq_within[k]["seq"] for k in POLICIES if POLICIES[k][0] == "none" and seq_within[k]),
        "layers_gain_auto_within_10pct_vs_best_recompute": auto_size_within["layers"]
        / max(size_within[k]["layers"] for k in POLICIES if POLICIES[k][0] == "none" and size_within[k]),
        "budget_curve": {"sequence": seq, "budgets_gib": budgets, "policies": curve},
        "search_s": time.perf_counter() - start,
    }
    out = RESULTS / "offload.json"
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out)
    print(
        f"auto vs none: {summary['sequence_gain_auto_vs_none']:.2f}x the sequence; within a 10 % slowdown "
        f"{summary['sequence_gain_auto_within_10pct_vs_none']:.2f}x the sequence and "
        f"{summary['layers_gain_auto_within_10pct_vs_none']:.2f}x the layers; against the best recomputation "
        f"setting within 10 %: {summary['sequence_gain_auto_within_10pct_vs_best_recompute']:.2f}x the sequence, "
        f"{summary['layers_gain_auto_within_10pct_vs_best_recompute']:.2f}x the layers"
    )
    print(f"wrote {out} and {RESULTS / 'offload-budget.png'} ({summary['search_s']:.0f} s)")


def _plot(curve: dict, budgets: list[int], seq: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, rows in curve.items():
        xs = [b for b, r in zip(budgets, rows, strict=True) if r["fits"]]
        ys = [r["step_time_s"] for r in rows if r["fits"]]
        ax.plot(xs, ys, marker="o", label=name)
    unlimited = curve["auto"][0]["unlimited_s"]
    ax.axhline(unlimited, color="grey", linestyle=":", label="unlimited memory")
    ax.set(xlabel="device-memory budget (GiB)", ylabel="predicted step time (s)")
    ax.set_title(f"Llama-8B shape, {seq:,} tokens, 384 cloudmatrix384 devices: step time against budget", fontsize=10)
    ax.legend()
    fig.tight_layout()
    path = RESULTS / "offload-budget.png"
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)


if __name__ == "__main__":
    main()
