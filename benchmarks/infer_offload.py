"""HyperOffload for serving on cloudmatrix384: the longest context one device's budget holds for decode.

A Llama-3-8B-shaped model (32 layers, 8 grouped KV heads: 128 KiB of cache per token) in bf16 decodes one
sequence on one CloudMatrix384 NPU under a 24 GiB device-memory budget (of its 128 GB HBM: the rest is taken
to be another tenant's, as when several models share a device). Every figure is the cost model's
(:func:`hyperjax.cost.inference.estimate_inference`) and the serving placement pass's
(:mod:`hyperjax.offload.serving`): the weights of each layer and its KV cache in blocks of 8192 tokens are
the groups; a host group is fetched over the NPU's host link during the layer before its own.

For each policy (``none``: everything on the device; ``greedy``: largest groups evicted first; ``exact``:
HiGHS, the fastest placement that fits) it reports the longest context that fits, with the per-token decode
time allowed to exceed the device-only step at the same context by at most 0 %, 10 %, 25 % or without limit,
and a plot of per-token time against context for each policy. The comparison with the published
71K -> 123K tokens (+70 %) closes the table.

Writes ``benchmarks/results/infer_offload.json`` and ``benchmarks/results/infer_offload.png``.

    python benchmarks/infer_offload.py
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax
from hyperjax.cost import estimate_inference
from hyperjax.offload import longest_context, per_token_curve
from seed_claims import LLAMA_8B

RESULTS = Path(__file__).parent / "results"
BUDGET_GIB = 24.0
BLOCK = 8192
CAPS = (0.0, 0.10, 0.25, None)
POLICIES = ("none", "greedy", "exact")
CLAIM = (71_000, 123_000)


def estimate():
    sets = [
        *(s for s in LLAMA_8B if not s.startswith("model.seq_len")),
        "model.seq_len=1048576",
        "hardware=cloudmatrix384",
        "emulate.devices=1",
        "parallel.data=1",
        "parallel.tensor=1",
        "train.global_batch=1",
        "train.dtype=bfloat16",
        "serve.batch=1",
        "serve.prompt_len=8192",
        "serve.new_tokens=1",
    ]
    return estimate_inference(hyperjax.resolve(hyperjax.load_config(None, sets), 1))


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    console = Console(width=140)
    est = estimate()
    budget = BUDGET_GIB * 2**30
    rows = []
    table = Table(title=f"longest context in {BUDGET_GIB:g} GiB, Llama-3-8B shape, batch 1, one cloudmatrix384 NPU")
    for col in ("per-token limit", "policy", "context", "ms/token", "device-only ms", "slowdown", "host GiB", "time s"):
        table.add_column(col, justify="left" if col in ("policy", "per-token limit") else "right")
    for cap in CAPS:
        for policy in POLICIES:
            start = time.perf_counter()
            r = longest_context(est, budget_bytes=budget, policy=policy, max_slowdown=cap, block_tokens=BLOCK)
            took = time.perf_counter() - start
            limit = "none" if cap is None else f"+{cap:.0%}"
            rows.append(
                {
                    "max_slowdown": cap,
                    "policy": policy,
                    "context": r.context,
                    "decode_s_per_token": r.decode_s_per_token,
                    "device_only_s_per_token": r.device_only_s_per_token,
                    "slowdown": r.slowdown,
                    "host_gib": r.host_gib,
                    "peak_gib": r.peak_gib,
                    "search_s": took,
                }
            )
            table.add_row(
                limit,
                policy,
                f"{r.context:,}",
                f"{r.decode_s_per_token * 1e3:.2f}",
                f"{r.device_only_s_per_token * 1e3:.2f}",
                f"{r.slowdown:+.1%}",
                f"{r.host_gib:.1f}",
                f"{took:.1f}",
            )
    console.print(table)
    base = next(r["context"] for r in rows if r["policy"] == "none")
    gains = {
        ("unlimited" if cap is None else f"{cap:.0%}"): next(
            r["context"] for r in rows if r["policy"] == "exact" and r["max_slowdown"] == cap
        )
        / base
        - 1
        for cap in CAPS
    }
    claim = CLAIM[1] / CLAIM[0] - 1
    console.print(
        f"claim: {CLAIM[0]:,} -> {CLAIM[1]:,} tokens ({claim:+.0%}); here, exact pass over no offload: "
        + ", ".join(f"{g:+.0%} within {k}" for k, g in gains.items())
    )
    contexts = list(range(BLOCK, 16 * BLOCK + 1, 2 * BLOCK))
    curves = {p: per_token_curve(est, contexts, budget_bytes=budget, policy=p, block_tokens=BLOCK) for p in POLICIES}
    device_only = [sum(x.rest_s + x.kv_read_s(c, est.run.hardware) for x in est.layers) + est.other_s for c in contexts]
    RESULTS.mkdir(exist_ok=True)
    out = {
        "model": "Llama-3-8B shape (32 layers, d_model 4096, 32 heads over 8 KV heads), bf16, batch 1",
        "hardware": est.run.hardware.name,
        "budget_gib": BUDGET_GIB,
        "block_tokens": BLOCK,
        "host_link_bytes_per_s": est.run.hardware.host.bandwidth,
        "longest": rows,
        "claim": {"from": CLAIM[0], "to": CLAIM[1], "gain": claim},
        "exact_gain_over_none": gains,
        "curve": {"context": contexts, "device_only_s": device_only, **{f"{p}_s": curves[p] for p in POLICIES}},
    }
    (RESULTS / "infer_offload.json").write_text(json.dumps(out, indent=2))
    plot(contexts, device_only, curves)
    print(f"wrote {RESULTS / 'infer_offload.json'} and {RESULTS / 'infer_offload.png'}")
    return 0


def plot(contexts, device_only, curves) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c / 1024 for c in contexts], [s * 1e3 for s in device_only], "k:", label="device only (no budget)")
    for p, style in zip(POLICIES, ("o-", "s--", "^-"), strict=True):
        pts = [
            (c / 1024, s * 1e3) for c, s in zip(contexts, curves[p], strict=True) if s is not None and math.isfinite(s)
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=p, markersize=4)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("decode ms per token")
    ax.set_yscale("log")
    ax.set_title(f"Llama-3-8B shape, one cloudmatrix384 NPU, {BUDGET_GIB:g} GiB budget")
    ax.legend()
    fig.tight_layout()
    tmp = RESULTS / ".infer_offload.png.tmp"
    fig.savefig(tmp, format="png")
    tmp.replace(RESULTS / "infer_offload.png")


if __name__ == "__main__":
    raise SystemExit(main())
