"""Search every valid strategy for a model on N devices and rank them by predicted step time.

The search space: data, fsdp, tensor (with sequence parallelism), context, pipeline (with schedule and
virtual stages), ZeRO stage, micro-batch size and recomputation; for a vision-language model under
``mpmd:`` also the split of the devices between its submeshes. Each candidate is resolved
(:func:`hyperjax.resolve`) and priced (:func:`hyperjax.estimate`); those that do not fit the
device-memory budget (``offload.device_memory_gib``, default the preset's HBM) are dropped. Under
``offload.policy: auto`` or ``greedy`` the fastest strategies that do not fit are also given to the
placement pass (:mod:`hyperjax.offload`), and those it makes fit compete with the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyperjax.config import Config, Run
from hyperjax.cost import Estimate, estimate
from hyperjax.errors import ConfigError, HyperjaxError
from hyperjax.offload import budget_bytes, offload_pass, with_offload
from hyperjax.resolver import resolve
from hyperjax.search.strategies import RECOMPUTE, candidate, strategies, submesh_strategies
from hyperjax.topology import Hardware, load_hardware


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy and its prediction.

    Attributes:
      overrides: the config keys that select it (``parallel.*``, ``train.micro_batch``, ``train.recompute``).
      estimate: its predicted step (its ``run`` is the resolved candidate).
      offload: the placement that makes it fit, as ``--json`` prints it, when it needs one.
    """

    overrides: dict[str, Any]
    estimate: Estimate
    offload: dict[str, Any] | None = None

    @property
    def run(self) -> Run:
        """The candidate, resolved."""
        return self.estimate.run

    def to_dict(self) -> dict[str, Any]:
        """The candidate as JSON-ready data: its overrides plus the headline predictions."""
        e = self.estimate
        plain = {
            k: [dataclasses.asdict(s) for s in v] if k == "mpmd.submeshes" else v for k, v in self.overrides.items()
        }
        out = {
            **plain,
            "step_time_s": e.step_time_s,
            "mfu": e.mfu,
            "peak_gib": e.memory_per_device_gib["peak"],
            "fits": e.fits,
        }
        return out | ({"offload": self.offload} if self.offload is not None else {})


class NothingFits(ConfigError):
    """No strategy fits the device-memory budget; ``report`` is the ``fits: false`` answer of ``plan --json``."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def price(cfg: Config, overrides: dict[str, Any], devices: int, hardware: Hardware) -> Estimate:
    """The estimate of the candidate ``overrides`` select (:func:`hyperjax.search.strategies.candidate`).

    Raises:
      HyperjaxError: the candidate does not resolve.
    """
    return estimate(resolve(candidate(cfg, overrides), devices, hardware=hardware))


def plan(
    cfg: Config, devices: int, *, keep: int = 10, hardware: Hardware | None = None
) -> tuple[list[Candidate], int, int]:
    """Rank every valid strategy for ``cfg``'s model on ``devices`` devices that fits.

    Args:
      cfg: the config whose model, batch and optimizer are planned for.
      devices: devices to plan for.
      keep: how many of the fastest to return.
      hardware: the machine (default: ``cfg.hardware``'s preset).

    Returns:
      The best ``keep`` candidates (fastest first), how many strategies were priced, and how many fit.

    Raises:
      ConfigError: no strategy is valid, or none fits (:class:`NothingFits`: the message names the memory
        term that overflows in the leanest candidate).
    """
    hw = load_hardware(cfg.hardware) if hardware is None else hardware
    budget_gib = budget_bytes(cfg, hw) / 2**30
    ranked: list[Candidate] = []
    priced = fitting = 0
    leanest: tuple[dict[str, Any], Estimate] | None = None
    too_big: list[tuple[dict[str, Any], Estimate]] = []  # fast strategies that do not fit: offload candidates
    combinations = list(strategies(cfg, devices))
    if cfg.mpmd.submeshes:
        combinations += list(submesh_strategies(cfg, hw, devices))
    for combination in combinations:
        for recompute in RECOMPUTE:
            overrides = {**combination, "train.recompute": recompute}
            try:
                est = price(cfg, overrides, devices, hw)
            except HyperjaxError:
                break
            priced += 1
            if est.memory_per_device_gib["peak"] <= budget_gib:
                fitting += 1
                ranked.append(Candidate(overrides=overrides, estimate=dataclasses.replace(est, fits=True)))
                break
            if recompute == "none":
                too_big.append((overrides, est))
            if leanest is None or est.memory_per_device_gib["peak"] < leanest[1].memory_per_device_gib["peak"]:
                leanest = (overrides, est)
    if cfg.offload.policy in ("auto", "greedy"):
        fitting += _with_offload(cfg, too_big, ranked)
    if not priced:
        raise ConfigError(
            f"no valid strategy for this model on {devices} devices: check that heads, layers, "
            "sequence length and global batch have divisors that multiply to the device count"
        )
    if not ranked and leanest is not None:
        raise _nothing_fits(cfg, devices, budget_gib, priced, leanest, too_big)
    ranked.sort(key=lambda c: c.estimate.step_time_s)
    return ranked[:keep], priced, fitting


def _nothing_fits(
    cfg: Config,
    devices: int,
    budget_gib: float,
    priced: int,
    leanest: tuple[dict[str, Any], Estimate],
    too_big: list[tuple[dict[str, Any], Estimate]],
) -> NothingFits:
    overrides, est = leanest
    mem = est.memory_per_device_gib
    term = max(("params", "optimizer", "gradients", "activations"), key=mem.__getitem__)
    report = {"fits": False, "priced": priced, "fitting": 0, "budget_gib": budget_gib}
    report |= {"leanest": overrides, "leanest_peak_gib": mem["peak"], "cannot_fit": term}
    hint = "Use more devices, a smaller model or offload.policy: auto."
    if cfg.offload.policy in ("auto", "greedy") and too_big:
        lean = min(too_big, key=lambda oe: oe[1].memory_per_device_gib["peak"])
        offload = offload_pass(lean[1].run)
        report |= {"leanest": lean[0], "cannot_fit": offload.cannot_fit}
        report |= {"smallest_budget_gib": offload.smallest_budget_gib}
        term = f"{offload.cannot_fit} (which cannot leave the device)"
        hint = f"Offloading, the leanest strategy needs {offload.smallest_budget_gib:g} GiB; use more devices."
    return NothingFits(
        f"none of the {priced} strategies on {devices} devices fits {budget_gib:.3g} GiB "
        f"per device; the leanest needs {mem['peak']:.3g} GiB, most of it {term}"
        + (f" ({mem[term]:.3g} GiB). " if term in mem else ". ")
        + hint,
        report,
    )


OFFLOAD_TRIES = 8  # strategies handed to the placement pass (each an integer program)


def _with_offload(cfg: Config, too_big: list[tuple[dict[str, Any], Estimate]], ranked: list[Candidate]) -> int:
    """Give the fastest strategies that do not fit to the placement pass; add those it fits to ``ranked``."""
    best = min((c.estimate.step_time_s for c in ranked), default=float("inf"))
    added = 0
    for overrides, est in sorted(too_big, key=lambda oe: oe[1].step_time_s)[:OFFLOAD_TRIES]:
        if est.step_time_s >= best:
            break  # offloading only adds time: it cannot beat a strategy that fits as it is
        try:
            offload = offload_pass(est.run)
        except HyperjaxError:
            continue  # nothing the pass can place (a vision-language model)
        if offload.fits:
            chosen = {**overrides, "offload.policy": cfg.offload.policy}
            ranked.append(Candidate(overrides=chosen, estimate=with_offload(offload), offload=offload.to_dict()))
            added += 1
    return added
