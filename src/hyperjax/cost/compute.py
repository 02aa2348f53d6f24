"""Compute time on one device: a roofline per operator, with the preset's achievable efficiencies.

A matrix multiply runs at ``peak x matmul_efficiency`` unless its operands make it memory-bound, so small
and skinny products (decode-like shapes, tiny tensor-parallel shards) get the lower rate they really see; on
a systolic array (``device.systolic_array``: a TPU's MXU) the weight's dimensions are padded to its side
("weight matrices need to be padded to at least size 128 (256 on TPU v6) in all dimensions to fill up the
MXU", jax-ml/scaling-book tpus.md), so a product narrower than the array does the padded work;
the peak is the one XLA's default precision runs the compute dtype's products at (fp32 as TF32 on NVIDIA
tensor cores). Element-wise work streams through HBM at ``hbm_bandwidth x memory_efficiency``. Each
launched operator also costs the preset's ``kernel_overhead``: a batch of equal products (attention's
per-head score and value products) is one batched kernel, so it pays the overhead once.
"""

from __future__ import annotations

import math

from hyperjax.config import CrossEntropy
from hyperjax.topology import Hardware

LOSS_PASSES: dict[str, tuple[int, int, int, int]] = {
    "fused": (4, 8, 1, 2),
    "jit": (22, 10, 3, 1),
    "eager": (38, 14, 6, 3),
}
"""Bytes the loss streams through HBM per logit in the forward and in the backward, and its kernels in each,
by ``train.cross_entropy``, counted from the code that runs it (the products that make the logits and take
their gradient are priced apart):

- ``fused`` 4 + 8: float32-wide logits read once forward (maximum and sum in one pass), read and their
  gradient written backward (XLA's fused loss). Transformer Engine's kernels of the published runs' time read
  16-bit logits for the softmax's statistics, read them again writing the gradient in place (6 bytes forward)
  and scale it by the per-token loss gradient backward (4) (``transformer_engine/pytorch/triton/cross_entropy.py``;
  later releases write a float32 gradient);
- ``jit`` 22 + 10: Megatron's ``cross_entropy_loss_fusion`` with the ``native`` implementation
  (``megatron/core/fusions/fused_cross_entropy.py``, functions compiled by ``jit_fuser``): the upcast with the
  maximum (read 2, write 4), the shift, exponential and sum (read 4, write 4), the normalisation (read 4,
  write 4); backward the saved softmax scaled in place, written back, and cast to 16 bits (read 4, write 4
  and 2);
- ``eager`` 38 + 14: Megatron's vocab-parallel cross entropy unfused
  (``megatron/core/tensor_parallel/cross_entropy.py``), one kernel an operation over float32 logits: the upcast 6,
  the maximum 4, the in-place shift 8, the exponential 8, the sum 4, the normalisation 8; backward the target's
  entries (a scatter), the scaling 8 and the cast back 6. PyTorch's ``cross_entropy`` of upcast logits
  (torchtitan's loss, outside its compiled blocks) moves 48 (the upcast 6, ``log_softmax`` 16 and its
  backward 16, ``nll_loss``'s backward 4, the cast back 6) and is priced as ``eager``: 4 bytes a logit more.
"""


def gemm_time(
    m: float, n: float, k: float, *, count: float = 1, bytes_per_element: int, dtype: str, hardware: Hardware
) -> float:
    """Seconds for ``count`` products of an ``(m, k)`` by a ``(k, n)`` matrix, launched as one batched kernel;
    on a systolic array (a TPU's MXU) the ``(k, n)`` operand's dimensions padded to its side."""
    if min(m, n, k, count) <= 0:
        return 0.0
    d = hardware.device
    moved = (m * k + k * n + m * n) * bytes_per_element
    flops = 2.0 * m * d.padded(n) * d.padded(k)
    one = max(flops / _rate(dtype, hardware), stream_time(moved, ops=0, hardware=hardware))
    return count * one + d.kernel_overhead


def _rate(dtype: str, hardware: Hardware) -> float:
    """FLOP/s a large product of ``dtype`` reaches: its peak (at the precision it runs as) times its efficiency."""
    d = hardware.device
    return hardware.matmul_flops(dtype) * d.efficiency(d.matmul_precision.get(dtype, dtype))


def stream_time(nbytes: float, *, ops: float, hardware: Hardware) -> float:
    """Seconds to stream ``nbytes`` through HBM in ``ops`` element-wise operators."""
    d = hardware.device
    return nbytes / (d.hbm_bandwidth * d.memory_efficiency) + ops * d.kernel_overhead


def grouped_gemm_time(
    rows: float, n: float, k: float, *, groups: int, bytes_per_element: int, dtype: str, hardware: Hardware
) -> float:
    """Seconds for one grouped product (a mixture of experts' experts, one kernel): ``groups`` products of
    ``(rows / groups, k) x (k, n)``, each group's rows rounded up to a multiple of the preset's tile height
    (``device.grouped_gemm_rows``). Each group reads its own weight, so few rows per group leave the
    product bound by reading weights: the roofline gives small groups their lower rate.

    A grouped kernel runs one tile shape for every group (CUTLASS's on Hopper: 128 x 256). Where the preset
    gives the tile's width and the device's units (``device.grouped_gemm_cols``, ``device.compute_units``),
    the groups' tiles run in waves over the units, each unit at its share of the large-product rate, and
    the last wave waits for its slowest tile with units idle: few rows per group (few tiles) reach a
    fraction of the rate, as the kernels measured on a Hopper GPU do (``benchmarks/gpu_kernels.py``). A
    group of fewer rows than the tile then runs in the smallest power-of-two tile height that holds them,
    down to the device's smallest (``device.grouped_gemm_min_rows``: 64, Hopper's warpgroup product).
    An output narrower than the tile still pays the tile's width (no measurement below 768 columns).

    A group no row is routed to is skipped, weights unread. With rows spread over the groups at random,
    ``groups (1 - (1 - 1/groups)^rows)`` of them receive any: all of them in training, where rows far
    outnumber groups, but only a few at a small decode batch (one token's top-2 touches two experts)."""
    if min(rows, n, k, groups) <= 0:
        return 0.0
    d = hardware.device
    active = groups * -math.expm1(rows * math.log1p(-1 / groups)) if groups > 1 else 1.0
    tile = d.grouped_gemm_rows
    if d.compute_units and d.grouped_gemm_min_rows:  # a small group's tile: the power of two that holds it
        tile = min(tile, max(d.grouped_gemm_min_rows, 2 ** math.ceil(math.log2(max(rows / active, 1.0)))))
    per_group = -(-rows / active // tile) * tile if tile > 1 else rows / active
    if not d.compute_units:
        b = bytes_per_element
        return gemm_time(per_group, n, k, count=active, bytes_per_element=b, dtype=dtype, hardware=hardware)
    cols = d.grouped_gemm_cols
    tiles = math.ceil(active) * math.ceil(per_group / tile) * math.ceil(n / cols)
    waves = math.ceil(tiles / d.compute_units)
    # fewer than one group touched on average (a decode step's few rows): its wave runs that often
    compute = min(active, 1.0) * waves * 2.0 * tile * cols * k / (_rate(dtype, hardware) / d.compute_units)
    moved = active * (per_group * k + k * n + per_group * n) * bytes_per_element
    return max(compute, stream_time(moved, ops=0, hardware=hardware)) + d.kernel_overhead


def loss_time(tokens: float, vocab: float, *, kind: CrossEntropy, hardware: Hardware) -> tuple[float, float]:
    """Seconds of the loss's element-wise work over ``tokens x vocab`` logits on one device, forward and
    backward (:data:`LOSS_PASSES`)."""
    forward, backward, forward_kernels, backward_kernels = LOSS_PASSES[kind]
    logits = tokens * vocab
    return (
        stream_time(logits * forward, ops=forward_kernels, hardware=hardware),
        stream_time(logits * backward, ops=backward_kernels, hardware=hardware),
    )
