"""``hyperjax selftest``: bring up the emulated mesh and check every collective over every axis.

Validates the request first (preset, devices, axes, processes); then runs in this process (up to 256
devices), spawns and supervises the processes of a larger emulated machine, or, given ``--coordinator``,
joins a job as one of its processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rich.table import Table

from hyperjax.cli.display import check_writable, console, fmt_axes, fmt_bytes, write_json
from hyperjax.emulate import Cluster, free_port, launch, plan_processes, start_devices
from hyperjax.errors import EmulationError
from hyperjax.topology import axis_spans, check_axes, default_axes, load_hardware, make_mesh, parse_axes


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="run and check collectives on the emulated mesh", description=__doc__)
    p.add_argument("--hardware", required=True, help="hardware preset name or YAML path")
    p.add_argument("--devices", type=int, help="emulated devices (default: the preset's device count)")
    p.add_argument("--axes", help="mesh axes, outermost first, e.g. data=12,tensor=32 (default: the preset's)")
    p.add_argument("--processes", type=int, help="processes to emulate the devices in (default: fewest needed)")
    p.add_argument("--bytes", type=int, default=4096, help="float32 payload per device per collective (default 4096)")
    p.add_argument("--iters", type=int, default=3, help="timed calls per collective (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    join = p.add_argument_group("joining a running job instead of spawning one")
    join.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator")
    join.add_argument("--num-processes", type=int, help="processes in the job")
    join.add_argument("--process-id", type=int, help="this process's index")
    join.add_argument(
        "--platform",
        choices=("cpu", "auto"),
        default="cpu",
        help="cpu: emulate devices/num-processes CPU devices here; auto: use this host's accelerators",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
    join = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in join):
        if any(v is None for v in join):
            raise EmulationError("--coordinator, --num-processes and --process-id must be given together")
        cluster = Cluster(coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
        plan_processes(devices, cluster.num_processes)
        start_devices(devices // cluster.num_processes, cluster, platform=args.platform)
        return _run_checks(hw, axes, spans, args)
    processes = plan_processes(devices, args.processes)
    if processes == 1:
        start_devices(devices)
        return _run_checks(hw, axes, spans, args)
    port = free_port()
    common = [
        sys.executable,
        "-m",
        "hyperjax",
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
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(processes),
    ]
    print(
        f"[launcher] {devices} devices in {processes} processes x {devices // processes}, coordinator 127.0.0.1:{port}"
    )
    return launch([[*common, "--process-id", str(i)] for i in range(processes)])


def _run_checks(hw, axes, spans, args) -> int:
    import jax

    from hyperjax.emulate.selftest import run_selftest

    mesh = make_mesh(hw, axes)
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
