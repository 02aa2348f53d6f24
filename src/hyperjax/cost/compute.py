"""Compute time on one device: a roofline per operator, with the preset's achievable efficiencies.

A matrix multiply runs at ``peak x matmul_efficiency`` unless its operands make it memory-bound, so small
and skinny products (decode-like shapes, tiny tensor-parallel shards) get the lower rate they really see;
the peak is the one XLA's default precision runs the compute dtype's products at (fp32 as TF32 on NVIDIA
tensor cores). Element-wise work streams through HBM at ``hbm_bandwidth x memory_efficiency``. Each
launched operator also costs the preset's ``kernel_overhead``: a batch of equal products (attention's
per-head score and value products) is one batched kernel, so it pays the overhead once.
"""

from __future__ import annotations

import math

from hyperjax.topology import Hardware


def gemm_time(
    m: float, n: float, k: float, *, count: float = 1, bytes_per_element: int, dtype: str, hardware: Hardware
) -> float:
    """Seconds for ``count`` products of an ``(m, k)`` by a ``(k, n)`` matrix, launched as one batched kernel."""
    if min(m, n, k, count) <= 0:
        return 0.0
    d = hardware.device
    flops = 2.0 * m * n * k
    moved = (m * k + k * n + m * n) * bytes_per_element
    one = max(
        flops / (hardware.matmul_flops(dtype) * d.efficiency(d.matmul_precision.get(dtype, dtype))),
        moved / (d.hbm_bandwidth * d.memory_efficiency),
    )
    return count * one + d.kernel_overhead


def stream_time(nbytes: float, *, ops: float, hardware: Hardware) -> float:
    """Seconds to stream ``nbytes`` through HBM in ``ops`` element-wise operators."""
    d = hardware.device
    return nbytes / (d.hbm_bandwidth * d.memory_efficiency) + ops * d.kernel_overhead


def grouped_gemm_time(
    rows: float, n: float, k: float, *, groups: int, bytes_per_element: int, dtype: str, hardware: Hardware
) -> float:
    """Seconds for one grouped product (a mixture of experts' experts, one kernel): ``groups`` products of
    ``(rows / groups, k) x (k, n)``, each group's rows rounded up to the preset's tile height
    (``device.grouped_gemm_rows``). Each group reads its own weight, so few rows per group leave the
    product bound by reading weights: the roofline gives small groups their lower rate.

    A group no row is routed to is skipped, weights unread. With rows spread over the groups at random,
    ``groups (1 - (1 - 1/groups)^rows)`` of them receive any: all of them in training, where rows far
    outnumber groups, but only a few at a small decode batch (one token's top-2 touches two experts)."""
    if min(rows, n, k, groups) <= 0:
        return 0.0
    active = groups * -math.expm1(rows * math.log1p(-1 / groups)) if groups > 1 else 1.0
    tile = hardware.device.grouped_gemm_rows
    per_group = -(-rows / active // tile) * tile if tile > 1 else rows / active
    return gemm_time(per_group, n, k, count=active, bytes_per_element=bytes_per_element, dtype=dtype, hardware=hardware)
