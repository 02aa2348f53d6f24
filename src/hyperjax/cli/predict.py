"""``hyperjax predict CONFIG``: what one training step of the config costs on the real machine.

Any size works: ``emulate`` is ignored and the device count is the product of the parallel degrees.
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from hyperjax.cli.display import console, fmt_count
from hyperjax.cli.options import add_config_arguments, config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predict step time, memory and communication", description=__doc__)
    add_config_arguments(p, config_help="YAML config", hardware=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE.json", help="write a Perfetto / Chrome trace of the predicted step")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hyperjax.cli.display import check_writable
    from hyperjax.cost import estimate
    from hyperjax.cost.trace import write_trace
    from hyperjax.topology import load_hardware

    if args.trace:
        check_writable(args.trace, "--trace")
    cfg = config_from_args(args)
    hw = load_hardware(cfg.hardware)
    est = estimate(cfg, hw)
    offload = None
    if cfg.offload.policy != "none":
        from hyperjax.offload.plan import plan_offload, with_offload

        offload = plan_offload(cfg, hw)
        est = with_offload(offload)
    if args.trace:
        write_trace(est, args.trace, title=f"{cfg.model.family} on {hw.name}")
    if args.json:
        print(json.dumps(est.to_dict() | ({"offload": offload.to_dict()} if offload else {}), indent=2))
        return 0
    print_estimate(est, hw.name)
    if offload is not None:
        print_offload(offload)
    return 0


def print_offload(plan) -> None:
    """The placement table of an :class:`hyperjax.offload.plan.OffloadPlan` and its price."""
    from hyperjax.offload.placement import ACTIVATIONS, KINDS

    out = console()
    p = plan.priced
    table = Table(title=f"offload placement ({plan.policy}), per layer")
    for col in ("layers", *KINDS, *(f"act.{a}" for a in ACTIVATIONS)):
        table.add_column(col)
    for row in p.placement.rows(plan.problem.layers):
        table.add_row(*row)
    out.print(table)
    verdict = "fits" if plan.fits else f"[red]does not fit[/red]: {plan.cannot_fit} cannot leave the device"
    out.print(
        f"  peak {p.peak_bytes / 2**30:.3g} GiB per device of a {plan.budget_gib:.3g} GiB budget ({verdict}); "
        f"{p.host_bytes / 2**30:.3g} GiB on the host; host transfers {p.transfer_s * 1e3:.3g} ms a step, "
        f"{p.exposed_transfer_s * 1e3:.3g} ms of it exposed; recomputation {p.recompute_s * 1e3:.3g} ms"
    )
    if not plan.fits:
        out.print(f"  the smallest budget any placement fits: {plan.smallest_budget_gib:g} GiB")


def print_estimate(est, hardware: str) -> None:
    """The readable form of an estimate."""
    out = console()
    axes = ",".join(f"{k}={v}" for k, v in est.details["axes"].items() if v > 1) or "single device"
    out.print(
        f"[bold]predicted on {hardware}[/bold]: {est.devices} devices, {axes}; "
        f"{fmt_count(est.details['params'])} parameters, {est.details['microbatches']} micro-batches of "
        f"{est.details['micro_batch']}"
    )
    out.print(
        f"  step time {est.step_time_s:.4g} s; MFU {est.mfu:.1%}; "
        f"{est.model_flops_per_step / est.step_time_s / est.devices / 1e12:.1f} model TFLOP/s per device"
    )
    table = Table(title="where the step goes")
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for k, v in est.breakdown_s.items():
        table.add_row(k, f"{v:.4g}", f"{v / est.step_time_s:.1%}")
    out.print(table)
    mem = Table(title="memory per device (GiB)")
    for k in est.memory_per_device_gib:
        mem.add_column(k, justify="right")
    mem.add_row(*(f"{v:.2f}" for v in est.memory_per_device_gib.values()))
    out.print(mem)
    verdict = "fits" if est.fits else f"[red]does not fit[/red] ({est.overflow} is the largest term)"
    out.print(f"  {verdict} in device memory")
    comm = ", ".join(f"{k} {v:.3g} s" for k, v in est.communication_s.items() if v > 0) or "none"
    out.print(f"  communication per step (before overlap): {comm}")
