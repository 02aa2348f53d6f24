"""The strategies that do not fit the device-memory budget: those the placement pass makes fit under
``offload.policy: auto`` or ``greedy``, and the error that names the leanest when none does."""

from __future__ import annotations

from typing import Any

from hyperjax.config import Config
from hyperjax.config.run import staged
from hyperjax.cost import MEMORY_TERMS, Estimate
from hyperjax.errors import HyperjaxError
from hyperjax.offload import offload_pass, with_offload
from hyperjax.resolver import resolve
from hyperjax.search.answer import Candidate, NothingFits, plain
from hyperjax.search.strategies import candidate, selected
from hyperjax.topology import Hardware


def nothing_fits(
    cfg: Config,
    devices: int,
    hw: Hardware,
    budget_gib: float,
    priced: int,
    leanest: tuple[dict[str, Any], Estimate],
    too_big: list[tuple[dict[str, Any], Estimate]],
) -> NothingFits:
    overrides, est = leanest
    mem = est.memory_per_device_gib
    term = max(MEMORY_TERMS, key=mem.__getitem__)
    report = {"fits": False, "priced": priced, "fitting": 0, "budget_gib": budget_gib}
    report |= {"leanest": plain(selected(cfg, overrides)), "leanest_peak_gib": mem["peak"], "cannot_fit": term}
    # the placement pass places a decoder's blocks: a vision-language model has none it can place
    can_offload = cfg.offload.policy in ("none", "manual") and cfg.model.vision is None
    hint = "Use more devices, a smaller model" + (" or offload.policy: auto." if can_offload else ".")
    if cfg.offload.policy in ("auto", "greedy") and (one := placeable(too_big)):
        lean = min(one, key=lambda oe: oe[1].memory_per_device_gib["peak"])
        offload = offload_pass(resolve(candidate(cfg, lean[0]), devices, hardware=hw))
        report |= {"leanest": plain(selected(cfg, lean[0])), "cannot_fit": offload.cannot_fit}
        report |= {"smallest_budget_gib": offload.smallest_budget_gib}
        hint = (
            f"Offloading, the leanest needs {offload.smallest_budget_gib:.3g} GiB, most of it "
            f"{offload.cannot_fit}, which cannot leave the device; use more devices."
        )
    return NothingFits(
        f"none of the {priced} strategies on {devices} devices fits {budget_gib:.3g} GiB "
        f"per device; as it is, the leanest needs {mem['peak']:.3g} GiB, most of it {term} "
        f"({mem[term]:.3g} GiB). " + hint,
        report,
    )


OFFLOAD_TRIES = 8  # strategies handed to the placement pass (each an integer program)
OFFLOAD_POOL = 10
"""Under a placement pass the search prices as deep as for this many answers (``plan --top``'s default), so
that the strategies it hands the pass, and the answers, are the same for any ``keep`` up to it."""


def placeable(strategies: list[tuple[dict[str, Any], Estimate]]) -> list[tuple[dict[str, Any], Estimate]]:
    """The strategies train applies a placement to: one SPMD program (:func:`hyperjax.train.prepare`). A
    pipeline, or a stage whose forwards and backwards pair, would be an answer it refuses (predict still
    prices offload there)."""
    return [
        (o, e) for o, e in strategies if not staged(o.get("parallel.pipeline", 1), o.get("parallel.overlap", "none"))
    ]


def add_offloaded(
    cfg: Config,
    devices: int,
    hw: Hardware,
    too_big: list[tuple[dict[str, Any], Estimate]],
    ranked: list[Candidate],
) -> int:
    """Give the fastest strategies of one SPMD program that do not fit to the placement pass; add those it
    fits to ``ranked``."""
    best = min((c.estimate.step_time_s for c in ranked), default=float("inf"))
    added = 0
    one = placeable(too_big)
    tries = sorted(one, key=lambda oe: oe[1].step_time_s)[:OFFLOAD_TRIES]
    if one and not ranked:  # nothing fits as it is: the leanest is the likeliest to fit with offload
        leanest = min(one, key=lambda oe: oe[1].memory_per_device_gib["peak"])
        tries += [leanest] if all(leanest is not t for t in tries) else []
    for overrides, est in tries:
        if est.step_time_s >= best:
            continue  # offloading only adds time: it cannot beat a strategy that fits as it is
        try:
            offload = offload_pass(resolve(candidate(cfg, overrides), devices, hardware=hw))
        except HyperjaxError:
            continue  # nothing the pass can place (a vision-language model)
        if offload.fits:
            chosen = {**selected(cfg, overrides), "offload.policy": cfg.offload.policy}
            ranked.append(Candidate(overrides=chosen, estimate=with_offload(offload), offload=offload.to_dict()))
            added += 1
    return added
