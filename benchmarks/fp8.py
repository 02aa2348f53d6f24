"""BF16 against each FP8 recipe, predicted on DGX H100, for Llama 3 8B, 70B and 405B and DeepSeek-V3 at published
layouts.

Each model runs the layout a published recipe gives it (below, with its source) in BF16 and then with
``train.fp8`` set to each recipe: ``tensorwise`` (Transformer Engine's current scaling, torchao's tensorwise),
``delayed`` (TE's delayed scaling, NeMo's default through 2024), ``rowwise`` (torchao) and ``blockwise``
(DeepSeek-V3's 1x128 / 128x128 tiles). The precision is the only change: the same strategy, the same
micro-batches. Printed per row: the step, the speed-up over BF16, the share of the step in FP8 products and
in casts, and peak memory. Measured speed-ups, where a source publishes a BF16 and an FP8 run of the same
setup, are printed beside them. Everything here is predicted by the cost model; nothing runs.
Writes ``benchmarks/results/fp8.json``.

    python benchmarks/fp8.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax

HERE = Path(__file__).parent
RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise")
LLAMA3 = ["model.family=llama", "model.vocab=128256", "model.rope_theta=500000.0", "model.seq_len=8192"]
LLAMA3 += ["model.attention_kernel=flash", "model.kv_heads=8", "train.dtype=bfloat16", "hardware=dgx-h100"]
LLAMA3 += ["parallel.context_impl=ring"]  # NeMo's context parallelism: Megatron-Core's ring
CASES = {
    "Llama 3 8B": {
        "layout": "8 GPUs: data 4 x context 2, 128 x 8192 tokens, micro-batch 1, ZeRO-1",
        "source": "NeMo 24.07 performance summary, LLAMA3-8B on DGX-H100 (calibration_fp8.yaml)",
        "sets": [
            *LLAMA3,
            "model.layers=32",
            "model.d_model=4096",
            "model.heads=32",
            "model.d_ff=14336",
            "emulate.devices=8",
            "parallel.context=2",
            "train.global_batch=128",
            "train.micro_batch=1",
            "parallel.zero_stage=1",
        ],
        # torchtitan's Llama 3.1 8B, FSDP on 8 and 128 H100s (500 W), BF16 against Float8 tensorwise, both
        # compiled: 6667 -> 8532 and 6514 -> 8380 tokens/s/GPU (calibration_torchtitan.yaml); NeMo AutoModel's
        # FP8 page: 'over 1.2x training speedup on 8xH100 with tensorwise scaling'
        "measured": {"tensorwise": "1.28x, 1.29x (torchtitan, FSDP 8 / 128); >1.2x (NeMo AutoModel)"},
    },
    "Llama 3 70B": {
        "layout": "64 GPUs: tensor 4 (sequence parallel) x pipeline 4 (interleaved, 5 chunks) x context 2 x data 2",
        "source": "NeMo 24.07 performance summary, LLAMA3-70B on DGX-H100 (calibration_fp8.yaml)",
        "sets": [
            *LLAMA3,
            "model.layers=80",
            "model.d_model=8192",
            "model.heads=64",
            "model.d_ff=28672",
            "emulate.devices=64",
            "parallel.tensor=4",
            "parallel.sequence_parallel=true",
            "parallel.pipeline=4",
            "parallel.virtual_stages=5",
            "parallel.schedule=interleaved",
            "parallel.context=2",
            "train.global_batch=128",
            "train.micro_batch=1",
            "parallel.zero_stage=1",
        ],
        "measured": {},
    },
    "Llama 3.1 405B": {
        "layout": "128 GPUs: tensor 4 x pipeline 8 (interleaved, 8 chunks) x context 2 x data 2, 64 x 8192 tokens",
        "source": "NeMo performance summary (25.02), LLAMA3-405B recipe layout (published for DGX-B200)",
        "sets": [
            *LLAMA3,
            "model.layers=126",
            "model.d_model=16384",
            "model.heads=128",
            "model.d_ff=53248",
            "emulate.devices=128",
            "parallel.tensor=4",
            "parallel.sequence_parallel=true",
            "parallel.pipeline=8",
            "parallel.virtual_stages=8",
            "parallel.schedule=interleaved",
            "parallel.context=2",
            "parallel.stage_layers=null",
            "train.global_batch=64",
            "train.micro_batch=1",
            "parallel.zero_stage=1",
        ],
        "measured": {},
    },
    "DeepSeek-V3 671B": {
        "layout": "2048 GPUs: pipeline 16 x expert 64 x data 2, 4096 x 4096 tokens, micro-batch 1, ZeRO-1",
        "source": "DeepSeek-V3 technical report (arXiv 2412.19437, 3.2: 16-way pipeline, 64-way expert "
        "parallelism over 8 nodes, ZeRO-1 data parallelism; trained in FP8 blockwise on H800)",
        "config": "deepseek-v3-671b.yaml",
        "sets": [
            "hardware=dgx-h100",
            "emulate.devices=2048",
            "parallel.pipeline=16",
            "parallel.expert=64",
            "parallel.zero_stage=1",
            "train.global_batch=4096",
            "train.micro_batch=1",
            "train.recompute=none",
        ],
        "measured": {},
    },
}


def predict(case: dict, recipe: str | None) -> dict:
    """One case in BF16 (``recipe`` None) or with that FP8 recipe."""
    sets = [*case["sets"], *([f"train.fp8.recipe={recipe}"] if recipe else [])]
    config = HERE.parent / "configs" / case["config"] if "config" in case else None
    est = hyperjax.estimate(hyperjax.resolve(hyperjax.load_config(config, sets)))
    fp8 = est.fp8 or {"products_s": 0.0, "cast_s": 0.0}
    return {
        "recipe": recipe or "bf16",
        "step_time_s": est.step_time_s,
        "products_share": fp8["products_s"] / est.step_time_s,
        "cast_share": fp8["cast_s"] / est.step_time_s,
        "peak_gib": est.memory_per_device_gib["peak"],
        "fits": est.fits,
        "strategy": est.run.describe(),
    }


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    console = Console(width=160)
    table = Table(title="BF16 against FP8 recipes, predicted on dgx-h100 at published layouts")
    for col in ("model", "precision", "step s", "speed-up", "FP8 products", "casts", "peak GiB", "measured speed-up"):
        table.add_column(col, justify="left" if col in ("model", "precision", "measured speed-up") else "right")
    results = []
    for name, case in CASES.items():
        bf16 = predict(case, None)
        rows = [bf16] + [predict(case, r) for r in RECIPES]
        for r in rows:
            r["speedup"] = bf16["step_time_s"] / r["step_time_s"]
            table.add_row(
                name if r is bf16 else "",
                r["recipe"],
                f"{r['step_time_s']:.3g}",
                f"{r['speedup']:.2f}x",
                f"{r['products_share']:.0%}" if r is not bf16 else "-",
                f"{r['cast_share']:.1%}" if r is not bf16 else "-",
                f"{r['peak_gib']:.0f}" + ("" if r["fits"] else " (does not fit)"),
                case["measured"].get(r["recipe"], ""),
            )
        table.add_section()
        results.append({"model": name, "layout": case["layout"], "source": case["source"], "rows": rows})
    console.print(table)
    for name, case in CASES.items():
        console.print(f"{name}: {case['layout']} [{case['source']}]")
    out = HERE / "results" / "fp8.json"
    out.write_text(json.dumps({"preset": "dgx-h100", "cases": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
