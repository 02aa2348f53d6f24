"""How a stage sits in its pipeline: the micro-batches whose activations it holds, what they add to its
memory, and the tier its hand-overs to a neighbouring stage cross."""

from __future__ import annotations

import dataclasses

from hyperjax.config import Run, Stage
from hyperjax.cost.stage import StageCost
from hyperjax.mpmd.schedules import warm_up
from hyperjax.topology import AxisSpan, Hardware


def with_in_flight(cost: StageCost, stage: Stage, held: int) -> StageCost:
    """``cost`` (of a stage alike in all but the micro-batches it holds) for ``stage`` holding ``held``."""
    if stage is cost.stage and held == cost.in_flight:
        return cost
    kept = sum(p.layers * p.layer.stored_bytes for p in cost.parts)
    memory = dict(cost.memory)
    memory["activations"] += (held - cost.in_flight) * kept
    memory["peak"] = peak_with(cost, held)
    chunks = tuple(dataclasses.replace(c, chunk=n) for c, n in zip(cost.chunks, stage.chunks, strict=True))
    return dataclasses.replace(cost, stage=stage, in_flight=held, memory=memory, chunks=chunks)


def peak_with(cost: StageCost, held: int) -> float:
    """The peak memory of ``cost`` had its stage held ``held`` micro-batches."""
    kept = sum(p.layers * p.layer.stored_bytes for p in cost.parts)
    terms = sum(v for k, v in cost.memory.items() if k != "peak")
    return cost.memory["peak"] * (1 + (held - cost.in_flight) * kept / terms) if terms else cost.memory["peak"]


def in_flight(run: Run, s: int) -> int:
    """Micro-batches whose activations stage ``s`` holds at its peak: all of them under GPipe; else its
    warm-up's forwards and the one in flight (:func:`hyperjax.mpmd.schedules.warm_up`), ``v`` chunk
    forwards a micro-batch when interleaved. Under 1F1B the first stage holds ``p`` and each later one one
    fewer; interleaved, the first holds Korthikanti et al.'s ``p (1 + (p - 1) / (p v))`` (4.2.3), and later
    stages more than that rule scaled by ``p - s``. Pairing forwards with backwards (``fb-pair``) holds its
    longer warm-up's forwards alone, ``2(p - s) - 1`` under 1F1B and one (a single stage): a pair runs its
    forward's layers first to last and its backward's last to first, a layer at a time, each backward layer
    freeing what its forward layer keeps (Megatron-Core's combined 1F1B), so a pair ends holding what it
    started with and its peak is above that by a layer's activations, not a micro-batch's."""
    p, m, v = len(run.stages), run.microbatches, run.virtual_stages
    if p == 1:
        return 1
    if run.schedule == "gpipe":
        return m
    paired = run.overlap == "fb-pair"
    chunks = warm_up(s, p, v, paired=paired) + (0 if paired else 1)
    return min(m, -(-chunks // v))


def boundary_span(hw: Hardware, first: int, second: int) -> AxisSpan:
    """The span of a hand-over between device ``first`` and device ``second`` (the innermost tier whose
    group holds both)."""
    for tier in hw.tiers:
        if tier.group_size is None or first // tier.group_size == second // tier.group_size:
            return AxisSpan(axis="pipeline", size=2, tier=tier.name, levels=((tier.name, 2),))
    last = hw.tiers[-1]
    return AxisSpan(axis="pipeline", size=2, tier=last.name, levels=((last.name, 2),))
