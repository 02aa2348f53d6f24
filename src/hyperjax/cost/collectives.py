"""Collective communication time over the interconnect tiers a mesh axis spans (alpha-beta model).

A group spanning several tiers runs hierarchically: one phase per tier, in the order that moves least over
the slow tiers (outermost first for an all-gather: a rank fetches across the slow tier only the shards its
node lacks, through its own link; NCCL's rings, one channel per NIC, and XLA's do as much). Each
phase moves the data that must cross that tier at the tier's achievable bandwidth (``bandwidth x
efficiency``) and pays the tier's latency once per ring step. An all-reduce inside one switched tier may
instead run in one shot (two latencies, every peer's buffer received), whichever is faster: small buffers.

An all-to-all has no phases: each rank sends its buffer's slices to every other rank at once, and the
slices bound for ranks behind each tier cross that tier's links side by side with the rest. It lasts as
long as the slowest tier's share of the traffic takes (DeepEP's dispatch over NVLink and RDMA together,
for one), plus a latency per rank reached through each tier.

On a torus tier (TPU ICI) a group spanning several torus dimensions runs its all-gather, reduce-scatter
and all-reduce over all of them at once, the multi-dimensional ring of the TPU papers: the bandwidth of
one dimension's bidirectional ring per dimension it spans (half where the dimension has no wraparound and
the ring is a line), and a latency per hop along each.
"""

from __future__ import annotations

import math

from hyperjax.topology import AxisSpan, Hardware

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def collective_time(kind: str, nbytes: float, span: AxisSpan, hardware: Hardware) -> float:
    """Seconds for one collective over the groups of one mesh axis.

    Args:
      kind: one of :data:`KINDS`.
      nbytes: the buffer as nccl-tests sizes it: the full (gathered) array for all-gather and
        reduce-scatter, the array for all-reduce, each rank's buffer for all-to-all, the message for send.
      span: how the axis's groups spread over the tiers (:func:`hyperjax.axis_spans`).
      hardware: the machine.
    """
    if nbytes <= 0 or (span.size == 1 and kind != "send"):
        return 0.0
    tiers = {t.name: t for t in hardware.tiers}
    levels = [(tiers[name], ranks) for name, ranks in span.levels] or [(tiers[span.tier], 1)]
    if kind == "send":
        tier = tiers[span.tier]
        return tier.latency + nbytes / tier.effective_bandwidth
    if kind == "all_reduce":
        ring = 2 * collective_time("all_gather", nbytes, span, hardware)
        if len(levels) == 1 and levels[0][0].topology == "switch":
            # one shot: every rank pushes its buffer to every other through the switch and reduces what it
            # receives; one latency to send, one to signal. A small (decode-sized) buffer cannot amortise the
            # ring's 2 (p - 1) latencies; NCCL's low-latency protocols and TensorRT-LLM's custom all-reduce
            # switch to this form there. The faster of the two is used.
            tier, ranks = levels[0]
            return min(ring, 2 * tier.latency + (ranks - 1) * nbytes / tier.effective_bandwidth)
        return ring
    if kind == "all_to_all":
        total, reached, latency, slowest = math.prod(r for _, r in levels), 1, 0.0, 0.0
        for tier, ranks in levels:
            crossing = nbytes * (reached * ranks - reached) / total  # to ranks first reached through this tier
            latency += (ranks - 1) * tier.latency
            slowest = max(slowest, crossing / tier.effective_bandwidth)
            reached *= ranks
        return latency + slowest
    # all-gather / reduce-scatter: one phase per tier, the data each phase moves set by the phases before it
    return min(_phases(levels, nbytes, span), _phases(levels[::-1], nbytes, span))


def _phases(levels: list, nbytes: float, span: AxisSpan) -> float:
    """An all-gather run tier by tier in ``levels``' order (a reduce-scatter is its reverse, at the same cost).

    A phase gathers, over its tier, the shards the tiers before it have gathered: ``nbytes`` over the product
    of the ranks of the tiers still to come. Run outermost first, the slow tier moves only the shards a node's
    group lacks, each rank through its own link (NCCL's rings run one channel per NIC, so a node's ranks cross
    to the next side by side), and the fast tier then moves the whole buffer; run innermost first, the slow
    tier moves the whole buffer. Whichever order is faster is used."""
    time, later = 0.0, math.prod(r for _, r in levels)
    for tier, ranks in levels:
        later //= ranks
        chunk = nbytes / later
        bandwidth, hops = tier.effective_bandwidth, ranks - 1
        if tier.torus_dims is not None and span.torus:
            bandwidth *= sum(1.0 if wraps else 0.5 for _, wraps in span.torus)
            hops = sum(r - 1 for r, _ in span.torus)
        time += hops * tier.latency + (ranks - 1) / ranks * chunk / bandwidth
    return time
