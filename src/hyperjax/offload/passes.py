"""The offload pass on a resolved run: the placement its ``offload`` policy gives, priced, and the estimate it
changes."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from hyperjax.config import Config, Run, check_run
from hyperjax.cost import MEMORY_TERMS, Estimate, estimate
from hyperjax.errors import ConfigError
from hyperjax.offload.placement import Placement, from_patterns, from_recompute
from hyperjax.offload.problem import GIB, Priced, Problem, build_problem, decoder_blocks, evaluate
from hyperjax.offload.solve import ceil_gib, describe_infeasible, greedy, minimum_memory, solve_exact
from hyperjax.topology import Hardware


@dataclasses.dataclass(frozen=True)
class OffloadResult:
    """The placement a run's ``offload`` policy gives and its price.

    Attributes:
      policy: ``offload.policy``.
      priced: the placement and its predicted step; for a budget nothing fits, the smallest-peak placement.
      fits: whether the placement's peak fits the budget.
      budget_gib: the device-memory budget.
      cannot_fit: when it does not fit, the memory term that makes it so (a tensor group or fixed term), or
        where some placement would fit (``placeable``), the placement of the policy that does not.
      smallest_budget_gib: when it does not fit, the smallest budget some placement of every stage fits.
      others: in a pipeline, the placement each other stage over the budget gives its own blocks, by stage
        index; the step is the slowest stage's.
      placeable: when it does not fit, whether some placement would (``offload.policy`` ``manual`` or
        ``none`` names one that does not; ``greedy`` and ``auto`` find one where any fits).
    """

    policy: str
    priced: Priced
    fits: bool
    budget_gib: float
    problem: Problem
    run: Run  # the run as resolved
    base: Estimate  # the run without offload or recomputation, which the placement is priced against
    cannot_fit: str | None = None
    smallest_budget_gib: float | None = None
    others: tuple[tuple[int, Priced], ...] = ()
    placeable: bool = False

    @property
    def placement(self) -> Placement:
        return self.priced.placement

    @property
    def pace(self) -> Priced:
        """The placement that sets the step: the slowest stage's (the fullest's, its placement chosen first,
        where they tie or there is one stage)."""
        return max((self.priced, *(p for _, p in self.others)), key=lambda p: p.step_time_s)

    def to_dict(self) -> dict[str, Any]:
        """The ``"offload"`` object of ``--json``."""
        p = self.priced
        out: dict[str, Any] = {"policy": self.policy, **p.to_dict()}
        out |= {"step_time_s": self.pace.step_time_s, "budget_gib": self.budget_gib, "fits": self.fits}
        if self.policy == "auto":  # the exact pass: how close to the fastest it proved its placement
            out |= {"proved_gap": p.proved_gap, "time_limited": p.time_limited}
        if self.others:  # the other stages' own placements
            out["stages"] = [{"stage": i, **q.to_dict()} for i, q in self.others]
        if not self.fits:
            out |= {"cannot_fit": self.cannot_fit, "smallest_budget_gib": self.smallest_budget_gib}
        return out

    def error(self) -> ConfigError:
        """The error ``train`` raises for a placement that does not fit the budget."""
        if self.placeable:
            return ConfigError(
                f"offload.device_memory_gib={self.budget_gib:g}: {self.cannot_fit} does not fit, though a "
                f"placement with a peak of {self.smallest_budget_gib:g} GiB per device would. Put more on the host "
                "in offload.manual, or set offload.policy: auto (or greedy) to choose a placement that fits"
            )
        return ConfigError(
            f"offload.device_memory_gib={self.budget_gib:g}: no placement fits; {self.cannot_fit} cannot leave the "
            f"device, and the smallest peak any placement reaches is {self.smallest_budget_gib:g} GiB per device. "
            f"Raise offload.device_memory_gib to at least {self.smallest_budget_gib:g}, or shard more "
            "(parallel.fsdp, parallel.tensor)"
        )


def budget_bytes(cfg: Config, hardware: Hardware) -> float:
    """The device-memory budget per device: ``offload.device_memory_gib``, else the preset's HBM less what
    its runtime reserves (as :func:`hyperjax.cost.memory_budget`)."""
    gib = cfg.offload.device_memory_gib
    return gib * GIB if gib is not None else hardware.device.usable_bytes


def offload_pass(run: Run) -> OffloadResult:
    """The placement ``run``'s offload policy gives, priced by the cost model.

    ``none`` prices ``train.recompute``'s placement; ``manual`` applies ``offload.manual`` over it; ``greedy``
    and ``auto`` search from scratch (recomputation is one of the options they weigh). In a pipeline the
    placement is chosen on the stage that holds the most; every other stage over the budget places its own
    blocks by the same policy, the run fitting only where all of them do and its step the slowest stage's.

    Raises:
      ConfigError: the run has no decoder blocks to place (a vision-language model), or ``run`` is not a
        resolved :class:`Run`.
    """
    check_run(run, "offload_pass")
    est = estimate(dataclasses.replace(run, recompute="none"))
    budget = budget_bytes(run.config, run.hardware)
    priced, problem = _place(run, est, budget)
    others, elsewhere = _other_stages(run, est, budget)
    result = OffloadResult(
        policy=run.offload,
        priced=priced,
        fits=True,
        budget_gib=budget / GIB,
        problem=problem,
        run=run,
        base=est,
        others=others,
    )
    if priced.fits and elsewhere is None:  # every other stage over the budget fits its own placement
        return result
    term, smallest = describe_infeasible(problem) if not priced.fits else (None, priced.peak_bytes)
    if elsewhere is not None and (term is None or elsewhere[1] > smallest):
        term, smallest = elsewhere
    placeable = smallest <= budget  # some placement fits every stage: the policy's own does not
    if placeable:
        i, short = next((i, p) for i, p in ((None, priced), *others) if not p.fits)
        of = f" of stage {i}" if i is not None else ""
        term = f"offload.policy={run.offload}'s placement{of} (peak {short.peak_bytes / GIB:.3g} GiB)"
    return dataclasses.replace(
        result, fits=False, cannot_fit=term, smallest_budget_gib=ceil_gib(smallest), placeable=placeable
    )


def _place(run: Run, est: Estimate, budget: float, stage: int | None = None) -> tuple[Priced, Problem]:
    """The placement of stage ``stage`` (default: the fullest) that ``run``'s policy gives, priced, and its
    problem: of the schedules ``offload.prefetch`` buffers run (every depth up to it), the one whose placement
    fits and is fastest; where nothing fits, the smallest-peak placement.

    Raises:
      ConfigError: the stage holds no decoder blocks to place.
    """
    o, policy, hardware = run.config.offload, run.offload, run.hardware
    deepest = build_problem(est, hardware=hardware, budget_bytes=budget, prefetch=o.prefetch, stage=stage)
    layers = deepest.layers
    start = from_recompute(run.recompute, layers, run.config.train.recompute_modules)
    # buffers for offload.prefetch layers also run every shallower schedule: the fastest is priced
    reaches = range(min(o.prefetch, layers) - 1, 0, -1) if o.prefetch > 1 else ()
    problems = (
        build_problem(est, hardware=hardware, budget_bytes=budget, prefetch=o.prefetch, reach=r, stage=stage)
        for r in reaches
    )
    answers = []
    for problem in itertools.chain([deepest], problems):  # each shallower one built only when needed
        if answers and answers[0][3].fits and answers[0][3].exposed_transfer_s == 0:
            break  # the deepest schedule hides every transfer: no shallower one is faster
        if policy == "none":
            priced = evaluate(problem, start)
        elif policy == "manual":
            priced = evaluate(problem, from_patterns(o.manual, layers, base=start))
        elif policy == "greedy":
            priced = greedy(problem)
        else:
            priced = solve_exact(problem)
        if priced is None:  # greedy or auto found nothing that fits: the smallest-peak placement, which may fit
            priced = minimum_memory(problem)
        answers.append((not priced.fits, priced.step_time_s, len(answers), priced, problem))
    _, _, _, priced, problem = min(answers, key=lambda a: a[:3])
    return priced, problem


def _other_stages(
    run: Run, est: Estimate, budget: float
) -> tuple[tuple[tuple[int, Priced], ...], tuple[str, float] | None]:
    """The placement each pipeline stage other than the fullest (which the placement is chosen on) gives
    its own blocks where it holds more than ``budget`` bytes, as ``(stage, priced)``; and, where one cannot
    fit, what makes it so and its smallest peak (bytes): the stage whose smallest peak is largest (``None``
    where every stage can fit).

    A stage of other blocks (the embedding's, the loss's) still answers for the step: each stage places
    its own blocks, and the run fits only where all of them do.
    """
    placed: list[tuple[int, Priced]] = []
    worst: tuple[str, float] | None = None
    for i, stage in enumerate(est.stages):
        if i == est.fullest or stage.memory["peak"] <= budget:
            continue
        blocks = len(decoder_blocks(est, stage))
        if not blocks:  # nothing of its own to place: what it holds stays on the device
            term = max(MEMORY_TERMS, key=stage.memory.__getitem__)
            found = (f"stage {i}'s {term} (it holds no decoder block to place)", stage.memory["peak"])
        else:
            try:
                priced, problem = _place(run, est, budget, stage=i)
            except ConfigError as e:  # offload.manual's patterns, read against this stage's own blocks
                raise ConfigError(
                    f"pipeline stage {i} ({blocks} blocks, numbered from 0 as each stage's "
                    f"are) is over the budget and places its own blocks by offload.manual: {e}"
                ) from None
            placed.append((i, priced))
            if priced.fits:
                continue
            term, smallest = describe_infeasible(problem)
            found = (f"{term} of stage {i}", smallest)
        if worst is None or found[1] > worst[1]:
            worst = found
    return tuple(placed), worst


def with_offload(result: OffloadResult) -> Estimate:
    """The estimate of the run under the placement: its step time, memory terms and verdict."""
    est, p, pace = result.base, result.priced, result.pace
    memory = {k: v - p.moved_bytes.get(k, 0.0) / GIB for k, v in est.memory_per_device_gib.items() if k != "peak"}
    memory |= {"staging": p.staging_bytes / GIB, "host": p.host_bytes / GIB, "peak": p.peak_bytes / GIB}
    breakdown = dict(est.breakdown_s)
    breakdown["recompute"] = result.problem.stretch * pace.recompute_s  # the slowest stage's
    breakdown["exposed_host_transfer"] = result.problem.stretch * pace.exposed_transfer_s
    return dataclasses.replace(
        est,
        run=result.run,
        step_time_s=pace.step_time_s,
        mfu=est.mfu * est.step_time_s / pace.step_time_s,
        memory_per_device_gib=memory,
        fits=result.fits,
        overflow=None if result.fits else result.cannot_fit,
        breakdown_s=breakdown,
    )
