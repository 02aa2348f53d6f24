"""The cost model against published, measured training runs.

Each file in ``benchmarks/validation/`` describes one published run (source, measured step time and MFU)
and holds hyperjax's config for it. This script resolves every run (``hyperjax.resolve``), predicts it
(``hyperjax.estimate``) on the run's hardware preset, and prints predicted vs measured step time and model
TFLOP/s per device (computed with the source's own FLOP formula), and the mean absolute percentage error.
Nothing here is fitted to these rows: the preset constants come from datasheets and public microbenchmarks.
Writes ``benchmarks/results/validate.json``.

    python benchmarks/validate.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

import hyperjax
from hyperjax.config import Config, build

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


def main() -> int:
    rows = []
    for path in sorted((HERE / "validation").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        cfg = build(Config, doc["config"], "")
        est = hyperjax.estimate(hyperjax.resolve(cfg))
        measured = doc["measured"]["step_time_s"]
        flops = korthikanti_eq7(cfg)
        rows.append(
            {
                "id": doc["id"],
                "devices": est.devices,
                "measured_s": measured,
                "predicted_s": est.step_time_s,
                "error": est.step_time_s / measured - 1,
                "measured_tflops_per_device": flops / (measured * est.devices) / 1e12,
                "predicted_tflops_per_device": flops / (est.step_time_s * est.devices) / 1e12,
                "breakdown_s": est.breakdown_s,
                "fits": est.fits,
            }
        )
    mape = sum(abs(r["error"]) for r in rows) / len(rows)
    worst = max(abs(r["error"]) for r in rows)
    table = Table(title="cost model vs published measured runs (A100 80GB, Selene)")
    for col in ("run", "devices", "measured s", "predicted s", "error", "TFLOP/s/dev meas.", "pred.", "fits"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        table.add_row(
            r["id"],
            str(r["devices"]),
            f"{r['measured_s']:.2f}",
            f"{r['predicted_s']:.2f}",
            f"{r['error']:+.1%}",
            f"{r['measured_tflops_per_device']:.1f}",
            f"{r['predicted_tflops_per_device']:.1f}",
            "yes" if r["fits"] else "NO",
        )
    console = Console(width=140)
    console.print(table)
    console.print(f"mean absolute percentage error {mape:.1%}; worst row {worst:.1%}")
    out = HERE / "results" / "validate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mape": mape, "worst": worst, "runs": rows}, indent=2))
    print(f"wrote {out}")
    return 0 if mape <= 0.10 and worst <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main())
