"""One stage of a run priced for one micro-batch: its chunks' tasks, its communication and its memory.

A stage's chunks are priced part by part (:mod:`hyperjax.cost.parts`): each part a stack of equal blocks
of one module, the embedding and the output layer at the model's ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hyperjax.config import ModelConfig, Run, Stage
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, loss_time, stream_time
from hyperjax.cost.fp8 import cast_time
from hyperjax.cost.layer import price_layer
from hyperjax.cost.layer_cost import LayerCost
from hyperjax.cost.memory import (
    grad_bytes,
    optimizer_traffic,
    replica_axes,
    sharding_axes,
    sharding_spans,
    stage_memory,
    zero_share,
)
from hyperjax.cost.overlap import Exchange, chunk_exchange
from hyperjax.cost.parts import chunk_starts, outside_tensors, part_models
from hyperjax.topology import AxisSpan


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartCost:
    """A stack of equal blocks of one module on one stage, one micro-batch on one device.

    Attributes:
      module: ``decoder``, ``encoder`` or ``language_model``.
      layers: blocks in the stack.
      layer: one block.
      moe: whether its blocks' MLPs are mixtures of experts.
      head_s: the output layer's forward and backward (logits and loss, or the encoder's projection);
        0 where the part does not end the module.
      head_forward_s: the forward's share of ``head_s`` (the product and the loss's forward).
      head_weight_s: the weight-gradient product's share of ``head_s`` (its ``W`` part).
      head_bytes: the output layer's float32 logits kept for the backward (none for an encoder's projection,
        which keeps no logits).
      held_params: parameters outside the blocks that this device holds (embedding, norms, head).
      trained_params: those of them its optimizer updates (a tied head's copy is updated where the
        embedding lives).
      boundary_bytes: the activations this part hands to the next stage (per device).
    """

    module: str
    layers: int
    layer: LayerCost
    head_s: float
    head_bytes: float
    held_params: float
    trained_params: float
    boundary_bytes: float
    moe: bool = False
    head_forward_s: float = 0.0
    head_weight_s: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkCost:
    """One chunk's pipeline tasks for one micro-batch, exposed communication included.

    Attributes:
      chunk: the chunk, in model order.
      forward_s: its ``F`` task.
      backward_s: its ``B`` task (the input-gradient part only when the backward is split).
      weight_s: its ``W`` task (the weight-gradient GEMMs; 0 unless the backward is split).
      comm_s: the exposed communication inside ``F`` and ``B`` (the exposed all-to-all included).
      exchange: its MoE all-to-all under the run's overlap schedule.
    """

    chunk: int
    forward_s: float
    backward_s: float
    weight_s: float
    comm_s: float
    exchange: Exchange = dataclasses.field(default_factory=Exchange)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage of a run: per micro-batch times, per step data-parallel and optimizer time, memory.

    Attributes:
      stage: the stage.
      parts: its parts, chunk by chunk.
      chunks: its chunks' tasks.
      compute_s: forward and backward of every part (no recomputation, no communication).
      recompute_s: recomputation.
      comm_s: exposed tensor, context, expert and FSDP communication.
      slowdown_s: what the compute loses to all-to-alls running beside it (overlap schedules).
      p2p_s: point-to-point hand-overs to the neighbouring stages.
      data_parallel_s: the gradient reduction (and ZeRO gathers) over the data axis, whole.
      data_parallel_exposed_s: the part of it not hidden behind the last micro-batch's backward.
      optimizer_s: the optimizer step over the local shard.
      weight_cast_s: casting the stage's weights to FP8, once per step (0 without ``train.fp8``).
      in_flight: micro-batches whose activations the stage holds at its peak.
      memory: bytes per device: ``params``, ``optimizer``, ``gradients``, ``activations``, ``peak``.
      spans: the tiers each of its mesh axes spans.
    """

    stage: Stage
    parts: tuple[PartCost, ...]
    chunks: tuple[ChunkCost, ...]
    compute_s: float
    recompute_s: float
    comm_s: float
    p2p_s: float
    slowdown_s: float
    data_parallel_s: float
    data_parallel_exposed_s: float
    optimizer_s: float
    in_flight: int
    memory: Mapping[str, float]
    spans: Mapping[str, AxisSpan]
    weight_cast_s: float = 0.0

    @property
    def per_microbatch_s(self) -> float:
        """Everything the stage does for one micro-batch."""
        return self.compute_s + self.recompute_s + self.comm_s + self.p2p_s + self.slowdown_s

    @property
    def layers(self) -> int:
        """Blocks on the stage."""
        return sum(p.layers for p in self.parts)

    @property
    def head_s(self) -> float:
        """The output layers on the stage."""
        return sum(p.head_s for p in self.parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCore:
    """What a stage costs whatever its ZeRO stage and however its backward is split: the part of
    :class:`StageCost` a search shares between strategies that differ only in those.

    Attributes:
      parts: the stage's parts, chunk by chunk.
      tasks: per chunk ``(chunk, forward, whole backward, weight-gradient GEMMs, exposed communication,
        all-to-all)``.
      compute_s, recompute_s, comm_s, p2p_s, slowdown_s: as in :class:`StageCost`.
      held_params, trained_params: parameters one device holds, and those its optimizer updates.
      expert_params: those of them that are routed experts' (reduced over the data axes only).
      kept_bytes: activations one micro-batch leaves on the device for the backward (blocks only).
      head_bytes: the output layers' activations.
      last_backward_s: the backward of one micro-batch, which the gradient reduction can hide behind.
      spans: the tiers each mesh axis spans.
    """

    parts: tuple[PartCost, ...]
    tasks: tuple[tuple[int, float, float, float, float, Exchange], ...]
    compute_s: float
    recompute_s: float
    comm_s: float
    p2p_s: float
    slowdown_s: float
    held_params: float
    trained_params: float
    kept_bytes: float
    head_bytes: float
    last_backward_s: float
    spans: Mapping[str, AxisSpan]
    expert_params: float = 0.0


def stage_core(run: Run, stage: Stage, spans: Mapping[str, AxisSpan], p2p: AxisSpan | None) -> StageCore:
    """Price ``stage`` of ``run`` for one micro-batch, all but its ZeRO and backward-split terms.

    Args:
      run: the resolved run.
      stage: one of its stages.
      spans: the tiers each of the stage's mesh axes spans.
      p2p: the tier a hand-over to a neighbouring stage crosses (``None`` for a single stage).
    """
    hw, m, axes = run.hardware, run.config.model, sharding_axes(run.config.parallel, stage.axes)
    spans = sharding_spans(run.config.parallel, stage.axes, spans)
    micro = run.rows / stage.data_parallel
    last = run.chunks - 1
    starts_at = chunk_starts(run)
    parts: list[PartCost] = []
    chunk_parts: list[list[PartCost]] = []
    for i, c in enumerate(stage.chunks):
        here = []
        found = part_models(m, stage, i, starts_at[c])
        for j, (module, block, layers, moe) in enumerate(found):
            layer = price_layer(
                block,
                micro=micro,
                axes=axes,
                spans=spans,
                dtype=run.dtype,
                recompute=run.recompute,
                sequence_parallel=run.sequence_parallel,
                hardware=hw,
                moe=moe,
                expert_tensor=run.expert_tensor_split,
                fp8=run.config.train.fp8,
                modules=run.config.train.recompute_modules,
                tp_overlap=run.config.parallel.tp_overlap,
                fsdp_reshard=run.config.parallel.fsdp_reshard,
                grad_dtype=run.config.train.grad_dtype,
                elementwise=run.config.train.elementwise,
                dispatcher=run.config.parallel.dispatcher,
                context_impl=run.config.parallel.context_impl,
                reforward=run.config.train.reforward,
            )
            ends = module != "decoder" or c == last
            starts = module != "decoder" or c == 0
            # a module's blocks of two kinds are two parts; the last carries what lies outside the blocks
            outside = j + 1 == len(found) or found[j + 1][0] != module
            part = _part(module, block, layers, layer, m, micro, axes, run, starts=starts, ends=ends, outside=outside)
            here.append(dataclasses.replace(part, moe=moe))
        chunk_parts.append(here)
        parts += here
    first = next((p for p in parts if p.layers), None)  # the stage's first block (a chunk may hold none)
    gathers = axes["fsdp"] > 1 and run.config.parallel.fsdp_reshard and first is not None
    first_gather = first.layer.fsdp_gather_s if gathers else 0.0
    # the all-to-all is exposed as the overlap schedule leaves it; the rest of the blocks' on the path
    layer_comm = [sum(p.layers * (p.layer.on_path_comm_s - p.layer.expert_comm_s) for p in ps) for ps in chunk_parts]
    share = run.exchange_share
    exchanges = [
        chunk_exchange([p.layer for p in ps if p.moe for _ in range(p.layers)], run.overlap, share)
        for ps in chunk_parts
    ]
    hand_over = [
        2 * collective_time("send", ps[-1].boundary_bytes, p2p, hw) if p2p is not None else 0.0 for ps in chunk_parts
    ]
    tasks = []
    for i, (c, ps) in enumerate(zip(stage.chunks, chunk_parts, strict=True)):
        half = (layer_comm[i] + first_gather / len(stage.chunks) + hand_over[i]) / 2
        ex = exchanges[i]
        fwd = sum(p.layers * p.layer.forward_s + p.head_forward_s for p in ps) + half
        fwd += ex.forward_exposed_s + ex.forward_slowdown_s
        bwd = sum(p.layers * (p.layer.backward_s + p.layer.recompute_s) + p.head_s - p.head_forward_s for p in ps)
        bwd += half
        bwd += ex.backward_exposed_s + ex.backward_slowdown_s
        weight = sum(p.layers * p.layer.weight_s + p.head_weight_s for p in ps)
        tasks.append((c, fwd, bwd, weight, 2 * half + ex.exposed_s, ex))
    return StageCore(
        parts=tuple(parts),
        tasks=tuple(tasks),
        compute_s=sum(p.layers * (p.layer.forward_s + p.layer.backward_s) + p.head_s for p in parts),
        recompute_s=sum(p.layers * p.layer.recompute_s for p in parts),
        comm_s=sum(layer_comm) + first_gather + sum(ex.exposed_s for ex in exchanges),
        p2p_s=sum(hand_over),
        slowdown_s=sum(ex.slowdown_s for ex in exchanges),
        held_params=sum(p.layers * p.layer.params + p.held_params for p in parts),
        trained_params=sum(p.layers * p.layer.params + p.trained_params for p in parts),
        expert_params=sum(p.layers * p.layer.expert_params for p in parts),
        kept_bytes=sum(p.layers * p.layer.stored_bytes for p in parts),
        head_bytes=sum(p.head_bytes for p in parts),
        last_backward_s=sum(p.layers * (p.layer.backward_s + p.layer.recompute_s) for p in parts),
        spans=spans,
    )


def price_stage(run: Run, stage: Stage, core: StageCore, *, in_flight: int) -> StageCost:
    """The cost of ``stage`` of ``run`` from its :class:`StageCore`: the backward split as the schedule
    says, the gradient reduction and optimizer step of its ZeRO stage, and its memory with ``in_flight``
    micro-batches held (:func:`in_flight`)."""
    hw, axes = run.hardware, stage.axes
    e = 2 if run.dtype == "bfloat16" else 4
    split = run.schedule == "zero-bubble"
    chunks = tuple(
        ChunkCost(
            chunk=c,
            forward_s=f,
            backward_s=b - (w if split else 0.0),
            weight_s=w if split else 0.0,
            comm_s=x,
            exchange=ex,
        )
        for c, f, b, w, x, ex in core.tasks
    )
    trained = core.trained_params
    kind = "all_reduce" if run.zero_stage == 0 else "reduce_scatter"
    # gradients are reduced over every device holding a batch or sequence shard: routed experts' over the
    # data and context axes, the rest also over the expert axis, which carries batch outside the experts
    over = "" if run.config.parallel.fsdp_context else "+context"  # FSDP over context reduce-scatters it
    reduced = (
        (trained - core.expert_params, core.spans[f"data{over}+expert"]),
        (core.expert_params, core.spans[f"data{over}"]),
    )
    reduce = sum(collective_time(kind, n * grad_bytes(run.config.train), span, hw) for n, span in reduced)
    gather = sum(collective_time("all_gather", n * e, span, hw) for n, span in reduced) if run.zero_stage >= 1 else 0.0
    if sharding_axes(run.config.parallel, axes)["fsdp"] > 1 and not run.config.parallel.fsdp_reshard:
        # FSDP gathers the stage's layers once a step and reduce-scatters their accumulated gradients once
        reduce += sum(p.layers * p.layer.fsdp_scatter_s for p in core.parts)
        gather += sum(p.layers * p.layer.fsdp_gather_s for p in core.parts)
    dp_time = reduce + gather
    layers = max(sum(p.layers for p in core.parts), 1)
    # parallel.dp_overlap: exposed whole; beside the last micro-batch's backward as its buckets are ready
    # (the last layer's bucket after it); with the parameter gather beside the next step's first forward too
    if run.config.parallel.dp_overlap == "none":
        dp_exposed = dp_time
    elif run.config.parallel.dp_overlap == "full":
        first_forward = sum(t[1] for t in core.tasks)
        dp_exposed = max(0.0, reduce - core.last_backward_s) + max(0.0, gather - first_forward) + dp_time / layers
    else:  # the gather follows the optimizer step: nothing of the step is left to hide it
        dp_exposed = max(0.0, reduce - core.last_backward_s) + gather + dp_time / layers
    replicas = replica_axes(run.config.parallel, axes)
    opt_params = zero_share(trained, core.expert_params, replicas) if run.zero_stage >= 1 else trained
    memory = stage_memory(run, stage, core, in_flight=in_flight)
    fsdp, fp8 = sharding_axes(run.config.parallel, axes)["fsdp"], run.config.train.fp8
    gathered = 1 if fp8 is not None and fp8.all_gather else e
    return StageCost(
        stage=stage,
        parts=core.parts,
        chunks=chunks,
        compute_s=core.compute_s,
        recompute_s=core.recompute_s,
        comm_s=core.comm_s,
        p2p_s=core.p2p_s,
        slowdown_s=core.slowdown_s,
        data_parallel_s=dp_time,
        data_parallel_exposed_s=dp_exposed,
        optimizer_s=stream_time(opt_params * optimizer_traffic(run), ops=8, hardware=hw),
        weight_cast_s=sum(p.layers * p.layer.weight_cast_s for p in core.parts) / (fsdp if gathered == 1 else 1),
        in_flight=in_flight,
        memory=memory,
        spans=core.spans,
    )


def _part(
    module: str,
    block: ModelConfig,
    layers: int,
    layer: LayerCost,
    m: ModelConfig,
    micro: float,
    axes: Mapping[str, int],
    run: Run,
    *,
    starts: bool,
    ends: bool,
    outside: bool = True,
) -> PartCost:
    """A part's output layer, the parameters it holds outside its blocks and what it hands on (with
    ``outside=False``, the blocks alone: another part of the module carries the rest)."""
    tp, cp, fsdp = axes["tensor"], axes["context"], axes["fsdp"]
    e = 2 if run.dtype == "bfloat16" else 4
    hw = run.hardware
    tokens = micro * block.seq_len / cp
    head_s = head_forward_s = head_weight_s = head_bytes = 0.0
    if ends and outside and module == "encoder":  # the projection into the language model, whole on each device
        product = gemm_time(tokens, block.vocab, block.d_model, bytes_per_element=e, dtype=run.dtype, hardware=hw)
        head_s, head_forward_s, head_weight_s = 3 * product, product, product
    elif ends and outside:  # the output layer, its loss and the float32 logits it keeps
        vocab = block.vocab
        fp8 = run.config.train.fp8
        low = fp8 is not None and fp8.output_layer
        product = gemm_time(
            tokens,
            vocab / tp,
            block.d_model,
            bytes_per_element=1 if low else e,
            dtype="fp8" if low else run.dtype,
            hardware=hw,
        )
        loss_fwd, loss_bwd = loss_time(tokens, vocab / tp, kind=run.config.train.cross_entropy, hardware=hw)
        cast = cast_time(fp8, e, tokens, block.d_model, vocab / tp, hw) if low else 0.0  # input, gradient, weight
        head_s = 3 * product + loss_fwd + loss_bwd + cast
        head_forward_s = product + loss_fwd + cast / 3
        head_weight_s = product + cast / 3
        head_bytes = tokens * vocab / tp * 4 * 2
    held = trained = 0.0
    for t in outside_tensors(module, block, m) if outside else ():
        local = t.size / ((tp if t.tensor_split else 1) * (fsdp if "embed" in t.axes else 1))
        embedding = t.path.endswith("embed") and not t.path.endswith("pos_embed")
        head_side = t.path.startswith("final_norm") or t.path == "lm_head"
        if module == "decoder" and embedding and block.tie_embeddings and ends and not starts:
            held += local  # the last stage's copy of a tied table (the first stage trains it)
            continue
        if module == "decoder" and ((not starts and (embedding or t.path == "pos_embed")) or (not ends and head_side)):
            continue
        held += local
        trained += local
    rep = tp if run.sequence_parallel else 1
    boundary = micro * (block.seq_len / cp) * (m.d_model if module == "encoder" else block.d_model) * e / rep
    return PartCost(
        module=module,
        layers=layers,
        layer=layer,
        head_s=head_s,
        head_forward_s=head_forward_s,
        head_weight_s=head_weight_s,
        head_bytes=head_bytes,
        held_params=held,
        trained_params=trained,
        boundary_bytes=boundary,
    )
