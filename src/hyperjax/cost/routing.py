"""What a mixture of experts does to one device: its share of the routed tokens, and how uneven that is.

Expert parallelism places ``experts / expert`` routed experts on each device of the expert axis (with
``parallel.expert_tensor: 1``, over the tensor axis as well). Every device routes its own tokens'
``top_k`` copies; on average each device receives as many copies as it sends. Routers are not perfectly
balanced, and the step waits for the busiest device: its expert products and the all-to-all traffic it
receives are the mean times the *load imbalance*, the busiest device's routed copies over the mean.

The dispatch and the combine are priced by default (``parallel.dispatcher: deepep``; ``alltoall`` and
``allgather`` at :func:`exchange_time`) as the exchanges real MoE runtimes run (DeepEP's dispatch,
which DeepSeek-V3 trains with; Megatron-Core's flex dispatcher): a token is sent once to each device that
holds any of its experts, and across a slower tier once to each block of that tier's group (a node) that
holds any, then forwarded inside the block. So the bytes crossing a tier are the token's hidden state
times the expected number of distinct blocks behind that tier its ``top_k`` experts fall in (experts
chosen uniformly: a block holding ``b`` of ``E`` experts is reached with probability
``1 - C(E - b, k) / C(E, k)``; grouped routing bounds the blocks a token reaches, :func:`reach_probability`).
The tiers carry their shares side by side; the slowest decides
(:func:`exchange_time`). The combine moves the same bytes back, and the backward pass repeats both.

The imbalance is ``model.moe.load_imbalance`` when the config gives one (1 for force-balanced
benchmarks). Otherwise it comes from the balance method, from the measured ``MaxVio`` (the busiest
expert's load over the mean, minus one) of Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy
for Mixture-of-Experts" (arXiv 2408.15664, Table 2, 3B model): 0.52 with an auxiliary loss, 0.04 with
DeepSeek-V3's bias updates. That is a per-expert figure; a device holding ``G`` experts sums their
loads, and with the experts' deviations independent the sum's relative deviation shrinks by
``sqrt(G)``, so the device's imbalance is ``1 + MaxVio / sqrt(G)``. (Stated assumption: the
deviations of experts that share a device are uncorrelated.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from hyperjax.config import Dispatcher, ModelConfig, MoEConfig
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import stream_time
from hyperjax.topology import AxisSpan, Hardware

MAX_VIOLATION: Mapping[str, float] = {"aux_loss": 0.52, "bias": 0.04}
"""The busiest expert's load over the mean, minus one, by balance method (Wang et al. 2024, Table 2, the 3B
model: auxiliary loss 0.52, loss-free bias 0.04; the 1B model gave 0.72 and 0.04)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Routing:
    """One MoE layer's routed work on one device, per micro-batch.

    Attributes:
      local_experts: routed experts the device holds.
      width: ways each expert's hidden width is split (the tensor degree, or 1 with ``expert_tensor: 1``).
      copies: routed copies the device sends (its tokens times ``top_k``); on average it receives as many.
      imbalance: the busiest device's routed copies over the mean.
      exchange: the mesh axes the all-to-all runs over (``("expert",)`` or ``("expert", "tensor")``).
    """

    local_experts: int
    width: int
    copies: float
    imbalance: float
    exchange: tuple[str, ...]

    @property
    def busiest(self) -> float:
        """Routed copies the busiest device receives and computes."""
        return self.copies * self.imbalance


def routing(m: ModelConfig, *, tokens: float, axes: Mapping[str, int], expert_tensor: bool) -> Routing:
    """The routed work of one MoE layer of ``m`` on a device holding ``tokens`` tokens of a micro-batch.

    ``expert_tensor`` (``parallel.expert_tensor`` null): each expert's hidden width is split over the
    tensor axis, whose devices hold the same tokens; otherwise the experts spread over the tensor axis too,
    and each of its devices routes its own share of the tokens (sequence parallelism).
    """
    x = m.moe
    tp, ep = axes["tensor"], axes.get("expert", 1)
    spread = ep if expert_tensor else ep * tp
    local = max(1, x.experts // spread)
    copies = tokens / (1 if expert_tensor else tp) * x.top_k
    imbalance = load_imbalance(m, local, spread)
    if x.capacity_factor is not None:  # copies past an expert's capacity are dropped (below 1, from every expert)
        imbalance = min(imbalance, x.capacity_factor)
    return Routing(
        local_experts=local,
        width=tp if expert_tensor else 1,
        copies=copies,
        imbalance=imbalance,
        exchange=("expert",) if expert_tensor else ("expert", "tensor"),
    )


def reach_probability(moe: MoEConfig, held: float) -> float:
    """The chance that a token's ``top_k`` experts include one of the ``held`` experts of a block.

    Experts chosen uniformly: ``1 - C(E - held, k) / C(E, k)``. With grouped routing (``moe.groups``, a token
    limited to its ``group_top_k`` best of ``G`` groups: DeepSeek-V3's node-limited routing), the groups
    are chosen uniformly and the experts uniformly among the chosen groups'. A block inside a group is
    reached when its group is chosen and one of its experts is. A block of whole groups is reached when one
    of the groups holding the token's experts is among its own: ``min(group_top_k, top_k)`` such groups
    (stated assumption: each chosen group holds one of the token's experts, as a group is ranked by its
    best scores; with fewer experts than groups, each expert in its own group).
    """
    kept = moe.group_top_k or moe.groups
    if moe.groups == 1 or kept == moe.groups:
        return 1.0 - _miss(moe.experts, moe.top_k, held)
    per = moe.experts / moe.groups
    if held >= per:
        return 1.0 - _miss(moe.groups, min(kept, moe.top_k), held / per)
    return kept / moe.groups * (1.0 - _miss(kept * per, moe.top_k, held))


def _miss(n: float, k: int, held: float) -> float:
    """The chance that ``k`` of ``n`` items chosen uniformly miss ``held`` given ones."""
    miss = 1.0
    for j in range(k):
        miss *= max(0.0, (n - held - j) / (n - j))
    return miss


def exchange_time(
    m: ModelConfig,
    route: Routing,
    span: AxisSpan,
    *,
    bytes_per_element: int,
    hardware: Hardware,
    dispatcher: Dispatcher = "deepep",
) -> float:
    """Seconds of one dispatch (or combine) on the busiest device of an exchange over ``span``.

    ``deepep``: each tier of the span carries the hidden states sent to the blocks first reached through
    it, once per block the token's experts fall in (see the module docstring), at the busiest device's
    load. ``alltoall``: each routed copy goes to its expert's device, crossing the tier between them once:
    a tier carries the copies whose experts lie in the blocks it joins. Either way the tiers run side by
    side, so the slowest tier's share decides, plus a latency per rank it reaches. ``allgather``: every
    device gathers the group's tokens (the combine reduce-scatters them), a collective over the span.
    """
    x = m.moe
    tiers = {t.name: t for t in hardware.tiers}
    group = math.prod(r for _, r in span.levels)
    tokens = route.copies / x.top_k * route.imbalance
    width = m.d_model * bytes_per_element
    if dispatcher == "allgather":  # every token of the group, however the router balances them
        return collective_time("all_gather", route.copies / x.top_k * width * group, span, hardware)
    reached, latency, slowest = 1, 0.0, 0.0
    for name, ranks in span.levels:
        tier = tiers[name]
        held = x.experts * reached / group  # experts in one block of ``reached`` devices
        if dispatcher == "alltoall":  # every copy, to its expert's device
            crossing = tokens * x.top_k * (ranks - 1) * held / x.experts * width
        else:
            crossing = tokens * (ranks - 1) * reach_probability(x, held) * width
        latency += (ranks - 1) * tier.latency
        slowest = max(slowest, crossing / tier.effective_bandwidth)
        reached *= ranks
    return latency + slowest


def load_imbalance(m: ModelConfig, local_experts: int, devices: int) -> float:
    """The busiest of ``devices`` devices' routed copies over the mean when each holds ``local_experts``
    experts (see the module docstring); 1 when one device holds every expert."""
    x = m.moe
    if x.load_imbalance is not None:
        return x.load_imbalance
    if devices == 1:
        return 1.0
    return 1.0 + MAX_VIOLATION[x.balance] / math.sqrt(local_experts)


def regroup_move_time(
    m: ModelConfig, routed: Routing, dispatcher: Dispatcher, *, bytes_per_element: int, hardware: Hardware
) -> float:
    """Seconds of one regrouping of the busiest device's routed copies by local expert (0 where there is
    none): each copy read and written once.

    Megatron-Core's all-to-all dispatcher holds its received copies in chunks by source device (and, under
    expert tensor parallelism, by tensor rank), so with more than one local expert it sorts them by expert
    after the dispatch and back before the combine (``sort_chunks_by_idxs``): two such moves in the forward
    and two of their gradients in the backward. DeepEP-style kernels write the copies where the expert's
    permutation reads them; one local expert needs no sorting."""
    if dispatcher != "alltoall" or routed.local_experts == 1:
        return 0.0
    return stream_time(2 * routed.busiest * m.d_model * bytes_per_element, ops=1, hardware=hardware)
