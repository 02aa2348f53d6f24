"""Search every valid strategy for a model on N devices and rank them by predicted step time.

The search space: data, fsdp, tensor (with sequence parallelism), context, pipeline (with schedule and
virtual stages), ZeRO stage, micro-batch size, recomputation and, for a mixture of experts, the schedule
that hides its all-to-all; for a vision-language model under
``mpmd:`` also the split of the devices between its submeshes. Every answer is a resolved run
(:func:`hyperjax.resolve`) priced by :func:`hyperjax.estimate`; those that do not fit the device-memory
budget (``offload.device_memory_gib``, default the preset's HBM less its ``reserved_bytes``) are
dropped. Under ``offload.policy: auto`` or ``greedy`` the fastest strategies that do not fit are also
given to the placement pass (:mod:`hyperjax.offload`), and those it makes fit compete with the rest: a
heuristic (:data:`~hyperjax.search.unfit.OFFLOAD_TRIES` of them, from a search as deep as for
:data:`~hyperjax.search.unfit.OFFLOAD_POOL` answers), not the exhaustive answer below.

It answers in seconds at the scale of the machines people size:

- Candidates that differ only in ZeRO stage, recomputation, MoE overlap schedule, or 1F1B against
  zero-bubble resolve to the
  same stages, so each such *base* is resolved once and its variants priced from it, sharing the cost of
  their stages (:class:`hyperjax.cost.StageCore`); pipeline idle time is in closed form.
- Bases are priced in order of a lower bound on their step (:func:`hyperjax.search.bounds.lower_bound`);
  once a base's bound exceeds the ``keep``-th fastest fitting step found, no base after it can enter the
  answer, and the search stops. The answer is the exhaustive search's: a test compares the two.
- The strategies returned are resolved and priced again on the public path, exactly as ``predict`` would.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Mapping
from typing import Any

from hyperjax.config import Config, Run, check_key
from hyperjax.config.run import stage_schedule
from hyperjax.cost import Estimate, StageCore, estimate
from hyperjax.errors import ConfigError, HyperjaxError, expect, positive_int, written
from hyperjax.offload import budget_bytes
from hyperjax.resolver import check_preset, check_zero, resolve
from hyperjax.search.answer import Candidate, NothingFits, Search
from hyperjax.search.bounds import lower_bound
from hyperjax.search.held import check_held_modifiers, holds
from hyperjax.search.strategies import (
    RECOMPUTE,
    candidate,
    selected,
    strategies,
    submesh_strategies,
    untried,
)
from hyperjax.search.unfit import OFFLOAD_POOL, add_offloaded, nothing_fits
from hyperjax.topology import Hardware, load_hardware

VARIES = ("parallel.zero_stage", "train.recompute", "parallel.overlap")
"""What a base's variants change (and, between 1F1B and zero-bubble, ``parallel.schedule``)."""


def price(cfg: Config, overrides: dict[str, Any], devices: int, hardware: Hardware) -> Estimate:
    """The estimate of the candidate ``overrides`` select, on the public path (resolve, then estimate).

    Raises:
      HyperjaxError: the candidate does not resolve.
    """
    return estimate(resolve(candidate(cfg, overrides), devices, hardware=hardware))


def _zero_refusal(base: Run, zero_stage: int) -> HyperjaxError | None:
    """Why ``base`` at ``zero_stage`` cannot place some tensor's ZeRO-sharded state (:func:`check_zero`), or
    ``None`` where it can."""
    try:
        check_zero(base, zero_stage)
    except HyperjaxError as e:
        return e
    return None


def bases(combinations: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Combinations grouped by what resolves alike: all but the ZeRO stage, and 1F1B with zero-bubble."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for combo in combinations:
        key = tuple(
            (k, "1f1b" if k == "parallel.schedule" and v == "zero-bubble" else v)
            for k, v in combo.items()
            if k not in VARIES
        )
        out.setdefault(key, []).append(combo)
    return out


def plan(
    cfg: Config,
    devices: int,
    *,
    keep: int = 10,
    hardware: Hardware | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    prune: bool = True,
    where: Mapping[str, Any] | None = None,
    accumulate: bool = False,
    one_program: bool = False,
) -> Search:
    """Rank every valid strategy for ``cfg``'s model on ``devices`` devices that fits.

    Args:
      cfg: the config whose model, batch and optimizer are planned for.
      devices: devices to plan for.
      keep: how many of the fastest to return.
      hardware: the machine, loaded or a preset's name or path (default: ``cfg.hardware``'s preset).
      progress: called with ``(bases done, bases in all)`` as the search goes.
      prune: stop at the first base whose lower bound cannot beat the answer (``False``: price every one).
      where: search only the strategies with these settings, e.g. ``{"parallel.expert": 64}`` (a strategy
        that does not set a key, such as a dense model's ``parallel.expert``, is kept); ``train.recompute``
        there is the only recomputation tried; ``train.micro_batch`` and ``train.microbatches`` hold the rows of
        each micro-batch and their count as the step runs them.
      accumulate: also try one stage in micro-batches of ``train.micro_batch`` (gradient accumulation), its
        forwards paired with the previous micro-batch's backwards too for a mixture of experts (``fb-pair``).
      one_program: only steps that run as one SPMD program on one stage (no ``fb-pair`` there: an RL learner).

    Raises:
      ConfigError: no strategy is valid, or none fits (:class:`NothingFits`: the message names the memory
        term that overflows in the leanest candidate).
    """
    start = time.perf_counter()
    expect(cfg, Config, "plan(cfg): cfg", "pass hyperjax.load_config(path)")
    if cfg.rl is not None:
        raise ConfigError("this config has an rl: section; plan its phases with hyperjax.plan_rl (hyperjax plan does)")
    if cfg.offload.policy == "manual":  # its patterns place one layout's tensors; the search prices without them
        raise ConfigError(
            "offload.policy=manual places the tensors offload.manual names in the layout the config gives, but "
            "plan searches layouts and would price them without it; set offload.policy: auto (or greedy) to "
            "place each fastest candidate that does not fit, or none, then price a manual placement of the "
            "layout chosen with predict"
        )
    devices = positive_int(devices, "plan(cfg, devices): devices")
    keep = positive_int(keep, "plan(keep=)")
    if progress is not None and not callable(progress):
        raise ConfigError(f"plan(progress=): progress is {progress!r}; pass a function of (done, total), or None")
    if where is not None and not isinstance(where, Mapping):
        raise ConfigError(
            f"plan(where=): where is {where!r}; pass a mapping of dotted keys to values, e.g. {{'parallel.tensor': 2}}"
        )
    where = {key: check_key(key, "plan(where=)", value) for key, value in (where or {}).items()}
    hw = load_hardware(cfg.hardware if hardware is None else hardware)
    check_preset(cfg, hw)
    budget_gib = budget_bytes(cfg, hw) / 2**30
    combinations = list(strategies(cfg, devices, accumulate=accumulate, one_program=one_program))
    if cfg.mpmd.submeshes:
        combinations += list(submesh_strategies(cfg, hw, devices))
    if where:
        combinations = [c for c in combinations if holds(cfg, c, where)]
        check_held_modifiers(cfg, combinations, where)
    index = {id(c): i for i, c in enumerate(combinations)}  # ties are ranked as the enumeration orders them
    groups = list(bases(combinations).values())
    bound = [
        lower_bound(cfg, g[0], hw, budget_gib * 2**30) if cfg.model.vision is None and prune else 0.0 for g in groups
    ]  # fmt: skip
    order = sorted(range(len(groups)), key=bound.__getitem__)
    found: list[tuple[float, int, dict[str, Any]]] = []  # (step, enumeration order, overrides) that fit
    fastest: list[float] = []  # the negated steps of the ``depth`` fastest found so far (a heap)
    # under a placement pass, the strategies handed to it are the fastest that do not fit among those priced:
    # a search as deep for every ``keep`` up to OFFLOAD_POOL prices the same, so its answers agree
    depth = max(keep, OFFLOAD_POOL) if cfg.offload.policy in ("auto", "greedy") else keep
    priced = 0
    leanest: tuple[dict[str, Any], Estimate] | None = None
    refused: HyperjaxError | None = None  # the first ZeRO stage refused, for a search that prices none
    too_big: list[tuple[dict[str, Any], Estimate]] = []  # fast strategies that do not fit: offload candidates
    cores: dict[tuple, StageCore] = {}
    for done, g in enumerate(order):
        if progress is not None:
            progress(done, len(order))
        if prune and len(fastest) == depth and bound[g] > -fastest[0]:
            break  # bases come in bound order: none after this one can enter the answer
        try:
            named = cfg.train.recompute_modules is not None  # what selective recomputes, kept for pricing
            # resolved at ZeRO stage 0: each candidate's own stage is checked against it (:func:`_zero_refusal`)
            plain = {**groups[g][0], "train.recompute": "selective" if named else "none", "parallel.zero_stage": 0} | (
                {"parallel.overlap": "none"} if cfg.model.moe else {}
            )
            base = resolve(candidate(cfg, plain), devices, hardware=hw)
        except HyperjaxError:
            continue
        pending = []
        for combo in groups[g]:
            e = _zero_refusal(base, combo.get("parallel.zero_stage", cfg.parallel.zero_stage))
            refused = refused or e
            pending += [combo] if e is None else []
        for recompute in (where["train.recompute"],) if "train.recompute" in (where or {}) else RECOMPUTE:
            left = []
            for combo in pending:
                overlap = combo.get("parallel.overlap", "none")
                run = dataclasses.replace(
                    base,
                    recompute=recompute,
                    zero_stage=combo.get("parallel.zero_stage", cfg.parallel.zero_stage),
                    schedule=stage_schedule(len(base.stages), overlap, combo["parallel.schedule"]),
                    overlap=overlap,
                )
                est = estimate(run, cores=cores)
                priced += 1
                overrides = {**combo, "train.recompute": recompute}
                if named and recompute != "selective":  # the modules name what selective recomputes only
                    overrides["train.recompute_modules"] = None
                if est.memory_per_device_gib["peak"] <= budget_gib:
                    found.append((est.step_time_s, index[id(combo)], overrides))
                    heapq.heappush(fastest, -est.step_time_s)
                    if len(fastest) > depth:
                        heapq.heappop(fastest)
                    continue
                left.append(combo)
                if recompute == "none":
                    too_big.append((overrides, est))
                if leanest is None or est.memory_per_device_gib["peak"] < leanest[1].memory_per_device_gib["peak"]:
                    leanest = (overrides, est)
            pending = left
            if not pending:
                break
        if len(cores) > 100_000:  # bounded memory on the largest searches
            cores.clear()
    if progress is not None:
        progress(len(order), len(order))
    # under a placement pass, a strategy that fits as it is runs with nothing placed: its overrides say so, or
    # the pass would choose the recomputation again (it weighs its own) and price another step
    unplaced = {"offload.policy": "none"} if cfg.offload.policy in ("auto", "greedy") else {}
    unplaced |= {"offload.prefetch": 1} if unplaced and cfg.offload.prefetch != 1 else {}  # none refuses another
    best = [
        Candidate(overrides=selected(cfg, o), estimate=dataclasses.replace(price(cfg, o, devices, hw), fits=True))
        for o in (o | unplaced for _, _, o in sorted(found)[:keep])
    ]
    fitting = len(found)
    if cfg.offload.policy in ("auto", "greedy"):
        fitting += add_offloaded(cfg, devices, hw, too_big, best)
        best = sorted(best, key=lambda c: c.estimate.step_time_s)[:keep]
    if not priced and where:
        held = ", ".join(f"{k}={written(v)}" for k, v in where.items())
        micro = any(k.startswith("train.micro") for k in where)
        counts = " and its micro-batches: micro_batch_rows, microbatches" if micro else ""
        why = untried(cfg, devices, where)
        found_none = f"no strategy the search tries on {devices} devices has {held}" + (f" ({why})" if why else "")
        if refused is not None:
            found_none = f"every strategy the search tries on {devices} devices with {held} is refused: {refused}"
        raise ConfigError(
            f"{found_none}; drop {', '.join(where)} to search them all, or give a value among those it tries "
            f"(hyperjax plan --json lists each candidate's settings{counts})"
        )
    if not priced and cfg.parallel.gradient_buckets and _prices_without_buckets(cfg, devices, hw, where, accumulate):
        raise ConfigError(
            f"no strategy on {devices} devices honours parallel.gradient_buckets=true, which needs data-parallel "
            "replicas to sum; drop it (null: buckets where a replica group spans processes) to search them all"
        )
    if not priced:
        raise ConfigError(
            f"no valid strategy for this model on {devices} devices: check that heads, layers, "
            "sequence length and global batch have divisors that multiply to the device count"
        )
    if not best and leanest is not None:
        error = nothing_fits(cfg, devices, hw, budget_gib, priced, leanest, too_big)
        error.report |= {"searched": len(combinations), "seconds": time.perf_counter() - start}
        raise error
    return Search(
        best=best, searched=len(combinations), priced=priced, fitting=fitting, seconds=time.perf_counter() - start
    )


def _prices_without_buckets(
    cfg: Config, devices: int, hw: Hardware, where: Mapping[str, Any] | None, accumulate: bool
) -> bool:
    """Whether the search prices some strategy once ``parallel.gradient_buckets`` is unset: the setting, not the
    model or the device count, is then why none was priced."""
    free = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, gradient_buckets=None))
    try:
        plan(free, devices, keep=1, hardware=hw, where=where, accumulate=accumulate)
    except NothingFits:
        return True
    except HyperjaxError:
        return False
    return True
