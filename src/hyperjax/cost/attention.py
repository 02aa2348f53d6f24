"""The attention core of one block, one micro-batch, one device: its kernels, and context parallelism's exchange.

A fused core (``model.attention_kernel: flash``) is one kernel at the device's measured rates over the keys it
visits, never writing its score matrix; a materialized one is two batched products through HBM. Context
parallelism gathers the keys and values of the whole sequence (``parallel.context_impl: allgather``) or passes
them round a ring beside shorter kernels (``ring``, as Megatron-Core runs it).
"""

from __future__ import annotations

import dataclasses

from hyperjax.config import ModelConfig
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.topology import AxisSpan, Hardware


def core_time(
    m: ModelConfig, *, micro: float, tp: int, cp: int, dtype: str, ring: bool, hardware: Hardware
) -> tuple[float, float]:
    """Seconds of the attention core's forward and backward for ``micro`` sequences on one device."""
    e = 2 if dtype == "bfloat16" else 4
    s, a, hd = m.seq_len, m.heads, m.head_dim
    rope = m.rope_head_dim if m.attention == "mla" else 0
    if m.attention_kernel != "flash":  # scores over the query-key width and attention-weighted values
        kw = dict(count=micro * a / tp, bytes_per_element=e, dtype=dtype, hardware=hardware)
        core = gemm_time(s / cp, s, hd + rope, **kw) + gemm_time(s / cp, hd, s, **kw)
        return core, 2.0 * core
    # one fused kernel at its own measured rates (the device's, over the keys), not a GEMM's
    scores = micro * a / tp * (s / cp) * s * 0.5  # a causal kernel skips the masked half
    peak = hardware.matmul_flops(dtype)
    # a kernel's rate ramps with the keys each block of queries visits (``seq_half``, measured on causal
    # kernels, whose blocks visit half their keys on average). One kernel over all keys; or, round a ring,
    # the local causal block over s / cp keys and cp - 1 blocks of as many scores, unmasked over half a
    # block's keys on the busiest device (the last: every block from before it meets both its query
    # chunks): each visits s / 2cp keys, as a causal kernel over s / cp does, so all cp run at its rate
    keys, kernels = (s / cp, cp) if ring else (s, 1)
    forward, backward = hardware.device.attention_rates(m.attention_impl, keys, hd + rope / 2)
    # per score: forward QK (hd + rope wide) and PV (hd); backward recomputes QK, then dV, dP, dQ and dK.
    # On a systolic array each product's stationary operand (a block of keys, values, or the output's
    # gradient) is a head wide: that width padded to the array's side (a 128-wide head fills half of v6e's)
    qk, pv = hardware.device.padded(hd + rope), hardware.device.padded(hd)
    core = scores * (2 * qk + 2 * pv) / (peak * forward) + kernels * hardware.device.kernel_overhead
    core_bwd = scores * (6 * qk + 4 * pv) / (peak * backward) + kernels * hardware.device.kernel_overhead
    if ring:  # each block's output folded into the output (6 bytes an element, after a zeroing 2); backward,
        # each block's query and key-value gradients added into theirs (6 bytes an element), in 16 bits
        out, kv = micro * (s / cp) * a / tp * hd, 2 * micro * (s / cp) * m.kv_heads / tp * hd
        core += stream_time((6 * cp + 2) * out * e / 2, ops=2 * cp, hardware=hardware)
        # (the busiest device's blocks from before it meet half its key-value buffer: half of it is added to)
        core_bwd += stream_time(6 * (cp - 1) * (out + kv / 2) * e / 2, ops=2 * (cp - 1), hardware=hardware)
    return core, core_bwd


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextExchange:
    """Context parallelism's keys and values for one block and micro-batch on one device.

    Attributes:
      forward_s: what of them one forward waits for.
      comm_s: what waits of them in forward, backward and recomputation.
      slowed_forward_s, slowed_backward_s: what the transfers hidden beside the kernels cost those kernels
        (the share of the device they hold).
    """

    forward_s: float
    comm_s: float
    slowed_forward_s: float = 0.0
    slowed_backward_s: float = 0.0


def context_exchange(
    m: ModelConfig,
    *,
    micro: float,
    tp: int,
    cp: int,
    dtype: str,
    ring: bool,
    core: tuple[float, float],
    passes: int,
    span: AxisSpan,
    hardware: Hardware,
) -> ContextExchange:
    """Keys and values met over the context axis (``span``) in ``passes`` passes (forward, backward, and a
    re-forward that runs the core again), beside the core's forward and backward kernels ``core``."""
    e = 2 if dtype == "bfloat16" else 4
    kv_bytes = 2 * micro * m.seq_len * m.kv_heads * m.head_dim * e / tp
    kv_gather = collective_time("all_gather", kv_bytes, span, hardware)
    if not ring:
        return ContextExchange(forward_s=kv_gather, comm_s=passes * kv_gather)
    # the ring moves the gather's bytes, one block a step beside the kernel of the block before: hidden
    # behind all kernels but the last; the backward passes the blocks' gradients round too, its last
    # block returned to its owner after the last kernel
    hide = (cp - 1) / cp
    hidden = [min(kv_gather, hide * core[0]), min(2 * kv_gather, hide * core[1])]
    forward = kv_gather - hidden[0]
    comm = 2 * forward if passes == 3 else forward
    comm += 2 * kv_gather - hidden[1] + kv_gather / (cp - 1)
    # what hides slows the kernels beside it by the share of the device the transfers hold
    share = hardware.device.comm_compute_share
    return ContextExchange(
        forward_s=forward,
        comm_s=comm,
        slowed_forward_s=hidden[0] * share,
        slowed_backward_s=(hidden[1] + (hidden[0] if passes == 3 else 0.0)) * share,
    )
