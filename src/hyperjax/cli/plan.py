"""``hyperjax plan CONFIG --devices N``: the fastest strategy that fits, and the runners-up.

Every valid strategy (data, fsdp, ZeRO, tensor with sequence parallelism, context, pipeline with schedule
and virtual stages, micro-batch, recomputation) is priced by the cost model; those that do not fit device
memory are dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from rich.table import Table

from hyperjax.cli.display import console, fmt_count, print_unpriced
from hyperjax.cli.options import add_command, add_config_arguments, config_from_args
from hyperjax.config import Config
from hyperjax.cost import unpriced_overrides
from hyperjax.errors import ConfigError
from hyperjax.files import parse_yaml
from hyperjax.rl.rewards import check_reward
from hyperjax.search import SEARCHED, NothingFits, plan
from hyperjax.search.rl import plan_rl
from hyperjax.topology import load_hardware


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "plan",
        usage="CONFIG --devices N [--set KEY=VALUE ...] [options]",
        summary="search strategies by predicted step time",
        description=(
            "Search every valid strategy (data, fsdp, ZeRO, tensor and sequence, context, expert, pipeline with "
            "its schedule, micro-batch, recomputation), price each with the cost model, drop those that do not "
            "fit device memory, and list the fastest. A searched parallel.* key given with --set holds the search "
            "to its value, as do train.recompute, train.micro_batch (one stage then accumulates micro-batches of "
            "that size; with --accumulate it is only the size accumulated) and train.microbatches (a pipeline's "
            "count, or one stage's with train.micro_batch held too)."
        ),
        examples=[
            "hyperjax plan configs/deepseek-v3-671b.yaml --devices 384",
            "hyperjax plan configs/quickstart.yaml --devices 64 --set train.global_batch=64",
            "hyperjax plan configs/llama3-70b.yaml --devices 1024 --top 5 --json",
            "hyperjax plan configs/mixtral-8x7b.yaml --devices 64 --accumulate",
            "hyperjax plan configs/llama3-70b.yaml --devices 512 --set parallel.tensor=8",
        ],
    )
    p.add_argument("--devices", type=int, required=True, metavar="N", help="devices to plan for")
    add_config_arguments(p, config_help="YAML config (its model and train sections are planned for)", hardware=True)
    p.add_argument("--top", type=int, default=10, metavar="K", help="candidates to list (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--accumulate",
        action="store_true",
        help="also search one stage accumulating micro-batches of train.micro_batch (a mixture of experts also "
        "with each forward beside the previous backward: parallel.overlap fb-pair)",
    )
    p.set_defaults(run=run)


HELD_TRAIN = ("micro_batch", "microbatches", "recompute")
"""The ``train.*`` keys the search varies, which ``--set`` holds too."""


def _held(sets: list[str], cfg: Config) -> dict[str, Any]:
    """The searched ``parallel.*`` keys and :data:`HELD_TRAIN` keys that ``--set`` gives (one by one or in a
    ``parallel=`` or ``train=`` mapping), at their values in ``cfg``, as the search writes them: what the plan
    keeps fixed. A null (derived) value holds nothing; an expert tensor degree above 1 holds null's meaning,
    each expert split over a tensor axis of that many devices (1 holds the experts spread over it)."""
    given = _given(sets)
    names = {k.removeprefix("parallel.") for k in given if k.startswith("parallel.")}
    train = {k.removeprefix("train.") for k in given if k.startswith("train.")}
    p = cfg.parallel
    held = {f"parallel.{n}": getattr(p, n) for n in sorted(names & SEARCHED)}
    held |= {f"train.{n}": getattr(cfg.train, n) for n in HELD_TRAIN if n in train}
    return _as_searched(held, "parallel.")


def _held_rl(sets: list[str], cfg: Config) -> dict[str, Any]:
    """The layout keys of an ``rl:`` config that ``--set`` gives, at their values in ``cfg``: a phase's
    ``devices`` and its searched ``parallel.*`` degrees, one by one or inside a mapping (``rl.learner.parallel=
    {fsdp: 4}``, ``rl.rollout={devices: 6}``); what the plan keeps fixed. A null (derived) value holds nothing,
    and a learner's expert tensor degree above 1 holds null's meaning over a tensor axis of that many devices."""
    held: dict[str, Any] = {}
    for key in sorted(_given(sets)):
        parts = key.split(".")
        if len(parts) < 3 or parts[0] != "rl" or parts[1] not in ("rollout", "learner"):
            continue
        phase = getattr(cfg.rl, parts[1])
        if parts[2:] == ["devices"]:
            held[key] = phase.devices
        elif parts[2] == "parallel" and len(parts) == 4 and parts[3] in SEARCHED:
            held[key] = getattr(phase.parallel, parts[3])
    return _as_searched(held, "rl.learner.parallel.")


def _as_searched(held: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``held`` without its null (derived) values, and an expert tensor degree above 1 under ``prefix`` as the
    search writes it: null, over a tensor degree of that many devices."""
    split = held.get(f"{prefix}expert_tensor")
    held = {k: v for k, v in held.items() if v is not None}
    if split is not None and split > 1:
        held |= {f"{prefix}expert_tensor": None, f"{prefix}tensor": split}
    return held


def _given(sets: list[str]) -> dict[str, Any]:
    """The dotted keys ``--set`` items give, with their values, a mapping's entries one by one
    (``parallel={tensor: 2}`` gives ``parallel.tensor``); a later item wins."""
    given: dict[str, Any] = {}
    for item in sets:
        key, _, text = item.partition("=")
        given |= _flat(key.strip(), parse_yaml(text))
    return given


def _virtual_stages(sets: list[str]) -> list[str]:
    """A held ``parallel.schedule`` without ``parallel.virtual_stages``: the search chooses the virtual stages,
    so the config is read with a count the schedule takes (2 interleaved, else 1) rather than refused for the
    one it names (``schedule: interleaved`` over the default 1, or ``1f1b`` over a config's 5)."""
    given = _given(sets)
    if "parallel.schedule" not in given or "parallel.virtual_stages" in given:
        return []
    return [f"parallel.virtual_stages={2 if given['parallel.schedule'] == 'interleaved' else 1}"]


def _flat(key: str, value: Any) -> dict[str, Any]:
    """A ``--set`` item as dotted keys: a mapping's entries one by one, into nested mappings."""
    if isinstance(value, dict):
        return {k: v for sub, inner in value.items() for k, v in _flat(f"{key}.{sub}", inner).items()}
    return {key: value}


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--devices", args.devices), ("--top", args.top)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    cfg = config_from_args(args, _virtual_stages(args.sets))
    if cfg.rl is not None:
        if args.accumulate:
            raise ConfigError("--accumulate: an rl: config's plan accumulates its learner's micro-batches already")
        return _plan_rl(args, cfg)
    if args.accumulate and cfg.train.micro_batch is None:
        raise ConfigError(
            "--accumulate searches one stage in micro-batches of train.micro_batch, which is null; set it, e.g. "
            "--set train.micro_batch=1"
        )
    hw = load_hardware(cfg.hardware)
    where = _held(args.sets, cfg)
    if args.accumulate:  # the micro-batch is the size one stage accumulates, beside all its rows at once
        where.pop("train.micro_batch", None)
    bar = None if args.json or not sys.stderr.isatty() else _progress_bar()
    try:
        found = plan(
            cfg,
            args.devices,
            keep=args.top,
            hardware=hw,
            progress=bar[1] if bar else None,
            accumulate=args.accumulate or "train.micro_batch" in where,  # one stage runs the size held too
            where=where,
        )
    except NothingFits as e:
        if args.json:  # the answer is "nothing fits": say so in the JSON too, then exit 2 with the message
            print(json.dumps(e.report | {"error": str(e)}, indent=2))
        raise
    finally:
        if bar is not None:
            bar[0].stop()
    best = found.best
    if args.json:
        print(
            json.dumps(
                {
                    "best": best[0].to_dict(),
                    "candidates": [c.to_dict() for c in best],
                    "searched": found.searched,
                    "priced": found.priced,
                    "fitting": found.fitting,
                    "seconds": found.seconds,
                    "search_s": found.seconds,
                },
                indent=2,
            )
        )
        return 0
    out = console()
    out.print(
        f"planned {cfg.model.family} ({fmt_count(best[0].estimate.params)} parameters) on "
        f"{args.devices} {hw.name} devices: {found.searched} strategies searched, {found.priced} priced, "
        f"{found.fitting} of those fit, {found.seconds:.1f} s"
    )
    table = Table(title="fastest strategies that fit (predicted)")
    for col in ("#", "strategy", "recompute", "offload", "step s", "MFU", "peak GiB"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for i, c in enumerate(best, 1):
        e = c.estimate
        table.add_row(
            str(i),
            c.run.describe(),
            c.run.recompute,
            f"{c.offload['host_gib_per_device']:.2g}" if c.offload else "-",
            f"{e.step_time_s:.4g}",
            f"{e.mfu:.1%}",
            f"{e.memory_per_device_gib['peak']:.3g}",
        )
    out.print(table)
    print_unpriced(*(unpriced_overrides(c.run) for c in best))
    return 0


def _plan_rl(args: argparse.Namespace, cfg: Config) -> int:
    """An ``rl:`` config: the split of the devices between its phases and each phase's layout."""
    check_reward(cfg.rl.reward)
    found = plan_rl(cfg, args.devices, keep=args.top, held=_held_rl(args.sets, cfg))
    if args.json:
        best = [e.to_dict() | {"unpriced": list(unpriced_overrides(e.rl.rollout, e.rl.learner))} for e in found.best]
        print(
            json.dumps(
                {
                    "best": best[0],
                    "candidates": best,
                    "splits": found.splits,
                    "priced": found.priced,
                    "search_s": found.seconds,
                },
                indent=2,
            )
        )
        return 0
    out = console()
    r = cfg.rl
    out.print(
        f"planned {r.algorithm} of {cfg.model.family} ({r.placement}) on {args.devices} "
        f"{found.best[0].rl.hardware.name} devices: {found.splits} split(s), {found.priced} layouts priced, "
        f"{found.seconds:.1f} s"
    )
    table = Table(title="fastest iterations that fit (predicted)")
    for col in ("#", "rollout", "learner", "wave", "rollout s", "learn s", "hand-over s", "iteration s", "idle"):
        table.add_column(col, justify="left" if col in ("rollout", "learner") else "right")
    for i, e in enumerate(found.best, 1):
        rl = e.rl
        table.add_row(
            str(i),
            f"{rl.rollout.devices}: {rl.rollout.describe(serving=True)}",
            f"{rl.learner.devices}: {rl.learner.describe()}",
            str(rl.wave),
            f"{e.rollout_s:.4g}",
            f"{e.learn_s:.4g}",
            f"{e.handover_s:.3g}",
            f"{e.iteration_s:.4g}",
            f"{e.idle_fraction:.0%}",
        )
    out.print(table)
    print_unpriced(*(unpriced_overrides(e.rl.rollout, e.rl.learner) for e in found.best))
    return 0


def _progress_bar() -> tuple[Any, Callable[[int, int], None]]:
    """A rich progress bar on stderr and the callback that advances it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("searching"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
    task = progress.add_task("plan", total=None)
    progress.start()

    def advance(done: int, total: int) -> None:
        if done % 64 == 0 or done == total:
            progress.update(task, completed=done, total=total)

    return progress, advance
