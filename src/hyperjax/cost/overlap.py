"""A chunk's mixture-of-experts all-to-all under an overlap schedule: how much of it the compute hides.

Each MoE layer of a chunk becomes tasks on the stage's two lanes (:mod:`hyperjax.mpmd.lanes`): on the
compute lane its ``attention`` (everything but the MLP's products: attention, norms, element-wise work)
and its ``experts`` (the MLP's products: router, routed and shared experts); on the communication lane
its dispatch and combine, each one all-to-all of :attr:`LayerCost.exchange_s` in the forward and the
rest of :attr:`LayerCost.expert_comm_s` split between the backward's two. The backward's compute is split
between the two kinds in the forward's proportion, recomputation going to ``attention``.

The lanes are replayed with these lengths (:func:`hyperjax.mpmd.lanes.lane_timing`): what the compute
lane waits for is exposed, and compute running beside an exchange is slowed by the share of the device
the exchange holds (:attr:`hyperjax.config.Run.exchange_share`: ``parallel.dispatcher_sms``, else the
preset's ``device.comm_compute_share``). Under ``two-microbatch`` each half carries half of every task (the
half's tokens). What does not halve with the tokens (the exchanges' latency, the kernels' launch cost,
the grouped products' padding to their tile) is halved too: a small overstatement of the gain, about
1.5 % of the compute for DeepSeek-V3.
Under ``fb-pair`` a forward and a backward run interleaved (:func:`pair_exchange`): of one chunk, or
under an interleaved pipeline of two chunks of the stage, whose MoE layers may differ in number;
:attr:`Pair.end_s` is their time together, which the pipeline's paired tasks take instead of the two apart.

The dense blocks of a chunk and its output layer run before or after the MoE layers and hide nothing:
they are outside the lanes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hyperjax.config import Overlap
from hyperjax.cost.layer_cost import LayerCost
from hyperjax.mpmd.lanes import LaneSchedule, LaneTask, LaneTiming, Pass, lane_schedule, lane_timing, replay_lanes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exchange:
    """One chunk's all-to-all in one micro-batch (zero everywhere for a chunk without MoE layers).

    Attributes:
      forward_s, backward_s: every exchange of its ``F`` and ``B`` task.
      forward_exposed_s, backward_exposed_s: what its compute waits for under the schedule.
      forward_slowdown_s, backward_slowdown_s: what its compute loses to the exchanges beside it.
      forward_end_s, backward_end_s: its MoE layers' forward and backward, exchanges exposed (what a pair
        replaces, :func:`pair_exchange`).
      layers: its MoE layers, in model order.
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_exposed_s: float = 0.0
    backward_exposed_s: float = 0.0
    forward_slowdown_s: float = 0.0
    backward_slowdown_s: float = 0.0
    forward_end_s: float = 0.0
    backward_end_s: float = 0.0
    layers: tuple[LayerCost, ...] = ()

    @property
    def total_s(self) -> float:
        """Every exchange of the chunk's forward and backward."""
        return self.forward_s + self.backward_s

    @property
    def exposed_s(self) -> float:
        """What the chunk's tasks wait for, unpaired."""
        return self.forward_exposed_s + self.backward_exposed_s

    @property
    def slowdown_s(self) -> float:
        """What the chunk's compute loses to the exchanges beside it, unpaired."""
        return self.forward_slowdown_s + self.backward_slowdown_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair:
    """A forward's MoE layers and another micro-batch's backward's run interleaved (``fb-pair``): the same
    chunk's, or under an interleaved pipeline two chunks of one stage (zero where neither has MoE layers).

    Attributes:
      end_s: the two together (compute, exposed exchange and slowdown).
      exposed_s: the exchange the paired compute waits for.
      slowdown_s: what the paired compute loses to the exchanges beside it.
      hidden_s: the exchange of the two that the pair hides.
      unpaired_s: the two apart, exchanges exposed (what ``end_s`` replaces).
      unpaired_exposed_s: what the two apart wait for.
    """

    end_s: float = 0.0
    exposed_s: float = 0.0
    slowdown_s: float = 0.0
    hidden_s: float = 0.0
    unpaired_s: float = 0.0
    unpaired_exposed_s: float = 0.0

    @property
    def saving_s(self) -> float:
        """What running the two as a pair saves over running them apart (negative where the slowdown
        outweighs what it hides)."""
        return self.unpaired_s - self.end_s


def _seconds(sched: LaneSchedule, layers: Sequence[Sequence[LayerCost]], halves: int) -> dict[LaneTask, float]:
    """Each task of ``sched`` at its layer's length (a ``1 / halves`` share of it); ``layers[i]`` are the
    MoE layers stream ``i`` passes through."""
    out = {}
    for c, kind, mine in zip(sched.chains, sched.kinds, layers, strict=True):
        lengths = _lengths(mine, kind)
        for t in c:
            out[t] = lengths[t.name] / halves
    return out


def _lengths(layers: Sequence[LayerCost], kind: Pass) -> dict[str, float]:
    """Every task of a pass through ``layers`` by name."""
    out = {"output": 0.0, "output'": 0.0}
    for i, x in enumerate(layers):
        mlp = x.products_s["mlp_hidden"]
        share = mlp / x.forward_s if x.forward_s else 0.0
        if kind == "F":
            out |= {f"attention {i}": x.forward_s - mlp, f"experts {i}": mlp}
            out |= {f"dispatch {i}": x.exchange_s, f"combine {i}": x.exchange_s}
        else:
            back = x.backward_s * share
            rest = (x.expert_comm_s - 2 * x.exchange_s) / 2
            out |= {f"attention' {i}": x.backward_s + x.recompute_s - back, f"experts' {i}": back}
            out |= {f"dispatch' {i}": rest, f"combine' {i}": rest}
    return out


def _timing(
    overlap: Overlap, layers: Sequence[Sequence[LayerCost]], kinds: tuple[Pass, ...], share: float
) -> LaneTiming:
    sched = lane_schedule(overlap, tuple(len(x) for x in layers), kinds)
    return lane_timing(sched, _seconds(sched, layers, 2 if overlap == "two-microbatch" else 1), share)


def chunk_exchange(layers: Sequence[LayerCost], overlap: Overlap, share: float) -> Exchange:
    """The all-to-all of a chunk whose MoE layers are ``layers`` (in model order) under ``overlap``, on a
    device whose exchanges hold ``share`` of its compute units (:attr:`hyperjax.config.Run.exchange_share`)."""
    if not layers or not any(x.exchange_s for x in layers):
        return Exchange()
    if overlap == "two-microbatch":
        f = _timing(overlap, (layers, layers), ("F", "F"), share)
        b = _timing(overlap, (layers, layers), ("B", "B"), share)
    else:
        f = _timing("none", (layers,), ("F",), share)
        b = _timing("none", (layers,), ("B",), share)
    return Exchange(
        forward_s=f.exchange_s,
        backward_s=b.exchange_s,
        forward_exposed_s=f.exposed_s,
        backward_exposed_s=b.exposed_s,
        forward_slowdown_s=f.slowdown_s,
        backward_slowdown_s=b.slowdown_s,
        forward_end_s=f.end_s,
        backward_end_s=b.end_s,
        layers=tuple(layers),
    )


def pair_exchange(forward: Exchange, backward: Exchange, share: float) -> Pair:
    """The pair of ``forward``'s chunk's ``F`` and ``backward``'s chunk's ``B`` (``fb-pair``), both priced
    unpaired (:func:`chunk_exchange` under ``fb-pair``)."""
    if not forward.layers and not backward.layers:
        return Pair()
    pair = _timing("fb-pair", (forward.layers, backward.layers), ("F", "B"), share)
    return Pair(
        end_s=pair.end_s,
        exposed_s=pair.exposed_s,
        slowdown_s=pair.slowdown_s,
        hidden_s=forward.forward_s + backward.backward_s - pair.exposed_s,
        unpaired_s=forward.forward_end_s + backward.backward_end_s,
        unpaired_exposed_s=forward.forward_exposed_s + backward.backward_exposed_s,
    )


def lane_events(
    layers: Sequence[Sequence[LayerCost]], overlap: Overlap, kinds: tuple[Pass, ...], share: float
) -> list[tuple[LaneTask, float, float]]:
    """The exchanges of one task (or a pair) as the lanes run them: ``(task, start, end)`` from the task's
    start, communication lane only; ``layers[i]`` are the MoE layers pass ``kinds[i]`` goes through."""
    if not any(x.exchange_s for mine in layers for x in mine):
        return []
    sched = lane_schedule(overlap, tuple(len(x) for x in layers), kinds)
    seconds = _seconds(sched, layers, 2 if overlap == "two-microbatch" else 1)
    times = replay_lanes(sched, seconds, share)
    return [(t, s, e) for t, (s, e) in sorted(times.items(), key=lambda kv: kv[1]) if t.lane == "comm"]
