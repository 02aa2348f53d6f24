"""The cost model against published, measured training runs.

Each file in ``benchmarks/validation/`` describes one published run (source, measured step time and model
TFLOP/s) and holds hyperjax's config for it: dense runs (Korthikanti et al.) and mixtures of experts
(Megatron-Core's Qwen3-235B runs, Megatron-Bridge's GPT-OSS-120B); ``fp8/`` holds NeMo's FP8 runs on DGX
H100 (Transformer Engine's delayed scaling) and ``torchtitan/`` torchtitan's Llama 3.1 8B runs with and
without Float8 on 500 W, 96 GB H100s, whose peak memory is printed beside the step time; ``tpu/`` MaxText's
published runs of its 2023 decoders on 1 to 32 TPU v5e pods, and ``tpu-v6e/`` its recipes' runs on TPU v6e
(Trillium), added with their sources and not used to calibrate. This script resolves every run
(``hyperjax.resolve``), predicts it (``hyperjax.estimate``; a run with an ``offload.policy`` under its placement,
as ``predict`` prices it) on the run's hardware preset, and prints
predicted vs measured step time and model TFLOP/s per device (with the source's own FLOP count: Korthikanti's
eq. 7, or the figure the source prints), and the mean absolute percentage error of each kind.
Serving is checked the same way against published measured inference runs (``benchmarks/validation/inference/``:
LMDeploy, TensorRT-LLM, torchao, vLLM and gpt-fast figures on A100 and H100, one device and tensor-parallel):
``hyperjax.cost.inference.estimate_inference`` predicts each one's decode time per token and prefill, and the
table prints them beside the measured ones.
Nothing here is fitted to these rows: the preset constants come from datasheets and public microbenchmarks.
Writes ``benchmarks/results/validate.json``.

    python benchmarks/validate.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax
from hyperjax.config import Config, build
from hyperjax.cost import count_params, estimate_inference
from hyperjax.files import read_yaml
from hyperjax.offload import offload_pass, with_offload

HERE = Path(__file__).parent


def korthikanti_eq7(cfg: Config) -> float:
    """Model FLOPs per iteration, Korthikanti et al. eq. 7: 72 B L s h^2 (1 + s/(6h) + v/(12 h L))."""
    m, b = cfg.model, cfg.train.global_batch
    return (
        72
        * b
        * m.layers
        * m.seq_len
        * m.d_model**2
        * (1 + m.seq_len / (6 * m.d_model) + m.vocab / (12 * m.d_model * m.layers))
    )


def torchtitan_flops(cfg: Config) -> float:
    """Model FLOPs per step by torchtitan's count: ``6 N + 12 L h hd s`` per token, ``N`` without the embedding."""
    m = cfg.model
    embedding = m.vocab * m.d_model
    per_token = 6 * (count_params(m) - embedding) + 12 * m.layers * m.heads * m.head_dim * m.seq_len
    return per_token * cfg.train.global_batch * m.seq_len


def kind_of(cfg: Config, path: Path) -> str:
    """Which table a run belongs to: the folder it lies in, else dense or MoE."""
    if path.parent.name in ("fp8", "torchtitan", "tpu", "tpu-v6e", "bridge"):
        return path.parent.name
    return "moe" if cfg.model.moe is not None else "dense"


def row(path: Path) -> dict:
    """One published run, predicted."""
    doc = read_yaml(path, what="validation row", error=ValueError)
    cfg = build(Config, doc["config"], "")
    run = hyperjax.resolve(cfg)
    est = hyperjax.estimate(run) if run.offload == "none" else with_offload(offload_pass(run))  # as predict prices it
    measured = doc["measured"]["step_time_s"]
    if doc["flops_formula"] == "korthikanti_eq7":
        measured_tflops = korthikanti_eq7(cfg) / (measured * est.devices) / 1e12
    elif doc["flops_formula"] == "torchtitan":
        measured_tflops = torchtitan_flops(cfg) / (measured * est.devices) / 1e12
    else:  # the source's own figure; the prediction does the same work in its predicted time
        measured_tflops = doc["measured"]["tflops_per_device"]
    return {
        "id": doc["id"],
        "kind": kind_of(cfg, path),
        "devices": est.devices,
        "measured_s": measured,
        "predicted_s": est.step_time_s,
        "error": est.step_time_s / measured - 1,
        "measured_tflops_per_device": measured_tflops,
        "predicted_tflops_per_device": measured_tflops * measured / est.step_time_s,
        "breakdown_s": est.breakdown_s,
        "communication_s": est.communication_s,
        "fits": est.fits,
        "fp8": est.fp8,
        "measured_memory_gib": doc["measured"].get("memory_gib"),
        "predicted_memory_gib": est.memory_per_device_gib["peak"],
        "memory_error": (
            est.memory_per_device_gib["peak"] / doc["measured"]["memory_gib"] - 1
            if "memory_gib" in doc["measured"]
            else None
        ),
    }


def serving_row(path: Path) -> dict:
    """One published inference run, predicted: decode time per token and prefill (either may be unpublished)."""
    doc = read_yaml(path, what="validation row", error=ValueError)
    cfg = build(Config, doc["config"], "")
    est = estimate_inference(hyperjax.resolve(cfg))
    measured = doc["measured"]
    out = {"id": doc["id"], "kind": "moe" if cfg.model.moe is not None else "dense", "devices": est.run.devices}
    for key, predicted in (("decode_s_per_token", est.decode_s_per_token), ("prefill_s", est.prefill_s)):
        seen = measured.get(key)
        out[key] = {"measured": seen, "predicted": predicted, "error": None if seen is None else predicted / seen - 1}
    out["decode_breakdown_s"] = est.decode_breakdown_s
    return out


def print_serving(rows: list[dict], console: Console) -> dict:
    """The serving table and each figure's mean absolute percentage error."""
    table = Table(title="serving: cost model vs published measured inference (A100 / H100, batch, prompt as listed)")
    for col in ("run", "devices", "decode ms meas.", "pred.", "error", "prefill ms meas.", "pred.", "error"):
        table.add_column(col, justify="left" if col == "run" else "right")
    cell = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
    err = lambda v: "-" if v is None else f"{v:+.0%}"
    for r in rows:
        d, p = r["decode_s_per_token"], r["prefill_s"]
        table.add_row(
            r["id"], str(r["devices"]), cell(d["measured"]), cell(d["predicted"]), err(d["error"]),
            cell(p["measured"]), cell(p["predicted"]), err(p["error"]),
        )  # fmt: skip
    console.print(table)
    summary = {}
    for key in ("decode_s_per_token", "prefill_s"):
        errs = [abs(r[key]["error"]) for r in rows if r[key]["error"] is not None]
        summary[key] = {"mape": sum(errs) / len(errs), "worst": max(errs), "rows": len(errs)}
        console.print(
            f"serving {key}: mean absolute percentage error {summary[key]['mape']:.1%} over {len(errs)} rows; "
            f"worst {summary[key]['worst']:.1%}"
        )
    return summary


def errors(rows: list[dict]) -> tuple[float, float]:
    """Mean absolute percentage error and the worst row's."""
    return sum(abs(r["error"]) for r in rows) / len(rows), max(abs(r["error"]) for r in rows)


TABLES = (
    ("dense", "dense: cost model vs published measured runs (Korthikanti et al., A100 80GB, Selene)"),
    ("moe", "mixture of experts: cost model vs published measured runs (Megatron-Core, DGX H100)"),
    ("fp8", "FP8 (delayed scaling): cost model vs NeMo 24.07's published runs (DGX H100)"),
    ("torchtitan", "torchtitan Llama 3.1 8B, BF16 and Float8 (tensorwise), 500 W 96 GB H100: time and memory"),
    ("tpu", "MaxText's 2023 decoders, 16B-128B on 1-32 TPU v5e pods (2-D torus ICI, DCN between pods)"),
    ("tpu-v6e", "MaxText's recipes on TPU v6e (Trillium), 8-512 chips: Llama 2/3.1, Mistral, GPT-3 (added rows)"),
    ("bridge", "Megatron Bridge's Qwen3-30B-A3B, 16 H100, HybridEP: expert-parallel overlap off and on (added rows)"),
)


def print_training(rows: list[dict], console: Console) -> dict:
    """One table per kind of training run, and each kind's mean absolute percentage errors."""
    summary = {}
    for kind, title in TABLES:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        table = Table(title=title)
        cols = ["run", "devices", "measured s", "predicted s", "error", "TFLOP/s/dev meas.", "pred.", "fits"]
        memory = any(r["measured_memory_gib"] is not None for r in mine)
        cols += ["GiB meas.", "pred.", "error"] if memory else ["peak GiB pred."]
        for col in cols:
            table.add_column(col, justify="left" if col == "run" else "right")
        for r in mine:
            cells = [
                r["id"],
                str(r["devices"]),
                f"{r['measured_s']:.2f}",
                f"{r['predicted_s']:.2f}",
                f"{r['error']:+.1%}",
                f"{r['measured_tflops_per_device']:.1f}",
                f"{r['predicted_tflops_per_device']:.1f}",
                "yes" if r["fits"] else "NO",
            ]
            if memory:
                m = r["measured_memory_gib"]
                cells += [f"{m:.1f}", f"{r['predicted_memory_gib']:.1f}", f"{r['memory_error']:+.1%}"]
            else:
                cells.append(f"{r['predicted_memory_gib']:.1f}")
            table.add_row(*cells)
        console.print(table)
        mape, worst = errors(mine)
        summary[kind] = {"mape": mape, "worst": worst, "rows": len(mine)}
        line = f"{kind}: time, mean absolute percentage error {mape:.1%}; worst row {worst:.1%}"
        mem = [abs(r["memory_error"]) for r in mine if r["memory_error"] is not None]
        if mem:
            summary[kind]["memory_mape"] = sum(mem) / len(mem)
            line += f"; memory {sum(mem) / len(mem):.1%} (worst {max(mem):.1%})"
        console.print(line)
    return summary


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    found = [*sorted((HERE / "validation").glob("*.yaml"))]
    found += [
        *sorted((HERE / "validation" / "fp8").glob("*.yaml")),
        *sorted((HERE / "validation" / "torchtitan").glob("*.yaml")),
        *sorted((HERE / "validation" / "tpu").glob("*.yaml")),
        *sorted((HERE / "validation" / "tpu-v6e").glob("*.yaml")),
        *sorted((HERE / "validation" / "bridge").glob("*.yaml")),
    ]
    rows = [row(path) for path in found]
    console = Console(width=170)
    summary = print_training(rows, console)
    serving = [serving_row(path) for path in sorted((HERE / "validation" / "inference").glob("*.yaml"))]
    serving_summary = print_serving(serving, console)
    out = HERE / "results" / "validate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    dense = summary["dense"]
    out.write_text(
        json.dumps(
            {**dense, "by_kind": summary, "runs": rows, "serving": {"summary": serving_summary, "runs": serving}},
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0 if dense["mape"] <= 0.10 and dense["worst"] <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main())
