"""``hyperjax selftest``: bring up the emulated mesh and check every collective over every axis.

Validates the request first (preset, devices, axes, processes); then runs in this process (up to 256
devices), spawns and supervises the processes of a larger emulated machine, or, given ``--coordinator``,
joins a job as one of its processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from rich.table import Table

from hyperjax.cli.display import check_writable, console, fmt_axes, fmt_bytes
from hyperjax.cli.launching import add_join_arguments, check_joined_processes, run_on_devices
from hyperjax.cli.options import add_command, path
from hyperjax.emulate import plan_processes
from hyperjax.errors import EmulationError
from hyperjax.files import write_json
from hyperjax.topology import axis_spans, check_axes, default_axes, load_hardware, make_mesh, parse_axes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "selftest",
        usage="--hardware PRESET [options]",
        summary="run and check collectives on the emulated mesh",
        description=(
            "Bring up the emulated mesh and check all-reduce, all-gather, reduce-scatter, all-to-all and a ring "
            "permute over every mesh axis against numpy. Past 256 devices the mesh runs as several processes."
        ),
        examples=[
            "hyperjax selftest --hardware cloudmatrix384     # 384 devices, about 25 s",
            "hyperjax selftest --hardware dgx-h100 --devices 16 --axes data=2,tensor=8",
        ],
    )
    p.add_argument("--hardware", required=True, metavar="PRESET", help="a preset name or YAML path")
    p.add_argument("--devices", type=int, metavar="N", help="emulated devices (default: the preset's)")
    p.add_argument("--axes", help="mesh axes, outermost first, e.g. data=12,tensor=32")
    p.add_argument("--processes", type=int, metavar="P", help="processes to emulate them in (default: fewest)")
    p.add_argument(
        "--bytes",
        type=int,
        default=4096,
        metavar="B",
        help="payload per device and collective, rounded up to whole float32 values per rank (4096)",
    )
    p.add_argument("--iters", type=int, default=3, metavar="K", help="timed calls per collective (3)")
    p.add_argument("--json", metavar="FILE", type=path, help="also write the results as JSON to FILE")
    add_join_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_joined_processes(args, args.processes, "--processes")
    hw = load_hardware(args.hardware)
    devices = hw.devices if args.devices is None else args.devices
    if devices < 1:
        raise EmulationError(f"--devices {devices} must be a positive integer")
    axes = parse_axes(args.axes) if args.axes else default_axes(hw, devices)
    check_axes(axes, devices)
    spans = axis_spans(hw, axes)
    if args.bytes < 4 or args.iters < 1:
        raise EmulationError(f"--bytes {args.bytes} must be >= 4 and --iters {args.iters} >= 1")
    if args.json:
        check_writable(args.json, "--json")
    child = [
        "selftest",
        "--hardware",
        args.hardware,
        "--devices",
        str(devices),
        "--axes",
        fmt_axes(axes),
        "--bytes",
        str(args.bytes),
        "--iters",
        str(args.iters),
        *(["--json", args.json] if args.json else []),
    ]
    return run_on_devices(
        args,
        devices=devices,
        processes=plan_processes(devices, args.processes),
        child_args=child,
        work=lambda: _run_checks(hw, axes, spans, args),
    )


def _run_checks(hw, axes, spans, args) -> int:
    import jax

    from hyperjax.emulate.selftest import run_selftest

    mesh = make_mesh(hw, axes, devices=jax.devices()[: math.prod(axes.values())])
    lead = jax.process_index() == 0
    out = console()
    if lead:
        out.print(
            f"selftest on {hw.name}: {mesh.devices.size} emulated devices in {jax.process_count()} process(es), "
            f"mesh {fmt_axes(axes)}"
        )
    checks = run_selftest(mesh, spans, bytes_per_device=args.bytes, iters=args.iters)
    failed = [c for c in checks if not c.ok]
    if lead:
        table = Table(title=f"collectives on {hw.name} ({mesh.devices.size} devices)")
        for col in (
            "collective",
            "axis",
            "group",
            "tiers spanned",
            "bytes/device",
            "emulated ms",
            "max error",
            "check",
        ):
            table.add_column(
                col, justify="right" if col in ("group", "bytes/device", "emulated ms", "max error") else "left"
            )
        for c in checks:
            table.add_row(
                c.collective,
                c.axis,
                str(c.group_size),
                c.tiers,
                fmt_bytes(c.bytes_per_device),
                f"{c.time_s * 1e3:.2f}",
                f"{c.max_error:.1e}",
                "ok" if c.ok else "[red]FAIL[/red]",
            )
        out.print(table)
        if args.json:
            write_json(
                args.json,
                {
                    "hardware": hw.name,
                    "devices": int(mesh.devices.size),
                    "processes": jax.process_count(),
                    "axes": axes,
                    "passed": not failed,
                    "checks": [dataclasses.asdict(c) for c in checks],
                },
            )
        verdict = "passed" if not failed else "FAILED"
        out.print(f"selftest {verdict}: {len(checks) - len(failed)}/{len(checks)} collectives matched numpy")
    return 0 if not failed else 1
