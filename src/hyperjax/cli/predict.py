"""``hyperjax predict CONFIG``: what one training step of the config costs on the real machine.

The config is resolved exactly as ``hyperjax train`` resolves it (:func:`hyperjax.resolve`), so the run
priced is the run ``train`` would start; ``--json`` prints it as ``"run"``. Any size works: a run too
large to emulate here is still priced.
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from hyperjax.cli.display import check_writable, console, fmt_count, print_unpriced
from hyperjax.cli.options import (
    add_command,
    add_config_arguments,
    config_from_args,
    path,
    refuse_serve_sets,
    refuse_sets,
    without_training,
)
from hyperjax.config import Config
from hyperjax.cost import Estimate, check_traceable, estimate, memory_budget, unpriced_overrides, write_trace
from hyperjax.cost.inference import TRAINING_ONLY, InferenceEstimate, estimate_inference
from hyperjax.cost.rl import RLEstimate, estimate_rl
from hyperjax.errors import ConfigError
from hyperjax.offload import (
    OffloadResult,
    ServingPlacement,
    offload_pass,
    serving_pass,
    with_offload,
    with_serving,
)
from hyperjax.offload.placement import KINDS, PLACED_ACTIVATIONS
from hyperjax.resolver import resolve, resolve_rl
from hyperjax.rl.rewards import check_reward


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "predict",
        usage="CONFIG [--set KEY=VALUE ...] [options]",
        summary="predict step time, memory and communication",
        description=(
            "Price one training step (or, with --inference, serving) of the run train would start, resolved the "
            "same way, on the preset's real machine. Any size works: a run too large to emulate here is still "
            "priced."
        ),
        examples=[
            "hyperjax predict configs/deepseek-v3-671b.yaml",
            "hyperjax predict configs/quickstart.yaml --json --trace step.json",
            "hyperjax predict configs/llama3-70b.yaml --inference --set serve.batch=16",
        ],
    )
    add_config_arguments(p, config_help="YAML config", hardware=True)
    p.add_argument("--devices", type=int, metavar="N", help="devices of the run (as train --devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--trace", type=path, metavar="FILE.json", help="write a Perfetto / Chrome trace of the predicted step"
    )
    p.add_argument(
        "--inference",
        action="store_true",
        help="price serving instead of a training step: prefill and decode of serve.batch sequences of "
        "serve.prompt_len prompt tokens and serve.new_tokens new ones",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, serving=True)
    if cfg.rl is not None or not args.inference:  # serve: is read by --inference of a config without rl:
        refuse_serve_sets(args.sets, "predict", "" if cfg.rl is not None else ", or add --inference")
    if cfg.rl is not None:
        return _rl(args, cfg)
    if args.inference:
        refuse_sets(
            args.sets,
            TRAINING_ONLY,
            "predict --inference prices serving, which does not read this training setting, so it would have "
            "no effect: drop it, or price a training step without --inference",
        )
        return _inference(args, cfg)
    if args.trace:
        check_writable(args.trace, "--trace")
    run = resolve(cfg, args.devices)
    if args.trace:
        check_traceable(run)
    est = estimate(run)
    offload = None
    if run.offload != "none":
        offload = offload_pass(run)
        est = with_offload(offload)
    if args.trace:
        write_trace(est, args.trace, title=f"{run.config.model.family} on {run.hardware.name}")
    if args.json:
        offloaded = {"offload": offload.to_dict()} if offload else {}
        print(json.dumps(est.to_dict() | offloaded | {"unpriced": list(unpriced_overrides(run))}, indent=2))
        return 0
    print_estimate(est)
    if offload is not None:
        print_offload(offload)
    return 0


def _rl(args: argparse.Namespace, cfg: Config) -> int:
    """An ``rl:`` config: one iteration's rollout, learning, hand-over and idle time."""
    if args.inference or args.trace:
        raise ConfigError(
            f"{'--inference' if args.inference else '--trace'} prices one phase; an rl: config is priced per "
            "iteration (its rollout is the serving estimate inside it); drop the flag"
        )
    rl = resolve_rl(cfg, args.devices)
    check_reward(cfg.rl.reward)
    est = estimate_rl(rl)
    unpriced = unpriced_overrides(rl.rollout, rl.learner)
    if args.json:
        print(json.dumps(est.to_dict() | {"unpriced": list(unpriced)}, indent=2))
        return 0
    print_rl(est)
    print_unpriced(unpriced)
    return 0


def print_rl(est: RLEstimate) -> None:
    """The readable form of a reinforcement-learning iteration's estimate."""
    rl, out = est.rl, console()
    r = rl.rl
    out.print(
        f"[bold]reinforcement learning predicted on {rl.hardware.name}[/bold]: {rl.devices} devices; "
        f"{rl.describe()}; {r.prompts_per_step} prompts x {r.group_size} completions, {rl.prompt_len} prompt and "
        f"{r.max_new_tokens} new tokens, {r.updates} update(s) per iteration",
        soft_wrap=True,
    )
    table = Table(title="one iteration (predicted)")
    for col in ("part", "seconds", "share"):
        table.add_column(col, justify="left" if col == "part" else "right")
    rows = [
        (f"rollout: prefill ({rl.waves} wave(s) of {rl.wave})", rl.waves * est.rollout.prefill_s),
        (f"rollout: decode ({r.max_new_tokens} tokens)", est.rollout_s - rl.waves * est.rollout.prefill_s),
        ("learning: scoring (policy and reference)", est.score_s),
        (f"learning: {r.updates} update(s)", est.learn_s - est.score_s),
        ("hand-over of the weights", est.handover_s),
    ]
    if est.offload_s:
        rows.append(("optimizer state to the host and back", est.offload_s))
    for name, seconds in rows:
        table.add_row(name, f"{seconds:.4g}", f"{seconds / est.iteration_s:.1%}")
    out.print(table)
    mem = est.memory_gib
    out.print(
        f"  iteration {est.iteration_s:.4g} s; {est.tokens_per_s:,.0f} generated tokens/s; devices idle "
        f"{est.idle_fraction:.1%} of the time; memory per device: learner {mem['learner']:.3g} GiB, rollout "
        f"{mem['rollout']:.3g} GiB" + ("" if est.fits else " — [red]does not fit[/red]"),
        soft_wrap=True,
    )


def _inference(args: argparse.Namespace, cfg: Config) -> int:
    if args.trace:
        raise ConfigError("--trace draws a training step; it does nothing with --inference")
    run = resolve(without_training(cfg, offload=False), args.devices)
    est = estimate_inference(run)
    placed = serving_pass(est, budget_bytes=memory_budget(run)) if run.offload != "none" else None
    if placed is not None:  # the run's step, memory and fit are the placement's
        est = with_serving(est, placed)
    if args.json:
        offloaded = {"offload": placed.to_dict()} if placed else {}
        print(json.dumps(est.to_dict() | offloaded | {"unpriced": list(unpriced_overrides(run))}, indent=2))
        return 0
    print_inference(est, placed=placed is not None)
    if placed is not None:
        print_serving_placement(placed)
    return 0


def print_serving_placement(p: ServingPlacement) -> None:
    """The serving offload pass's placement and its price."""
    out = console()
    out.print(
        f"  offload ({p.policy} pass, {p.context:,} tokens cached per sequence, budget {p.budget_gib:.3g} GiB): "
        f"weights of {p.weights_on_host} layers and {p.kv_blocks_on_host} of {p.kv_blocks} KV-cache blocks on the "
        f"host ({p.host_gib:.3g} GiB); peak {p.peak_gib:.3g} GiB; decode {p.decode_s_per_token * 1e3:.4g} ms per "
        f"token against {p.device_only_s_per_token * 1e3:.4g} ms all on the device; "
        + ("fits" if p.fits else "[red]does not fit[/red]: no placement reaches a smaller peak"),
        soft_wrap=True,
    )
    if p.time_limited:
        out.print(f"  the exact pass stopped at its time limit: {proof(p.proved_gap)}", soft_wrap=True)


def print_inference(est: InferenceEstimate, *, placed: bool = False) -> None:
    """The readable form of a serving estimate (``placed``: under the serving offload pass's placement)."""
    out = console()
    run = est.run
    image = f" after {est.image_tokens} image tokens" if est.image_tokens else ""
    out.print(
        f"[bold]serving predicted on {run.hardware.name}[/bold]: {run.devices} devices; {est.batch} sequences of "
        f"{est.prompt_len} prompt tokens{image}, {est.new_tokens} new tokens each",
        soft_wrap=True,
    )
    out.print(f"  strategy: {run.describe(serving=True)}", soft_wrap=True)
    out.print(
        f"  prefill {est.prefill_s * 1e3:.4g} ms; decode {est.decode_s_per_token * 1e3:.4g} ms per token "
        f"({est.batch / est.decode_s_per_token:,.0f} tokens/s, {est.tokens_per_s_per_device:,.1f} per device)"
    )
    out.print(share_table("one decode step", "ms", est.decode_breakdown_s, est.decode_s_per_token, scale=1e3))
    out.print(memory_table(est.memory_per_device_gib, "{:.3g}"))
    budget = "offload.device_memory_gib" if run.config.offload.device_memory_gib is not None else "device memory"
    where = "with the placement below" if placed else "with everything on the device"
    out.print(f"  {'fits' if est.fits else '[red]does not fit[/red]'} in {budget} {where}")
    print_unpriced(unpriced_overrides(run))


def share_table(title: str, unit: str, terms: dict[str, float], total: float, *, scale: float = 1.0) -> Table:
    """Each term in seconds (times ``scale``, in ``unit``) and its share of ``total``."""
    table = Table(title=title)
    table.add_column("term")
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    for k, v in terms.items():
        table.add_row(k, f"{v * scale:.4g}", f"{v / total:.1%}")
    return table


def memory_table(gib: dict[str, float], fmt: str) -> Table:
    """One row of memory terms per device, in GiB."""
    mem = Table(title="memory per device (GiB)")
    for k in gib:
        mem.add_column(k, justify="right")
    mem.add_row(*(fmt.format(v) for v in gib.values()))
    return mem


def print_offload(plan: OffloadResult) -> None:
    """The placement table of an offload pass's result and its price."""
    out = console()
    p = plan.priced
    table = Table(title=f"offload placement ({plan.policy}), per layer; activations (act.NAME) by name")
    for col in ("layers", *KINDS, *PLACED_ACTIVATIONS):
        table.add_column(col)
    for row in p.placement.rows(plan.problem.layers):
        table.add_row(*row)
    out.print(table)
    if plan.fits:
        verdict = "fits"
    elif plan.placeable:
        verdict = f"[red]does not fit[/red]: {plan.cannot_fit} is over it"
    else:
        verdict = f"[red]does not fit[/red]: {plan.cannot_fit} cannot leave the device"
    budget = f"{plan.budget_gib:.3g} GiB budget ({verdict})"
    out.print(f"  peak {p.peak_bytes / 2**30:.3g} GiB per device of a {budget}; {p.price()}")
    if p.time_limited:
        out.print(f"  the exact pass stopped at its time limit: {proof(p.proved_gap)}", soft_wrap=True)
    for i, q in plan.others:  # every other stage over the budget places its own blocks
        verdict = "fits" if q.fits else "does not fit"
        out.print(
            f"  stage {i} places its own blocks: peak {q.peak_bytes / 2**30:.3g} GiB ({verdict}); {q.price()}; "
            f"step {q.step_time_s:.4g} s",
            soft_wrap=True,
        )
    if plan.others:
        out.print(f"  the step is the slowest stage's: {plan.pace.step_time_s:.4g} s")
    if plan.placeable:
        out.print(
            f"  a placement fits with a peak of {plan.smallest_budget_gib:g} GiB: put more on the host in "
            "offload.manual, or set offload.policy: auto"
        )
    elif not plan.fits:
        out.print(f"  the smallest budget any placement fits: {plan.smallest_budget_gib:g} GiB")


def proof(gap: float | None) -> str:
    """What the exact pass proved of a placement it stopped on."""
    if gap is None:
        return (
            "it had found none of its own, so this placement is the greedy pass's (else the leanest), not proved "
            "the fastest"
        )
    return f"this placement's step is proved within {gap:.3g} (relative) of the fastest"


def print_estimate(est: Estimate) -> None:
    """The readable form of an estimate."""
    out = console()
    run = est.run
    out.print(
        f"[bold]predicted on {run.hardware.name}[/bold]: {run.devices} devices; {fmt_count(est.params)} parameters; "
        f"{run.microbatches} micro-batches of {run.micro_batch} per replica"
    )
    out.print(f"  strategy: {run.describe()}", soft_wrap=True)
    out.print(
        f"  step time {est.step_time_s:.4g} s; MFU {est.mfu:.1%}; "
        f"{est.model_flops_per_step / est.step_time_s / est.devices / 1e12:.1f} model TFLOP/s per device"
    )
    out.print(share_table("where the step goes", "seconds", est.breakdown_s, est.step_time_s))
    out.print(memory_table(est.memory_per_device_gib, "{:.2f}"))
    verdict = "fits" if est.fits else f"[red]does not fit[/red] ({est.overflow} is the largest term)"
    budget = "offload.device_memory_gib" if run.config.offload.device_memory_gib is not None else "device memory"
    peak = est.memory_per_device_gib["peak"]
    out.print(f"  {verdict} in {budget}: peak {peak:.3g} GiB of {memory_budget(run) / 2**30:.3g} GiB")
    comm = ", ".join(f"{k} {v:.3g} s" for k, v in est.communication_s.items() if v > 0) or "none"
    out.print(f"  communication per step (before overlap): {comm}")
    if est.all_to_all is not None and est.all_to_all["total_s"] > 0:
        a = est.all_to_all
        out.print(
            f"  MoE all-to-all ({run.overlap} overlap): {a['total_s']:.3g} s per step, {a['exposed_s']:.3g} s "
            f"exposed, {a['hidden_fraction']:.0%} hidden behind compute"
        )
    if est.fp8 is not None:
        f, step = est.fp8, est.step_time_s
        out.print(
            f"  FP8 ({f['recipe']}): products {f['products_s']:.3g} s per step ({f['products_s'] / step:.1%} of the "
            f"step), casts {f['cast_s']:.3g} s ({f['cast_s'] / step:.1%})"
        )
    print_unpriced(unpriced_overrides(run))
