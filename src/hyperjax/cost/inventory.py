"""The analytic inventory of hyperjax's own training step: FLOPs and collective bytes per device.

It describes the program :mod:`hyperjax.train.step` builds, as XLA partitions it, from the config alone,
so it answers for sizes that cannot compile here. :mod:`hyperjax.cost.hlo` reads the same quantities
from a compiled program; tests hold the two together on configurations that compile on 8 devices.

How XLA's SPMD partitioner lays out this program (the facts encoded below):
- gradients of every parameter are all-reduced over the data-parallel devices (data, fsdp and context,
  which all hold partial sums; a tied embedding's gradients from the lookup and from the output
  projection are reduced apart); XLA's CPU pipeline keeps reduce-scatter as all-reduce plus a slice;
- FSDP and ZeRO-1/2 gather each parameter once per step (FSDP before use, ZeRO after the update); the
  model gathers the embedding table explicitly before its lookup, so it too is gathered once;
- tensor parallelism all-reduces the residual stream after the attention and MLP output projections,
  and in the backward pass after each input projection (query, key, value and each MLP input: the
  projections are separate matrices, so their partial sums are reduced separately), plus once for the
  embedding lookup and once for the gradient of the tied output projection;
- context parallelism all-gathers keys and values over the context axis per layer and reduces their
  gradients; with data parallelism beside it, parameter gradients are reduced in two passes, first over
  the context axis, then over the batch axes (each pass moves the whole gradient; routed experts'
  gradients go in one pass);
- sequence parallelism gathers the residual stream before attention and MLP in both passes, and the
  embedding lookup's output gradient once (the lookup reduce-scatters its rows over the sequence);
- with gradient buckets (``Run.gradient_buckets``, on where the replicas span processes), each replica
  along the replica axes computes its gradients apart, XLA reducing only over the batch axes left inside
  it, and the replicas' gradients, loss and balancing loss are summed in one flat buffer (a tied
  embedding's two gradients are added first, so it crosses once; FSDP's share of what it splits). Where a
  process holds several replicas the sum runs inside it first (the emulation's processes, which a real
  machine does not have: the cost model prices one all-reduce of the buffer over the data axes), so the
  compiled program then has two all-reduces of the buffer where this counts one. Inside a replica split
  out with context and sequence parallelism, XLA regathers the residual stream in the backward pass.

The model steers XLA where its own choice would cost more: every weight is gathered whole before use
(:func:`hyperjax.models.layers.use`), and keys and values are projected on the local sequence shard before
they are gathered, so no activation is regathered to spare a weight gather.

A mixture of experts adds, per MoE layer and micro-batch, the exchange of :mod:`hyperjax.models.moe`
over the expert axes: five all-to-alls (the routed copies out and back in the forward pass, both again in
the backward, and the copies' expert ids), each of the padded send buffer (``exchange_slots`` per
destination device, as the emulation sizes it; a real runtime sends only the copies). Routed experts'
gradients are reduced over the batch axes other than the expert axis, every other gradient over all of
them. With a capacity factor, the order in which copies fill an expert runs over the whole micro-batch
(so the same copies are dropped on any mesh), and XLA gathers every copy's one-hot expert choice onto
every device for it. The expert products are counted as the CPU runs them: XLA:CPU expands a ragged (grouped) product
into a dense product of every row of the buffer with every local expert's weight, masked (G times the
grouped product's FLOPs for G local experts, plus the masking). The cost model prices the grouped
product of the routed copies alone, which is what an accelerator runs.
"""

from __future__ import annotations

import dataclasses
import math

from hyperjax.config import Activation, ModelConfig, Recompute, Run, recomputed
from hyperjax.cost.counts import (
    attention_flops_per_token,
    block_products,
    model_flops_per_sequence,
    model_tensors,
    rebuilds,
    scores_share,
)
from hyperjax.models.moe import exchange_slots, expert_capacity  # the emulation sizes its buffers there


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inventory:
    """Per-device FLOPs and collective result bytes of one training step."""

    flops: float
    reduce_bytes: float  # all-reduce (and reduce-scatter) result bytes
    gather_bytes: float  # all-gather result bytes
    all_to_all_bytes: float = 0.0  # all-to-all result bytes (a mixture of experts' exchange)
    all_to_alls: int = 0  # all-to-all collectives


def runtime_inventory(run: Run) -> Inventory:
    """The inventory of hyperjax's training step for a one-stage ``run`` of a decoder-only model."""
    m, t = run.config.model, run.config.train
    axes = run.axes
    devices = math.prod(axes.values())
    tp, cp, fsdp, data, ep = axes["tensor"], axes["context"], axes["fsdp"], axes["data"], axes["expert"]
    e = 4 if t.dtype == "float32" else 2
    s, h = m.seq_len, m.d_model
    experts = _experts(run)
    forward = model_flops_per_sequence(m) * t.global_batch / 3 - experts.routed_flops
    extra = (
        s
        * t.global_batch
        * sum(reforward_flops_per_token(m, t.recompute, t.recompute_modules, moe=m.is_moe(i)) for i in range(m.layers))
    )
    flops = (3 * forward + extra) / devices + 3 * experts.emulated_flops + experts.reforward_flops
    # XLA's CPU compiler currently drops the rematerialisation (the compiled FLOPs and collectives equal
    # the program without it); on accelerators the recomputed forward pass runs. Compare with care: the
    # jaxpr holds it (tests/cost/test_reforward.py)

    tensors = model_tensors(m)
    sizes = [x.local_size(tensor=tp, expert=ep, expert_tensor=run.expert_tensor_split) for x in tensors]
    local = sum(sizes)  # per device before FSDP/ZeRO
    routed = sum(n for x, n in zip(tensors, sizes, strict=True) if x.expert)
    reduce = gather = 0.0
    manual = run.replica_axes
    # the batch axes XLA reduces over (inside each replica when the step splits replicas out)
    left_data, left_ep = (1 if "data" in manual else data), (1 if "expert" in manual else ep)
    if left_data * fsdp * left_ep * cp > 1:  # routed experts' gradients are not reduced over the expert axis
        reduce += 4 * (local - (routed if left_data * fsdp * cp == 1 else 0))
        if m.tie_embeddings:  # the tied table's two gradients (lookup and output projection) apart
            reduce += 4 * next(n for x, n in zip(tensors, sizes, strict=True) if x.path == "embed")
    if cp > 1 and left_data * fsdp * left_ep > 1:  # reduced over the context axis, then again over the batch axes
        reduce += 4 * (local - routed)  # (routed experts' in one pass over the data and context axes)
    if manual:  # each replica's gradients (and its loss and balancing loss) summed in one flat buffer, as
        # stored: FSDP's share of those it splits (XLA reduce-scattered them over fsdp inside the replica)
        stored = lambda x, n: n / fsdp if "embed" in x.axes else n
        summed = [stored(x, n) for x, n in zip(tensors, sizes, strict=True) if not x.expert or "data" in manual]
        reduce += 4 * sum(summed) + 8
    over_context = run.config.parallel.fsdp_context  # FSDP shards over fsdp x context
    if fsdp * (cp if over_context else 1) > 1:
        gather += 4 * local
    if run.zero_stage >= 1:  # ZeRO gathers the updated parameters over the axes it split them over
        zc = 1 if over_context else cp
        gather += 4 * ((local - routed) * (data * ep * zc > 1) + routed * (data * zc > 1))
    batch = t.global_batch / (data * fsdp * ep)
    act = batch * (s / cp) * h * e
    if tp > 1:  # the lookup's rows summed over the vocabulary's slices (scattered over the sequence with SP)
        lookup = 1 / tp if run.sequence_parallel else 1
        reduce += (sum(_tensor_reductions(m, i) for i in range(m.layers)) + 1 + lookup) * act
        if m.moe is not None and run.expert_tensor_split:  # each routed copy's weight gradient, float32
            reduce += m.moe_layers * batch * (s / cp) * m.moe.top_k * 4
        if run.sequence_parallel:  # the residual stream is gathered before attention and MLP, both passes,
            # and the lookup's output gradient before it is added into the table
            gather += ((4 if m.block == "sequential" else 2) * m.layers + 2) * act
    if m.moe is not None and m.moe.capacity_factor is not None:
        # capacity is counted in one order over the whole micro-batch: every copy's expert is gathered over
        # the batch axes XLA partitions; replicas split out exchange only their copies' counts per expert
        replicas = math.prod(axes[a] for a in manual)
        if left_data * fsdp * left_ep * cp > 1:
            gather += m.moe_layers * t.global_batch / replicas * s * m.moe.top_k * m.moe.experts * 4
        if manual:
            gather += m.moe_layers * run.microbatches * replicas * m.moe.top_k * m.moe.experts * 4
    if manual and cp > 1 and run.sequence_parallel:  # inside a replica split out with context parallelism,
        # XLA regathers the residual stream in the backward pass for every weight product it fed
        gather += ((4 if m.block == "sequential" else 2) * m.layers + 1) * act
    if cp > 1:
        kv = batch * s * m.kv_heads * m.head_dim * e / tp
        gather += m.layers * 2 * kv
        reduce += m.layers * 2 * kv
    return Inventory(
        flops=flops,
        reduce_bytes=reduce,
        gather_bytes=gather,
        all_to_all_bytes=experts.exchanged_bytes,
        all_to_alls=experts.exchanges,
    )


def reforward_flops_per_token(
    m: ModelConfig, recompute: Recompute, modules: tuple[Activation, ...] | None, *, moe: bool = False
) -> float:
    """Forward FLOPs per token that one block of hyperjax's step re-runs in its backward pass under
    ``recompute`` (routed experts' products apart: :func:`_experts`), as JAX rematerialises it: what
    rebuilds each activation the block does not keep, and nothing its backward does not read.

    - the block's products: those whose activation (:func:`~hyperjax.cost.counts.rebuilds`) is recomputed;
      ``full`` recomputes every activation, so all but the products whose output only joins the block's;
      ``mlp_act`` re-runs nothing but element-wise work;
    - the attention core: ``attn_core`` the scores' product (the probabilities), ``attn_out`` the values'
      product. The fused kernel's softmax keeps no named value, so under any policy its scores' product
      re-runs, and with ``attn_out`` its values' product too.
    """
    if recompute == "none":
        return 0.0
    gone = recomputed(recompute, modules)  # all of them under full
    products = [p for p in block_products(m, moe=moe) if not p.name.startswith("experts_")]
    total = sum(p.flops_per_token for p in products if rebuilds(m, p) in gone)
    scores = attention_flops_per_token(m) * scores_share(m)
    values = attention_flops_per_token(m) - scores
    flash = m.attention_kernel == "flash"
    total += scores * ("attn_core" in gone or flash) + values * ("attn_out" in gone)
    return total


@dataclasses.dataclass(frozen=True)
class _Experts:
    """A mixture of experts' routed work on one device per step, as the emulation runs it."""

    routed_flops: float = 0.0  # forward FLOPs of the routed copies through their experts, all devices
    emulated_flops: float = 0.0  # forward FLOPs of the expert products as XLA:CPU runs them, one device
    exchanged_bytes: float = 0.0
    exchanges: int = 0
    reforward_flops: float = 0.0  # those expert products again, where a block re-runs them in its backward


def _experts(run: Run) -> _Experts:
    """The expert products and exchanges of ``run``'s MoE layers (see the module docstring)."""
    m, t = run.config.model, run.config.train
    if m.moe is None:
        return _Experts()
    axes, x = run.axes, m.moe
    tp, cp = axes["tensor"], axes["context"]
    spread = axes["expert"] * (1 if run.expert_tensor_split else tp)  # devices the experts are spread over
    width = tp if run.expert_tensor_split else 1  # ways each expert's hidden width is split
    local = x.experts // spread
    rows = t.global_batch // run.microbatches // run.stages[0].data_parallel  # sequences per device
    tokens = rows * m.seq_len // cp // (1 if run.expert_tensor_split else tp)
    capacity = expert_capacity(x, rows * run.stages[0].data_parallel * m.seq_len)
    buffer = spread * exchange_slots(tokens, x, local, capacity)  # rows a device sends and receives
    products = [p for p in block_products(m, moe=True) if p.name.startswith("experts_")]
    per_row = sum(2.0 * p.n * p.k for p in products) / width  # every local expert, every row of the buffer
    # their outputs are read back home by the routing weights' gradient: a re-forward runs all three
    gone = recomputed(t.recompute, t.recompute_modules)
    again = all(rebuilds(m, p) in gone for p in products)
    layers, micro = m.moe_layers, run.microbatches
    e = 4 if t.dtype == "float32" else 2
    return _Experts(
        routed_flops=layers * t.global_batch * m.seq_len * sum(p.flops_per_token for p in products),
        emulated_flops=layers * micro * local * buffer * per_row,
        reforward_flops=layers * micro * local * buffer * per_row * again,
        exchanged_bytes=layers * micro * buffer * (4 * m.d_model * e + 4) if spread > 1 else 0.0,
        exchanges=layers * micro * 5 if spread > 1 else 0,
    )


def _tensor_reductions(m: ModelConfig, layer: int) -> int:
    """Tensor-parallel all-reduces of the residual stream in block ``layer``: after the attention and MLP
    output projections in the forward, and in the backward after each input projection (query, key, value,
    the MLP's input and, gated, its gate: separate matrices whose partial sums XLA reduces separately).

    A mixture of experts whose experts' hidden widths are split over the tensor axis reduces the experts'
    partial sums in the forward, again in the backward (the transpose of that reduction), and the routed
    copies' input gradient; its shared experts are a dense MLP of their own."""
    mlp = 1 + (2 if m.gated else 1)
    if not m.is_moe(layer):
        return 4 + mlp
    return 4 + 3 + (mlp if m.moe.shared_experts else 0)
