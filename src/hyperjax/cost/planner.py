"""Search every valid strategy for a model on N devices and rank them by predicted step time.

The search space: data, fsdp, tensor (with and without sequence parallelism), context, pipeline (with
schedule and virtual stages), ZeRO stage, micro-batch size and recomputation. Each candidate is priced by
:func:`hyperjax.cost.estimate` (milliseconds each); those that do not fit the device-memory budget
(``offload.device_memory_gib``, default the preset's HBM) are dropped. Under ``offload.policy: auto`` or
``greedy`` the fastest strategies that do not fit are also given to the placement pass
(:mod:`hyperjax.offload`), and those it makes fit compete with the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from hyperjax.cost.estimate import Estimate, estimate
from hyperjax.errors import ConfigError, HyperjaxError
from hyperjax.topology import Hardware
from hyperjax.train.config import Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy and its prediction.

    Attributes:
      overrides: the config keys that select it (``parallel.*``, ``train.micro_batch``, ``train.recompute``).
      estimate: its predicted step.
    """

    overrides: dict[str, Any]
    estimate: Estimate
    offload: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The candidate as JSON-ready data: its overrides plus the headline predictions."""
        e = self.estimate
        out = {
            **self.overrides,
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


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def strategies(cfg: Config, devices: int) -> Iterator[dict[str, Any]]:
    """Every valid combination of degrees and options for ``cfg``'s model on ``devices`` devices.

    Recomputation is not part of the combination: :func:`plan` tries ``none``, ``selective`` and ``full``
    in that order (each adds time and saves memory) and keeps the first that fits.
    """
    m, t = cfg.model, cfg.train
    heads = math.gcd(m.heads, m.n_kv_heads)
    for tensor in (d for d in divisors(devices) if heads % d == 0 and m.d_ff % d == 0):
        for context in (d for d in divisors(devices // tensor) if m.seq_len % d == 0 and d <= 16):
            for pipeline in (d for d in divisors(devices // (tensor * context)) if m.layers % d == 0):
                rest = devices // (tensor * context * pipeline)
                for fsdp in divisors(rest):
                    data = rest // fsdp
                    dp = data * fsdp
                    if t.global_batch % dp:
                        continue
                    per_replica = t.global_batch // dp
                    micro_options = [mb for mb in divisors(per_replica) if mb <= 16] if pipeline > 1 else [None]
                    schedules = [("1f1b", 1)]
                    if pipeline > 1:
                        schedules += [("interleaved", v) for v in (2, 3, 4) if m.layers % (pipeline * v) == 0]
                        schedules.append(("zero-bubble", 1))
                    for micro in micro_options:
                        for schedule, virtual in schedules:
                            # sequence parallelism moves the same bytes as plain tensor parallelism and
                            # stores less, so it is never worse: only the sequence-parallel variant is priced
                            for zero in (0, 1, 2) if data > 1 else (0,):
                                yield {
                                    "parallel.data": data,
                                    "parallel.fsdp": fsdp,
                                    "parallel.tensor": tensor,
                                    "parallel.sequence_parallel": tensor > 1,
                                    "parallel.context": context,
                                    "parallel.pipeline": pipeline,
                                    "parallel.virtual_stages": virtual,
                                    "parallel.schedule": schedule,
                                    "parallel.zero_stage": zero,
                                    "train.micro_batch": micro,
                                }


def apply(cfg: Config, overrides: dict[str, Any]) -> Config:
    """``cfg`` with dotted-key ``overrides`` applied (validated by the dataclasses)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, field = key.split(".")
        sections.setdefault(section, {})[field] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **f) for s, f in sections.items()})


def plan(cfg: Config, hardware: Hardware, devices: int, *, keep: int = 10) -> tuple[list[Candidate], int, int]:
    """Rank every valid strategy that fits.

    Returns:
      The best ``keep`` candidates (fastest first), how many strategies were priced, and how many fit.

    Raises:
      ConfigError: no strategy is valid, or none fits (the message names the memory term that overflows
        in the leanest candidate).
    """
    ranked: list[Candidate] = []
    priced = fitting = 0
    leanest: Estimate | None = None
    from hyperjax.offload.plan import budget_bytes

    budget_gib = budget_bytes(cfg, hardware) / 2**30
    too_big: list[tuple[dict[str, Any], Estimate]] = []  # fast strategies that do not fit: offload candidates
    for combination in strategies(cfg, devices):
        for recompute in ("none", "selective", "full"):
            overrides = {**combination, "train.recompute": recompute}
            try:
                est = estimate(apply(cfg, overrides), hardware)
            except HyperjaxError:
                break
            priced += 1
            if est.memory_per_device_gib["peak"] <= budget_gib:
                fitting += 1
                ranked.append(Candidate(overrides=overrides, estimate=dataclasses.replace(est, fits=True)))
                break
            if recompute == "none":
                too_big.append((overrides, est))
            if leanest is None or est.memory_per_device_gib["peak"] < leanest.memory_per_device_gib["peak"]:
                leanest, leanest_overrides = est, overrides
    if cfg.offload.policy in ("auto", "greedy"):
        fitting += _with_offload(cfg, hardware, too_big, ranked)
    if not priced:
        raise ConfigError(
            f"no valid strategy for this model on {devices} devices: check that heads, layers, "
            "sequence length and global batch have divisors that multiply to the device count"
        )
    if not ranked and leanest is not None:
        mem = leanest.memory_per_device_gib
        term = max(("params", "optimizer", "gradients", "activations"), key=mem.__getitem__)
        report = {"fits": False, "priced": priced, "fitting": 0, "budget_gib": budget_gib}
        report |= {"leanest": leanest_overrides, "leanest_peak_gib": mem["peak"], "cannot_fit": term}
        hint = "Use more devices, a smaller model or offload.policy: auto."
        if cfg.offload.policy in ("auto", "greedy"):
            from hyperjax.offload.plan import plan_offload

            lean = min(too_big, key=lambda oe: oe[1].memory_per_device_gib["peak"])[0]
            offload = plan_offload(apply(cfg, {**lean, "offload.policy": cfg.offload.policy}), hardware)
            report |= {"leanest": lean, "cannot_fit": offload.cannot_fit}
            report |= {"smallest_budget_gib": offload.smallest_budget_gib}
            term = f"{offload.cannot_fit} (which cannot leave the device)"
            hint = f"Offloading, the leanest strategy needs {offload.smallest_budget_gib:g} GiB; use more devices."
        raise NothingFits(
            f"none of the {priced} strategies on {devices} devices fits {budget_gib:.3g} GiB "
            f"per device; the leanest needs {mem['peak']:.3g} GiB, most of it {term}"
            + (f" ({mem[term]:.3g} GiB). " if term in mem else ". ")
            + hint,
            report,
        )
    ranked.sort(key=lambda c: c.estimate.step_time_s)
    return ranked[:keep], priced, fitting


OFFLOAD_TRIES = 8  # strategies handed to the placement pass (each an integer program)


def _with_offload(
    cfg: Config, hardware: Hardware, too_big: list[tuple[dict[str, Any], Estimate]], ranked: list[Candidate]
) -> int:
    """Give the fastest strategies that do not fit to the placement pass; add those it fits to ``ranked``."""
    from hyperjax.offload.plan import plan_offload, with_offload

    best = min((c.estimate.step_time_s for c in ranked), default=float("inf"))
    added = 0
    for overrides, est in sorted(too_big, key=lambda oe: oe[1].step_time_s)[:OFFLOAD_TRIES]:
        if est.step_time_s >= best:
            break  # offloading only adds time: it cannot beat a strategy that fits as it is
        chosen = {**overrides, "offload.policy": cfg.offload.policy}
        offload = plan_offload(apply(cfg, chosen), hardware)
        if offload.fits:
            ranked.append(Candidate(overrides=chosen, estimate=with_offload(offload), offload=offload.to_dict()))
            added += 1
    return added
