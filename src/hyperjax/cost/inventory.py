"""The analytic inventory of hyperjax's own training step: FLOPs and collective bytes per device.

It describes the program :mod:`hyperjax.train.step` builds, as XLA partitions it, from the config alone,
so it answers for sizes that cannot compile here. :mod:`hyperjax.cost.hlo` reads the same quantities
from a compiled program; tests hold the two together on configurations that compile on 8 devices.

How XLA's SPMD partitioner lays out this program (the facts encoded below):
- gradients of every parameter are all-reduced over the data-parallel devices (data, fsdp and context,
  which all hold partial sums); XLA's CPU pipeline keeps reduce-scatter as all-reduce plus a slice;
- FSDP and ZeRO-1/2 gather each parameter once per step (FSDP before use, ZeRO after the update); the
  model gathers the embedding table explicitly before its lookup, so it too is gathered once;
- tensor parallelism all-reduces the residual stream after the attention and MLP output projections,
  and in the backward pass after each input projection (query, key, value and each MLP input: the
  projections are separate matrices, so their partial sums are reduced separately), plus once for the
  embedding lookup and once for the gradient of the tied output projection;
- context parallelism all-gathers keys and values over the context axis per layer and reduces their
  gradients; with data parallelism beside it, parameter gradients are reduced in two passes, first over
  the context axis, then over the batch axes (each pass moves the whole gradient);
- sequence parallelism gathers the residual stream before attention and MLP in both passes.

The model steers XLA where its own choice would cost more: every weight is gathered whole before use
(:func:`hyperjax.models.layers.use`), and keys and values are projected on the local sequence shard before
they are gathered, so no activation is regathered to spare a weight gather.
"""

from __future__ import annotations

import dataclasses
import math

from hyperjax.config import Run
from hyperjax.cost.counts import attention_flops_per_token, model_flops_per_sequence, model_tensors


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inventory:
    """Per-device FLOPs and collective result bytes of one training step."""

    flops: float
    reduce_bytes: float  # all-reduce (and reduce-scatter) result bytes
    gather_bytes: float  # all-gather result bytes


def runtime_inventory(run: Run) -> Inventory:
    """The inventory of hyperjax's training step for a one-stage ``run`` of a decoder-only model."""
    m, t = run.config.model, run.config.train
    axes = run.axes
    devices = math.prod(axes.values())
    tp, cp, fsdp, data = axes["tensor"], axes["context"], axes["fsdp"], axes["data"]
    e = 4 if t.dtype == "float32" else 2
    forward = model_flops_per_sequence(m) * t.global_batch / 3
    s, h = m.seq_len, m.d_model
    core = attention_flops_per_token(m) * s * m.layers * t.global_batch  # attention scores and values
    extra = {"none": 0.0, "selective": core, "full": forward}[t.recompute]
    flops = (3 * forward + extra) / devices
    # XLA's CPU compiler currently drops the rematerialisation (the compiled FLOPs and collectives equal
    # the program without it); on accelerators the recomputed forward pass runs. Compare with care.

    tensors = model_tensors(m)
    local = sum(x.size / (tp if x.tensor_split else 1) for x in tensors)  # per device before FSDP/ZeRO
    reduce = gather = 0.0
    if data * fsdp * cp > 1:
        reduce += 4 * local
    if cp > 1 and data * fsdp > 1:  # reduced over the context axis, then again over the batch axes
        reduce += 4 * local
    if fsdp > 1:
        gather += 4 * local
    if run.zero_stage >= 1 and data > 1:
        gather += 4 * local
    batch = t.global_batch / (data * fsdp)
    act = batch * (s / cp) * h * e
    if tp > 1:
        reduce += (m.layers * _tensor_reductions(m) + 2) * act
        if run.sequence_parallel:  # the residual stream is gathered before attention and MLP, both passes
            gather += ((4 if m.block == "sequential" else 2) * m.layers + 1) * act
    if cp > 1:
        kv = batch * s * m.kv_heads * m.head_dim * e / tp
        gather += m.layers * 2 * kv
        reduce += m.layers * 2 * kv
    return Inventory(flops=flops, reduce_bytes=reduce, gather_bytes=gather)


def _tensor_reductions(m) -> int:
    """Tensor-parallel all-reduces of the residual stream per block: after the attention and MLP output
    projections in the forward, and in the backward after each input projection (query, key, value, the
    MLP's input and, gated, its gate: separate matrices whose partial sums XLA reduces separately)."""
    return 2 + 3 + (2 if m.gated else 1)
