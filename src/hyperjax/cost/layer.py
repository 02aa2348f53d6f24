"""One block of a model, one micro-batch, one device: its time, its communication and what it keeps.

The block's products (:func:`hyperjax.cost.counts.block_products`) are priced on the roofline at their
tensor-parallel shapes, the attention core as one batched product per micro-batch, and element-wise work
as the stored activations streamed through HBM, fused as a compiler fuses it or, eager, at
:func:`eager_ratio` times that. The backward costs twice the forward. Tensor- and
context-parallel collectives sit on the critical path; FSDP's gathers and scatters overlap the layer's
compute and only what exceeds it is exposed.

With ``fp8`` (``train.fp8``) the block's linear layers (not the router) run at the device's FP8 peak with
one-byte operands, each product's operands are cast first (memory-bound, :mod:`hyperjax.cost.fp8`), the
linear layers' inputs are kept in FP8 where the recipe reuses them, a mixture of experts dispatches its
tokens in FP8 (DeepSeek-V3; the combine stays in the compute dtype), and FSDP gathers weights at one byte
each with ``all_gather``.

A mixture-of-experts block (``moe=True``) prices its router, its shared experts as a dense MLP, and its
routed experts as one grouped product over the device's experts at the busiest device's load
(:mod:`hyperjax.cost.routing`), and the all-to-all dispatcher's regrouping of its copies by local expert
(:func:`~hyperjax.cost.routing.regroup_move_time`); the dispatch and the combine are all-to-alls over the
expert axis, each once in the forward and once in the backward (and again when the forward is
recomputed), on the tiers that axis spans.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from hyperjax.config import (
    ACTIVATIONS,
    Activation,
    ContextImpl,
    Dispatcher,
    DType,
    Elementwise,
    Fp8Config,
    ModelConfig,
    Recompute,
    Reforward,
    TpOverlap,
    recomputed,
)
from hyperjax.cost.attention import context_exchange, core_time
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, grouped_gemm_time, stream_time
from hyperjax.cost.counts import (
    Product,
    activation_units,
    block_products,
    block_tensors,
    rebuilds,
    scores_share,
)
from hyperjax.cost.fp8 import cast_passes, fp8_input_units, keeps_fp8_inputs
from hyperjax.cost.layer_cost import LayerCost
from hyperjax.cost.routing import exchange_time, regroup_move_time, routing
from hyperjax.topology import AxisSpan, Hardware

EAGER_ELEMENTWISE = {"llama": 12.23 / 4.34, "gpt": 3.61 / 3.37}
"""Eager element-wise work against fused, measured forward and backward on an H100 with PyTorch's profiler
(``benchmarks/gpu_block_measure.py``; ``benchmarks/results/block-h100-measured.json`` and
``block-gpt-h100-measured.json``):

- ``llama``: torchtitan's Llama-3-8B block (float32 RMSNorm written out, complex rotary products,
  ``repeat_kv``, SwiGLU; 2 x 8,192 tokens) spent 12.23 ms in its 110 element-wise and reduction kernels
  eager and 4.34 ms in 58 under ``torch.compile``: each eager operation reads and writes its tensors
  through HBM, float32 ones where the model upcasts, in kernels that reach less of the bandwidth;
- ``gpt``: nanoGPT's GPT block (``F.layer_norm``, one QKV product, GELU, biases; 4 x 4,096 tokens) spent 3.61
  ms eager and 3.37 ms compiled: PyTorch's own layer-norm and GELU kernels are fused already.

A block with an RMSNorm or rotary positions is priced at the first ratio, one with neither at the second
(:func:`eager_ratio`). A materialized attention core's score traffic is priced as it is (the measured
blocks ran a fused kernel)."""


def eager_ratio(m: ModelConfig) -> float:
    """Eager element-wise work over fused for ``m``'s blocks (:data:`EAGER_ELEMENTWISE`)."""
    return EAGER_ELEMENTWISE["llama" if m.norm == "rmsnorm" or m.positions == "rope" else "gpt"]


def price_layer(
    m: ModelConfig,
    *,
    micro: float,
    axes: Mapping[str, int],
    spans: Mapping[str, AxisSpan],
    dtype: str,
    recompute: Recompute,
    sequence_parallel: bool,
    hardware: Hardware,
    moe: bool = False,
    expert_tensor: bool = True,
    fp8: Fp8Config | None = None,
    modules: tuple[Activation, ...] | None = None,
    tp_overlap: TpOverlap = "none",
    fsdp_reshard: bool = True,
    grad_dtype: DType = "float32",
    elementwise: Elementwise = "fused",
    dispatcher: Dispatcher = "deepep",
    context_impl: ContextImpl = "allgather",
    reforward: Reforward = "needed",
) -> LayerCost:
    """Price one block of ``m`` for ``micro`` sequences on one device of a mesh with ``axes``.

    Results are remembered: a search prices the same few layers thousands of times.

    Args:
      m: the block's model (its ``seq_len`` is the tokens per sequence the block sees).
      micro: sequences of one micro-batch on one data-parallel replica.
      axes: the stage's mesh axes (``data``, ``fsdp``, ``expert``, ``context``, ``tensor``).
      spans: the tiers each axis spans, and the composite group ``expert+tensor``.
      dtype: compute dtype.
      recompute: activation recomputation.
      sequence_parallel: the residual stream split over the tensor axis.
      hardware: the machine.
      moe: the block's MLP is ``m.moe``'s mixture of experts.
      expert_tensor: experts' hidden widths are split over the tensor axis (``parallel.expert_tensor``
        null); otherwise the experts spread over it.
      fp8: the FP8 recipe of the linear layers (``train.fp8``); ``None``: they run in ``dtype``.
      modules: the activations ``selective`` recomputes (``train.recompute_modules``; ``None``: the
        attention core).
      tp_overlap: how the tensor-parallel collectives meet the products beside them (``parallel.tp_overlap``).
      fsdp_reshard: FSDP gathers the layer for every pass (``True``), or once a step, the stage priced
        apart (``parallel.fsdp_reshard: false``): nothing of it waits here.
      grad_dtype: the dtype FSDP reduce-scatters gradients in (``train.grad_dtype``).
      elementwise: the element-wise work fused (compiled) or eager, one kernel per operation
        (``train.elementwise``; :func:`eager_ratio`).
      dispatcher: how a mixture of experts' tokens reach their experts (``parallel.dispatcher``).
      context_impl: how context parallelism meets keys and values (``parallel.context_impl``).
      reforward: what a recomputation re-runs (``train.reforward``): the forward ops the backward reads
        (JAX's), or the whole checkpointed region (PyTorch's: a full one the whole forward, a materialized
        attention core's both products).
    """
    return _price_layer(
        m,
        micro,
        tuple(axes.items()),
        tuple(spans.items()),
        dtype,
        recompute,
        sequence_parallel,
        hardware,
        moe,
        expert_tensor,
        fp8,
        modules,
        tp_overlap,
        fsdp_reshard,
        grad_dtype,
        elementwise,
        dispatcher,
        context_impl,
        reforward,
    )


def reforward_collectives(m: ModelConfig, gone: tuple[Activation, ...], sequence_parallel: bool, whole: bool) -> float:
    """The share of a pass's tensor-parallel collectives (an all-reduce after each half of the block; with
    sequence parallelism an all-gather before it and a reduce-scatter after, each a quarter) that a
    re-forward recomputing ``gone`` runs again: with sequence parallelism the gather of a recomputed
    product's input (a parallel block's two halves share one), and the reduction after the attention's output
    product where the mid-block residual is rebuilt (JAX's norms; ``whole`` keeps it). Under JAX's full
    recomputation that leaves out only the reductions after the ``tail`` products."""
    sp = sequence_parallel
    inputs = sum(g in gone for g in ("qkv", "mlp_hidden"))
    gathers = 0.25 * (min(inputs, 1) if m.block == "parallel" else inputs) if sp else 0.0
    residual = m.block == "sequential" and "norms" in gone and not whole
    return gathers + (0.25 if sp else 0.5) * residual


@functools.lru_cache(maxsize=4096)
def _block_params(m: ModelConfig, moe: bool, tp: int, ep: int, expert_tensor: bool) -> tuple[float, float, float]:
    """A block's parameters on one device before FSDP, those of them that are routed experts', and its
    largest tensor's."""
    local = [
        (t.local_size(tensor=tp, expert=ep, expert_tensor=expert_tensor), t.expert) for t in block_tensors(m, moe=moe)
    ]
    return sum(n for n, _ in local), sum(n for n, routed in local if routed), max((n for n, _ in local), default=0.0)


@functools.lru_cache(maxsize=65536)
def _price_layer(
    m: ModelConfig,
    micro: float,
    axes_items: tuple[tuple[str, int], ...],
    span_items: tuple[tuple[str, AxisSpan], ...],
    dtype: str,
    recompute: Recompute,
    sequence_parallel: bool,
    hardware: Hardware,
    moe: bool,
    expert_tensor: bool,
    fp8: Fp8Config | None,
    modules: tuple[Activation, ...] | None,
    tp_overlap: TpOverlap,
    fsdp_reshard: bool,
    grad_dtype: DType,
    elementwise: Elementwise,
    dispatcher: Dispatcher,
    context_impl: ContextImpl,
    reforward: Reforward,
) -> LayerCost:
    axes, spans = dict(axes_items), dict(span_items)
    tp, cp, fsdp, ep = axes["tensor"], axes["context"], axes["fsdp"], axes.get("expert", 1)
    e = 2 if dtype == "bfloat16" else 4  # activation and matmul operand bytes
    s = m.seq_len
    tokens = micro * s / cp  # tokens of one micro-batch on one device
    routed = routing(m, tokens=tokens, axes=axes, expert_tensor=expert_tensor) if moe else None

    def shape(p: Product) -> tuple[float, float, float, int]:
        """A product's rows, output and contracted widths on this device, and its groups (1: dense)."""
        if p.name.startswith("experts_"):  # the routed experts: one grouped product over the local experts
            w = routed.width
            n, k = (p.n / w, p.k) if p.split == "n" else (p.n, p.k / w)
            return routed.busiest, n, k, routed.local_experts
        if p.split == "none":
            return tokens, p.n, p.k, 1
        return (tokens, p.n / tp, p.k, 1) if p.split == "n" else (tokens, p.n, p.k / tp, 1)

    def product(p: Product) -> float:
        rows, n, k, groups = shape(p)
        lowp = fp8 is not None and p.group != "router"  # the router stays in the compute dtype
        b, dt = (1, "fp8") if lowp else (e, dtype)
        if groups > 1:
            return grouped_gemm_time(rows, n, k, groups=groups, bytes_per_element=b, dtype=dt, hardware=hardware)
        return gemm_time(rows, n, k, bytes_per_element=b, dtype=dt, hardware=hardware)

    products = {"qkv": 0.0, "attn_out": 0.0, "mlp_hidden": 0.0}
    # what recomputing each activation re-runs of them (:func:`rebuilds`); the FP8 products among them; those
    # whose output only joins the block's (no backward reads it): the MLP's output products, and in a
    # parallel block the attention's output product
    rerun = dict.fromkeys(ACTIVATIONS, 0.0)
    low = tail = 0.0
    for p in block_products(m, moe=moe):
        products["mlp_hidden" if p.group == "router" else p.group] += product(p)
        low += product(p) if fp8 is not None and p.group != "router" else 0.0
        if (a := rebuilds(m, p)) is None:
            tail += product(p)
        else:
            rerun[a] += product(p)
    proj = sum(products.values())
    cast_fwd = cast_bwd = weight_cast = weights8 = 0.0
    amaxes = 0
    if fp8 is not None:  # every FP8 product's operands cast first: activations forward, gradients backward
        casts = cast_passes(fp8.recipe, e)
        x_elems = g_elems = 0.0
        for p in block_products(m, moe=moe):
            if p.group == "router":
                continue
            rows, n, k, groups = shape(p)
            x_elems, g_elems, weights8 = x_elems + rows * k, g_elems + rows * n, weights8 + groups * n * k
            amaxes += 1
        kernels = amaxes * casts.kernels
        cast_fwd = stream_time(x_elems * casts.activation, ops=kernels / 2, hardware=hardware)
        cast_bwd = stream_time(g_elems * casts.gradient, ops=kernels / 2, hardware=hardware)
        weight_cast = stream_time(weights8 * casts.weight, ops=amaxes, hardware=hardware)
    flash = m.attention_kernel == "flash"
    ring = context_impl == "ring" and cp > 1 and flash
    core, core_bwd = core_time(m, micro=micro, tp=tp, cp=cp, dtype=dtype, ring=ring, hardware=hardware)
    scale = e / 2  # the byte counts are for 16-bit activations
    per_token = micro * (s / cp) * scale
    rep = tp if sequence_parallel else 1
    ways = {"block_in": rep, "norms": rep, "attn_core": tp} | {
        a: tp for a in ("qkv", "attn_out", "mlp_hidden", "mlp_act")
    }
    # the busiest device streams its routed copies (imbalance); what a device keeps is summed over many
    # layers and micro-batches, whose busiest devices differ, so memory counts the mean load
    units = activation_units(m, moe=moe, imbalance=routed.imbalance if routed else 1.0)
    acts = {name: units[name] * per_token / ways[name] for name in ways}
    kept = {name: u * per_token / ways[name] for name, u in activation_units(m, moe=moe).items()}
    if fp8 is not None and keeps_fp8_inputs(fp8):  # the linear layers' inputs kept at one byte, not e
        for name, u in fp8_input_units(m, moe=moe).items():
            kept[name] -= u * micro * (s / cp) * (e - 1) / 2 / ways[name]
    replicated = acts["block_in"] + acts["norms"]
    split = sum(acts[a] for a in ("qkv", "attn_out", "mlp_hidden", "mlp_act"))
    ew_fwd = stream_time(2 * (replicated + split), ops=12 + (8 if moe else 0), hardware=hardware)
    # materialized: the scores and probabilities stream through HBM; fused: they stay on chip, and the
    # backward recomputes the scores (five products of the core's size against the forward's two)
    ew_core_fwd = 0.0 if flash else stream_time(2 * acts["attn_core"], ops=4, hardware=hardware)
    if elementwise == "eager":  # one kernel an operation, float32 where the model upcasts (measured ratio)
        ew_fwd *= eager_ratio(m)
    regroup_fwd = regroup_bwd = regroup_combine = 0.0
    if routed is not None:  # after the dispatch (its FP8 rows under train.fp8) and before the combine; backward
        move = functools.partial(regroup_move_time, m, routed, dispatcher, hardware=hardware)
        regroup_combine = move(bytes_per_element=e)
        regroup_fwd = move(bytes_per_element=1 if fp8 is not None else e) + regroup_combine
        regroup_bwd = 2 * move(bytes_per_element=e)
    fwd = proj + core + ew_fwd + ew_core_fwd + cast_fwd + regroup_fwd
    bwd = 2 * proj + core_bwd + 2 * (ew_fwd + ew_core_fwd) + cast_bwd + regroup_bwd
    ew_share = lambda name: ew_fwd * acts[name] / (replicated + split)
    # recomputing an activation re-runs the forward ops that produce it: its products (``rerun``) and its
    # element-wise work; a materialized core's probabilities need its scores' product, its output its values'
    # product (JAX's), or the core is re-run whole for its probabilities, its output coming with them
    # (``whole``: Megatron's core_attn checkpoint); a fused core keeps no probabilities (its backward
    # recomputes its scores anyway) and re-runs its forward for its output. Together they are the forward but
    # the products whose output the block's backward does not read (``tail``)
    scores = core * scores_share(m) if reforward == "needed" else core
    # a PyTorch checkpoint keeps its region's input: Megatron's ``layernorm`` module re-runs the norms alone
    # from the mid-block residual it keeps (the norms' inputs and masks stay; their outputs go), where JAX
    # rebuilds the residual too
    whole = reforward == "whole"
    outputs = 2.0 * m.d_model * (2 if m.block == "sequential" else 1)  # the norms' outputs a token, 16-bit
    keeps = {"norms": (activation_units(m)["norms"] - outputs) * per_token / ways["norms"]} if whole else {}
    by_name = {
        "norms": ew_fwd * (acts["norms"] + acts["block_in"]) / (replicated + split)
        + (0.0 if whole else rerun["norms"]),
        "qkv": rerun["qkv"] + ew_share("qkv") + cast_fwd,
        "attn_core": 0.0 if flash else scores + ew_core_fwd,
        "attn_out": (core if flash else core - scores) + ew_share("attn_out"),
        "mlp_hidden": rerun["mlp_hidden"] + ew_share("mlp_hidden") + regroup_fwd,
        "mlp_act": ew_share("mlp_act"),
    }
    gone, full = recomputed(recompute, modules), recompute == "full"
    held = {} if full else keeps  # a full recomputation starts from the block's input alone
    stored = kept["block_in"] + sum(kept[a] if a not in gone else held.get(a, 0.0) for a in ACTIVATIONS)
    # PyTorch's full recomputation re-runs the whole forward (Megatron's); a rematerialised JAX block re-runs
    # what its backward reads: all but the ``tail`` products (JAX drops them as dead code). Routed experts'
    # outputs are read (by the routing weights' gradient), so their products, the combine and its regrouping
    # run again
    jax_full = full and reforward == "needed"
    if jax_full:
        extra = fwd - tail
    elif full:
        extra = fwd
    else:
        extra = sum(by_name[a] for a in gone)
    # the re-forward runs the attention core again (and meets keys and values over the context axis again)
    core_again = full or "attn_out" in gone or ("attn_core" in gone and not flash)

    act_bytes = micro * (s / cp) * m.d_model * e
    # the tensor-parallel collectives of the forward, the backward and a re-forward: the whole forward's
    # (PyTorch's full one), or those the recomputed products need (:func:`reforward_collectives`)
    refwd = 1.0 if full and not jax_full else reforward_collectives(m, gone, sequence_parallel, whole)
    refwd_products = proj if full else sum(rerun[a] for a in gone)
    one_pass = 2 * collective_time("all_reduce", act_bytes, spans["tensor"], hardware)
    passes = 2 + full  # forward, backward, re-forward
    # each pass's collectives against the products they can run beside: none; in the backward, the
    # weight-gradient products (bulk); in every pass, its own products, a first chunk exposed (pipelined).
    # What they hide behind runs slower by the share of the device the collective holds
    beside = {"none": (0.0, 0.0, 0.0), "bulk": (0.0, proj, 0.0), "pipelined": (proj, 2 * proj, refwd_products)}
    tensor_comm, slowed = 0.0, []
    for g, share in zip(beside[tp_overlap], (1.0, 1.0, refwd), strict=True):  # forward, backward, re-forward
        collectives = share * one_pass
        hidden = min(collectives * (1 - 1 / tp), g) if g > 0 and tp > 1 else 0.0
        tensor_comm += collectives - hidden
        slowed.append(hidden * hardware.device.comm_compute_share)
    fwd += slowed[0]
    bwd += sum(slowed[1:])
    if fp8 is not None and fp8.recipe == "tensorwise":  # each current amax agreed over the tensor group
        tensor_comm += amaxes * passes * collective_time("all_reduce", 4, spans["tensor"], hardware)
    context = context_exchange(
        m,
        micro=micro,
        tp=tp,
        cp=cp,
        dtype=dtype,
        ring=ring,
        core=(core, core_bwd),
        passes=2 + core_again,
        span=spans["context"],
        hardware=hardware,
    )
    fwd += context.slowed_forward_s
    bwd += context.slowed_backward_s
    expert_comm = one = 0.0
    if routed is not None:  # dispatch and combine in each pass, the busiest device's receive deciding
        exchange = spans["+".join(routed.exchange)]
        one = exchange_time(m, routed, exchange, bytes_per_element=e, hardware=hardware, dispatcher=dispatcher)
        exchanges = 2 + ("mlp_hidden" in gone)  # a re-forward that rebuilds the experts' outputs exchanges again
        expert_comm = 2 * exchanges * one
        if fp8 is not None:  # the forward's dispatch (and its recomputation) moves FP8 rows
            low_one = exchange_time(m, routed, exchange, bytes_per_element=1, hardware=hardware, dispatcher=dispatcher)
            expert_comm -= (exchanges - 1) * (one - low_one)

    params, experts, largest = _block_params(m, moe, tp, ep, expert_tensor)
    gathered = params * e - (weights8 * (e - 1) if fp8 is not None and fp8.all_gather else 0.0)
    gather = collective_time("all_gather", gathered, spans["fsdp"], hardware)
    g = 2 if grad_dtype == "bfloat16" else 4
    scatter = collective_time("reduce_scatter", params * g, spans["fsdp"], hardware)
    exposed = max(0.0, 2 * gather + scatter - (fwd + bwd + extra)) if fsdp_reshard else 0.0
    return LayerCost(
        products_s=products,
        core_s=core,
        forward_s=fwd,
        backward_s=bwd,
        recompute_s=extra,
        tensor_comm_s=tensor_comm,
        context_comm_s=context.comm_s,
        context_forward_s=context.forward_s,
        expert_comm_s=expert_comm,
        exchange_s=one,
        fsdp_gather_s=gather,
        fsdp_scatter_s=scatter,
        fsdp_exposed_s=exposed,
        stored_bytes=stored,
        activation_bytes=kept,
        recompute_by_name_s=by_name,
        recompute_keeps_bytes=keeps,
        params=params / fsdp,
        expert_params=experts / fsdp,
        largest_param=largest,
        param_transfer_bytes=params / fsdp * e,
        fp8_products_s=3 * low,
        cast_s=cast_fwd + cast_bwd,
        weight_cast_s=weight_cast,
        fp8_weights=weights8,
    )
