"""``hyperjax topology PRESET``: print a machine's devices, tiers, host memory and default mesh."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from hyperjax.cli.display import console, fmt_axes
from hyperjax.cli.options import add_command
from hyperjax.topology import axis_spans, list_presets, load_hardware


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "topology",
        usage="[PRESET] [--json]",
        summary="print a hardware preset",
        description=(
            "Print a machine's devices, interconnect tiers, host memory and default mesh, or list the shipped presets."
        ),
        examples=[
            "hyperjax topology",
            "hyperjax topology cloudmatrix384",
            "hyperjax topology dgx-h100 --json",
        ],
    )
    p.add_argument("preset", nargs="?", help="preset name or YAML path; omit to list the shipped presets")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the parsed preset (or the shipped presets' names and descriptions) as JSON",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = console()
    if args.preset is None:
        shipped = {name: load_hardware(name).description for name in list_presets()}
        if args.json:
            print(json.dumps([{"name": n, "description": d} for n, d in shipped.items()], indent=2))
            return 0
        for name, description in shipped.items():
            out.print(f"{name:20s} {description}")
        return 0
    hw = load_hardware(args.preset)
    if args.json:
        print(json.dumps(hw.to_dict(), indent=2))
        return 0
    d = hw.device
    out.print(f"[bold]{hw.name}[/bold]: {hw.description}")
    out.print(
        f"devices: {hw.devices} x {d.name}; HBM {d.hbm_bytes / 1e9:.0f} GB at {d.hbm_bandwidth / 1e12:.2f} TB/s; "
        "peak " + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in d.peak_flops.items())
    )
    for dtype, runs_as in d.matmul_precision.items():
        out.print(f"{dtype} matrix products run as {runs_as} at XLA's default precision")
    tiers = Table(title="interconnect tiers (innermost first; bandwidth per device, one direction)")
    for col in ("tier", "group size", "GB/s", "efficiency", "effective GB/s", "latency us", "topology"):
        tiers.add_column(col, justify="left" if col in ("tier", "topology") else "right")
    for t in hw.tiers:
        tiers.add_row(
            t.name,
            "unbounded" if t.group_size is None else str(t.group_size),
            f"{t.bandwidth / 1e9:.1f}",
            f"{t.efficiency:.2f}",
            f"{t.effective_bandwidth / 1e9:.1f}",
            f"{t.latency * 1e6:.1f}",
            t.topology,
        )
    out.print(tiers)
    h = hw.host
    out.print(
        f"host memory: {h.bytes_per_device / 1e9:.0f} GB per device, {h.bandwidth / 1e9:.0f} GB/s to/from device, "
        f"{h.latency * 1e6:.1f} us"
    )
    axes = dict(hw.default_axes)
    out.print(f"default mesh axes: {fmt_axes(axes)}")
    for span in axis_spans(hw, axes).values():
        levels = " x ".join(f"{r} on {t}" for t, r in span.levels) or "single device"
        out.print(f"  {span.axis}={span.size}: slowest tier {span.tier} ({levels})")
    return 0
