"""The cost model's price of one mixture-of-experts block against the block measured on one GPU.

``benchmarks/gpu_moe_measure.py`` times, on a GPU with PyTorch, a rank's share of the published MoE runs
(GPT-OSS 120B at EP 8, Qwen3-30B-A3B at EP 16, Qwen3-235B-A22B at EP 32): attention, router, permutation,
the local experts' grouped products and the un-permutation, forward and backward, the all-to-alls left out.
This script prices the same block with ``price_layer`` on the matching preset (``dgx-h200`` for an H200) at
the same expert-parallel degree, and sets the two side by side, split the same way: the products (the
measured cuBLAS and CUTLASS kernels against the priced products, forward and backward), the attention core,
the rest of the kernels (element-wise work, permutation, router top-k and sort) against the priced
element-wise work, and the time the GPU ran nothing (the host launching, not priced).

    python benchmarks/gpu_moe.py        # reads benchmarks/results/moe-*-measured.json

Nothing is fitted to these measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

import hyperjax
from gpu_kernels import PRESETS, report_all, show
from hyperjax.cost import core_time, grouped_gemm_time, price_layer
from hyperjax.topology import axis_spans

VARIANT = "fused+sync"  # element-wise work compiled, the token counts read on the host: Megatron-Core's form


def price(b: dict, hw) -> dict:
    """``price_layer``'s forward and backward of the measured block (or its dense control), split as the
    profile is: products, the attention core, the rest."""
    sets = [
        f"hardware={hw.name}",
        f"emulate.devices={b['ep']}",
        "model.family=llama",
        "model.layers=1",
        f"model.d_model={b['d']}",
        f"model.heads={b['heads']}",
        f"model.kv_heads={b['kv']}",
        f"model.head_dim={b['hd']}",
        f"model.d_ff={b['top_k'] * b['ff']}",
        "model.vocab=32000",
        f"model.seq_len={b['tokens']}",
        f"model.bias={str(b['bias']).lower()}",
        "model.attention_kernel=flash",
        "model.attention_impl=cudnn",
        "train.dtype=bfloat16",
        f"train.global_batch={b['ep']}",
    ]
    if not b["dense"]:
        sets += [
            f"model.moe={{experts: {b['experts']}, top_k: {b['top_k']}, d_ff: {b['ff']}, router: softmax, "
            "load_imbalance: 1.0, first_dense: 0, every: 1}",
            f"parallel.expert={b['ep']}",
        ]
    cfg = hyperjax.load_config(None, sets)
    ep = 1 if b["dense"] else b["ep"]
    axes = {"data": b["ep"] // ep, "fsdp": 1, "expert": ep, "context": 1, "tensor": 1}
    spans = axis_spans(hw, axes, groups={"expert+tensor": ("expert", "tensor")})
    kw = dict(dtype="bfloat16", recompute="none", sequence_parallel=False, hardware=hw)
    c = price_layer(cfg.model, micro=1, axes=axes, spans=spans, moe=not b["dense"], dispatcher="alltoall", **kw)
    products = 3 * sum(c.products_s.values())  # the backward's two products for each of the forward's
    core = sum(core_time(cfg.model, micro=1, tp=1, cp=1, dtype="bfloat16", ring=False, hardware=hw))
    total = c.forward_s + c.backward_s
    return {"s": total, "products_s": products, "core_s": core, "rest_s": total - products - core}


def measured_split(b: dict) -> dict:
    per, k = 1 / b["layers"], b["kernel_s"]
    return {
        "s": b["s"] * per,
        "products_s": k.get("products", 0.0) * per,
        "core_s": k.get("attention", 0.0) * per,
        "rest_s": k.get("other", 0.0) * per,
        "idle_s": b["idle_s"] * per,
    }


def decode(measured: dict, hw) -> list[dict]:
    out = []
    for g in measured.get("decode_grouped", []):
        kw = dict(groups=g["experts"], bytes_per_element=2, dtype="bfloat16", hardware=hw)
        p = grouped_gemm_time(g["rows"], g["n"], g["k"], **kw)
        out.append({**g, "predicted_s": p, "error": p / g["s"] - 1})
    return out


def report(path: Path, console: Console) -> dict:
    measured = json.loads(path.read_text())
    preset = PRESETS[measured["device"]]
    hw = hyperjax.load_hardware(preset)
    rows = []
    for b in measured["blocks"]:
        if b["variant"] == VARIANT:
            m, p = measured_split(b), price(b, hw)
            rows.append({"case": b["case"], "dense": b["dense"], "measured": m, "predicted": p})
            rows[-1] |= {"error": p["s"] / m["s"] - 1, "busy_error": p["s"] / (m["s"] - m["idle_s"]) - 1}
    f = lambda x: f"{x * 1e3:.2f}"
    show(
        console,
        f"One block, forward and backward, on one {measured['device']} ({VARIANT}): measured vs price_layer "
        f"on {preset}, ms",
        ("block", "MLP", "total", "pred.", "error", "products", "pred.", "attention", "pred.", "rest", "pred.", "idle"),
        [
            (
                r["case"],
                "dense control" if r["dense"] else "experts",
                f(r["measured"]["s"]),
                f(r["predicted"]["s"]),
                f"{r['error']:+.0%}",
                *(f(r[w][k]) for k in ("products_s", "core_s", "rest_s") for w in ("measured", "predicted")),
                f(r["measured"]["idle_s"]),
            )
            for r in rows
        ],
    )
    extra = []  # what the experts add over the dense control: router, permutations, grouped products
    for r in rows:
        if r["dense"]:
            continue
        c = next(x for x in rows if x["dense"] and x["case"] == r["case"])
        d = {w: {k: r[w][k] - c[w][k] for k in ("products_s", "rest_s")} for w in ("measured", "predicted")}
        extra.append({"case": r["case"], **d})
    show(
        console,
        "What the experts add over the dense control (router, permutations, grouped products), ms",
        ("block", "products", "pred.", "rest", "pred.", "rest error"),
        [
            (
                e["case"],
                *(f(e[w][k]) for k in ("products_s", "rest_s") for w in ("measured", "predicted")),
                f"{e['predicted']['rest_s'] / e['measured']['rest_s'] - 1:+.0%}",
            )
            for e in extra
        ],
    )
    dec = decode(measured, hw)
    show(
        console,
        "A decode step's grouped product (copies routed at random, CUDA graph): measured vs grouped_gemm_time",
        ("K -> N", "experts", "copies", "touched", "measured us", "pred. us", "error"),
        [
            (
                f"{g['k']} -> {g['n']}",
                str(g["experts"]),
                str(g["rows"]),
                f"{g['touched']:.1f}",
                f"{g['s'] * 1e6:.1f}",
                f"{g['predicted_s'] * 1e6:.1f}",
                f"{g['error']:+.0%}",
            )
            for g in dec
        ],
    )
    return {
        "device": measured["device"],
        "preset": preset,
        "measured_file": path.name,
        "variant": VARIANT,
        "blocks": rows,
        "experts_over_dense": extra,
        "decode_grouped": dec,
    }


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    return report_all("moe", "gpu_moe_measure.py", report, width=140)


if __name__ == "__main__":
    sys.exit(main())
