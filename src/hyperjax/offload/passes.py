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
from hyperjax.offload.problem import GIB, Priced, Problem, build_problem, evaluate
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
      cannot_fit: when nothing fits, the memory term that makes it so (a tensor group or fixed term).
      smallest_budget_gib: when nothing fits, the smallest budget that would.
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

    @property
    def placement(self) -> Placement:
        return self.priced.placement

    def to_dict(self) -> dict[str, Any]:
        """The ``"offload"`` object of ``--json``."""
        p = self.priced
        out = {
            "policy": self.policy,
            "placement": p.placement.to_dict(),
            "host_gib_per_device": p.host_bytes / GIB,
            "transfer_s": p.transfer_s,
            "exposed_transfer_s": p.exposed_transfer_s,
            "recompute_s": p.recompute_s,
            "step_time_s": p.step_time_s,
            "peak_gib": p.peak_bytes / GIB,
            "budget_gib": self.budget_gib,
            "fits": self.fits,
        }
        if self.policy == "auto":  # the exact pass: how close to the fastest it proved its placement
            out |= {"proved_gap": p.proved_gap, "time_limited": p.time_limited}
        if not self.fits:
            out |= {"cannot_fit": self.cannot_fit, "smallest_budget_gib": self.smallest_budget_gib}
        return out

    def error(self) -> ConfigError:
        """The error ``train`` raises for a budget no placement fits."""
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
    and ``auto`` search from scratch (recomputation is one of the options they weigh).

    Raises:
      ConfigError: the run has no decoder blocks to place (a vision-language model), or ``run`` is not a
        resolved :class:`Run`.
    """
    check_run(run, "offload_pass")
    o, policy = run.config.offload, run.offload
    hardware = run.hardware
    est = estimate(dataclasses.replace(run, recompute="none"))
    budget = budget_bytes(run.config, hardware)
    deepest = build_problem(est, hardware=hardware, budget_bytes=budget, prefetch=o.prefetch)
    layers = deepest.layers
    start = from_recompute(run.recompute, layers, run.config.train.recompute_modules)
    # buffers for offload.prefetch layers also run every shallower schedule: the fastest is priced
    reaches = range(min(o.prefetch, layers) - 1, 0, -1) if o.prefetch > 1 else ()
    problems = (
        build_problem(est, hardware=hardware, budget_bytes=budget, prefetch=o.prefetch, reach=r) for r in reaches
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
    budget_gib = budget / GIB
    elsewhere = _other_stages(est, hardware, budget, o.prefetch)
    if priced.fits and (elsewhere is None or elsewhere[1] <= budget):
        return OffloadResult(
            policy=policy, priced=priced, fits=True, budget_gib=budget_gib, problem=problem, run=run, base=est
        )
    term, smallest = describe_infeasible(problem) if not priced.fits else (None, priced.peak_bytes)
    if elsewhere is not None and (term is None or elsewhere[1] > smallest):
        term, smallest = elsewhere
    return OffloadResult(
        policy=policy,
        priced=priced,
        fits=False,
        budget_gib=budget_gib,
        problem=problem,
        run=run,
        base=est,
        cannot_fit=term,
        smallest_budget_gib=ceil_gib(smallest),
    )


def _other_stages(est: Estimate, hardware: Hardware, budget: float, prefetch: int) -> tuple[str, float] | None:
    """What makes the pipeline stage, other than the fullest (which the placement is chosen on), that cannot
    fit ``budget`` bytes under any placement of its own blocks too big, and its smallest peak (bytes): the
    one whose smallest peak is largest. ``None`` where every such stage can fit; a stage that fits with
    nothing placed is not solved.

    A stage of other blocks (the embedding's, the loss's) still answers for the step: each stage places
    its own blocks, and the run fits only where all of them do.
    """
    worst: tuple[str, float] | None = None
    for i, stage in enumerate(est.stages):
        if i == est.fullest or stage.memory["peak"] <= budget:
            continue
        try:
            problem = build_problem(est, hardware=hardware, budget_bytes=budget, prefetch=prefetch, stage=i)
        except ConfigError:  # no decoder blocks to place: what it holds stays on the device
            term = max(MEMORY_TERMS, key=stage.memory.__getitem__)
            found = (f"stage {i}'s {term} (it holds no decoder block to place)", stage.memory["peak"])
        else:
            term, smallest = describe_infeasible(problem)
            found = (f"{term} of stage {i}", smallest)
        if found[1] > budget and (worst is None or found[1] > worst[1]):
            worst = found
    return worst


def with_offload(result: OffloadResult) -> Estimate:
    """The estimate of the run under the placement: its step time, memory terms and verdict."""
    est, p = result.base, result.priced
    memory = {k: v - p.moved_bytes.get(k, 0.0) / GIB for k, v in est.memory_per_device_gib.items() if k != "peak"}
    memory |= {"staging": p.staging_bytes / GIB, "host": p.host_bytes / GIB, "peak": p.peak_bytes / GIB}
    breakdown = dict(est.breakdown_s)
    breakdown["recompute"] = result.problem.stretch * p.recompute_s
    breakdown["exposed_host_transfer"] = result.problem.stretch * p.exposed_transfer_s
    return dataclasses.replace(
        est,
        run=result.run,
        step_time_s=p.step_time_s,
        mfu=est.mfu * est.step_time_s / p.step_time_s,
        memory_per_device_gib=memory,
        fits=result.fits,
        overflow=None if result.fits else result.cannot_fit,
        breakdown_s=breakdown,
    )
