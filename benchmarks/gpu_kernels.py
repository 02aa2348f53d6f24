"""The cost model's kernel prices against kernels measured on one GPU.

``benchmarks/gpu_kernels_measure.py`` times, on a GPU with PyTorch, the kernels the published GPU runs call:
cuBLAS products of a transformer's shapes (large, skinny, per-expert), grouped products for experts
(``torch._grouped_mm``), fused attention (FlashAttention-2 and cuDNN through ``scaled_dot_product_attention``),
HBM streaming and one Llama-3-8B block forward and backward. This script sets each beside what the cost
model charges on the matching preset (``dgx-h200`` for an H200): ``gemm_time``, ``grouped_gemm_time``, the
fused-attention rates of the preset's ``device.attention_kernels`` and ``price_layer`` for the block.

    python benchmarks/gpu_kernels.py        # reads benchmarks/results/kernels-*-measured.json

Nothing here is fitted: the products are priced from the preset's datasheet peak, ``matmul_efficiency``,
``memory_efficiency`` and ``kernel_overhead``; the attention rates are the preset's, which cite the same
measurement (so that table shows how closely the preset's two-number form follows it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax
from hyperjax.cost import gemm_time, grouped_gemm_time, price_layer
from hyperjax.topology import axis_spans

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PRESETS = {"NVIDIA H200": "dgx-h200", "NVIDIA H100 80GB HBM3": "dgx-h100"}
LLAMA_BLOCK = [
    "emulate.devices=1",
    "model.family=llama",
    "model.layers=1",
    "model.d_model=4096",
    "model.heads=32",
    "model.kv_heads=8",
    "model.d_ff=14336",
    "model.vocab=128256",
    "model.rope_theta=500000",
    "model.attention_kernel=flash",
    "model.attention_impl=flash2",
    "train.dtype=bfloat16",
]


def err(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def products(measured: dict, hw) -> list[dict]:
    out = []
    for g in measured.get("gemm", []):
        p = gemm_time(g["m"], g["n"], g["k"], bytes_per_element=2, dtype="bfloat16", hardware=hw)
        out.append({**g, "predicted_s": p, "error": err(p, g["s"])})
    return out


def grouped(measured: dict, hw) -> list[dict]:
    out = []
    for g in measured.get("grouped", []):
        rows = g["groups"] * g["rows"]
        p = grouped_gemm_time(
            rows, g["n"], g["k"], groups=g["groups"], bytes_per_element=2, dtype="bfloat16", hardware=hw
        )
        out.append({**g, "predicted_s": p, "error": err(p, g["s"])})
    return out


def fp8_products(measured: dict, hw) -> list[dict]:
    """FP8 products (``torch._scaled_mm``) against ``gemm_time`` at the FP8 rate (one byte an element)."""
    out = []
    for g in measured.get("fp8", []):
        p = gemm_time(g["m"], g["n"], g["k"], bytes_per_element=1, dtype="fp8", hardware=hw)
        out.append({**g, "predicted_s": p, "error": err(p, g["s"])})
    return out


def fp8_rows(measured: dict, hw) -> list[dict]:
    """Each FP8 run's layer products (four a layer, forward and both gradients) summed, in BF16 and in FP8,
    measured and priced by ``gemm_time``: whether the FP8 runs' products are priced at the rate they reach."""
    sums: dict[str, dict] = {}
    for r in measured.get("fp8_rows", []):
        b, f = r["bf16"], r["fp8"]
        row = sums.setdefault(r["row"], {"row": r["row"], "bf16_s": 0.0, "fp8_s": 0.0, "bf16_pred_s": 0.0})
        row["fp8_pred_s"] = row.get("fp8_pred_s", 0.0)
        if "error" in b or "error" in f:
            row["failed"] = row.get("failed", 0) + 1
            continue
        row["bf16_s"] += b["s"]
        row["fp8_s"] += f["s"]
        row["bf16_pred_s"] += gemm_time(b["m"], b["n"], b["k"], bytes_per_element=2, dtype="bfloat16", hardware=hw)
        row["fp8_pred_s"] += gemm_time(f["m"], f["n"], f["k"], bytes_per_element=1, dtype="fp8", hardware=hw)
    for row in sums.values():
        row["bf16_error"] = err(row["bf16_pred_s"], row["bf16_s"])
        row["fp8_error"] = err(row["fp8_pred_s"], row["fp8_s"])
    return list(sums.values())


def attention(measured: dict, hw, key: str = "attention") -> list[dict]:
    names = {"flash": "flash2", "cudnn": "cudnn"}
    peak = hw.matmul_flops("bfloat16")
    out = []
    for a in measured.get(key, []):
        if "error" in a:
            continue
        fwd, bwd = hw.device.attention_rates(names[a["backend"]], a["seq"], a["dim"])
        flops = 4 * a["batch"] * a["heads"] * a["seq"] ** 2 * a["dim"] / 2
        pf = flops / (peak * fwd) + hw.device.kernel_overhead
        pb = 2.5 * flops / (peak * bwd) + hw.device.kernel_overhead
        out.append({**a, "fwd_predicted_s": pf, "bwd_predicted_s": pb, "fwd_error": err(pf, a["fwd_s"])})
        out[-1]["bwd_error"] = err(pb, a["bwd_s"])
    return out


def blocks(measured: dict, hw) -> list[dict]:
    axes = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    spans = axis_spans(hw, axes, groups={"expert+tensor": ("expert", "tensor")})
    out = []
    for b in [*measured.get("block_eager", []), *measured.get("block_compiled", [])]:
        if not isinstance(b, dict) or "s" not in b:
            continue
        cfg = hyperjax.load_config(
            None, [f"hardware={hw.name}", *LLAMA_BLOCK, f"model.seq_len={b['seq']}", f"train.global_batch={b['batch']}"]
        )
        c = price_layer(
            cfg.model,
            micro=b["batch"],
            axes=axes,
            spans=spans,
            dtype="bfloat16",
            recompute="none",
            sequence_parallel=False,
            hardware=hw,
        )
        p = c.forward_s + c.backward_s
        out.append({**b, "predicted_s": p, "error": err(p, b["s"])})
    return out


def timing(g: dict) -> tuple[str, ...]:
    """A product's measured microseconds and TFLOP/s, its predicted microseconds and the error."""
    return f"{g['s'] * 1e6:.1f}", f"{g['tflops']:.0f}", f"{g['predicted_s'] * 1e6:.1f}", f"{g['error']:+.0%}"


def ms(a: dict, key: str) -> tuple[str, ...]:
    """An attention pass's (``fwd`` or ``bwd``) measured and predicted milliseconds and the error."""
    return f"{a[f'{key}_s'] * 1e3:.2f}", f"{a[f'{key}_predicted_s'] * 1e3:.2f}", f"{a[f'{key}_error']:+.0%}"


def show(console: Console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def report(path: Path, console: Console) -> dict:
    measured = json.loads(path.read_text())
    preset = PRESETS[measured["device"]]
    hw = hyperjax.load_hardware(preset)
    res = {
        "device": measured["device"],
        "preset": preset,
        "measured_file": path.name,
        "products": products(measured, hw),
        "grouped": grouped(measured, hw),
        "attention": attention(measured, hw),
        "attention_widths": attention(measured, hw, "attention_widths"),
        "blocks": blocks(measured, hw),
        "stream": measured.get("stream"),
        "fp8": fp8_products(measured, hw),
        "fp8_rows": fp8_rows(measured, hw),
    }
    show(
        console,
        f"BF16 products on one {measured['device']}: measured vs {preset} (roofline + kernel overhead)",
        ("M x K x N", "measured us", "TFLOP/s", "predicted us", "error"),
        [(f"{g['m']} x {g['k']} x {g['n']}", *timing(g)) for g in res["products"]],
    )
    show(
        console,
        f"FP8 products (torch._scaled_mm, E4M3, per-tensor scales, bf16 out): measured vs {preset} at the FP8 rate",
        ("M x K x N", "measured us", "TFLOP/s", "predicted us", "error"),
        [(f"{g['m']} x {g['k']} x {g['n']}", *timing(g)) for g in res["fp8"]],
    )
    show(
        console,
        "The FP8 runs' layer products (QKV, attention out, MLP in and out; forward and both gradients), one layer, ms",
        ("run (per GPU)", "BF16", "pred.", "error", "FP8 (hybrid)", "pred.", "error", "speed-up", "pred."),
        [
            (
                r["row"],
                f"{r['bf16_s'] * 1e3:.2f}",
                f"{r['bf16_pred_s'] * 1e3:.2f}",
                f"{r['bf16_error']:+.0%}",
                f"{r['fp8_s'] * 1e3:.2f}",
                f"{r['fp8_pred_s'] * 1e3:.2f}",
                f"{r['fp8_error']:+.0%}",
                f"{r['bf16_s'] / r['fp8_s']:.2f}",
                f"{r['bf16_pred_s'] / r['fp8_pred_s']:.2f}",
            )
            for r in res["fp8_rows"]
            if not r.get("failed")
        ],
    )
    show(
        console,
        "Grouped products (torch._grouped_mm, equal rows per group): measured vs grouped_gemm_time",
        ("groups x rows", "K -> N", "measured us", "TFLOP/s", "predicted us", "error"),
        [(f"{g['groups']} x {g['rows']}", f"{g['k']} -> {g['n']}", *timing(g)) for g in res["grouped"]],
    )
    show(
        console,
        "Fused attention (causal, head_dim 128, 32 heads): measured vs the preset's attention_kernels",
        ("kernel", "batch x seq", "fwd ms", "pred.", "error", "bwd ms", "pred.", "error"),
        [(a["backend"], f"{a['batch']} x {a['seq']}", *ms(a, "fwd"), *ms(a, "bwd")) for a in res["attention"]],
    )
    show(
        console,
        "Fused attention at head widths 64, 128 and 256 (heads x width 4,096): measured vs attention_kernels",
        ("kernel", "width", "batch x seq", "fwd ms", "pred.", "error", "bwd ms", "pred.", "error"),
        [
            (a["backend"], str(a["dim"]), f"{a['batch']} x {a['seq']}", *ms(a, "fwd"), *ms(a, "bwd"))
            for a in res["attention_widths"]
        ],
    )
    show(
        console,
        "One Llama-3-8B block, forward and backward (FlashAttention-2): measured vs price_layer",
        ("batch x seq", "PyTorch", "measured ms", "predicted ms", "error"),
        [
            (
                f"{b['batch']} x {b['seq']}",
                "torch.compile" if b["compiled"] else "eager",
                f"{b['s'] * 1e3:.1f}",
                f"{b['predicted_s'] * 1e3:.1f}",
                f"{b['error']:+.0%}",
            )
            for b in res["blocks"]
        ],
    )
    big = [abs(g["error"]) for g in res["products"] if g["m"] * g["n"] * g["k"] >= 2**33]
    small = [abs(g["error"]) for g in res["products"] if g["m"] * g["n"] * g["k"] < 2**33]
    if big and small and res["grouped"]:  # a file may hold some sections only (--only)
        console.print(
            f"products: median |error| {statistics.median(big):.0%} over {len(big)} large, "
            f"{statistics.median(small):.0%} over {len(small)} small or skinny; grouped: median |error| "
            f"{statistics.median(abs(g['error']) for g in res['grouped']):.0%}"
        )
    return res


def report_all(stem: str, script: str, report, width: int = 130) -> int:
    """Run ``report`` on each ``benchmarks/results/<stem>-*-measured.json`` and write its result beside it
    (the same name without ``-measured``); 1 when ``script`` has not been run on a GPU yet."""
    console = Console(width=width)
    files = sorted(RESULTS.glob(f"{stem}-*-measured.json"))
    if not files:
        console.print(f"no benchmarks/results/{stem}-*-measured.json: run {script} on a GPU first")
        return 1
    for path in files:
        res = report(path, console)
        out = path.with_name(path.name.replace("-measured", ""))
        out.write_text(json.dumps(res, indent=1) + "\n")
        console.print(f"wrote {out}")
    return 0


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    return report_all("kernels", "gpu_kernels_measure.py", report)


if __name__ == "__main__":
    sys.exit(main())
