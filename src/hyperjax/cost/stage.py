"""One stage of a run priced for one micro-batch: its chunks' tasks, its communication and its memory.

A stage holds chunks; a chunk is one or two *parts*, each a stack of equal blocks of one module with, at
the ends of the model, the embedding and the output layer: a decoder chunk is one part; a vision-language
model's encoder and language model are a part each (one chunk on MPMD submeshes, both in one chunk when
the model runs as one SPMD program).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from hyperjax.config import ModelConfig, Run, Stage
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.cost.counts import Tensor, decoder_tensors, encoder_tensors
from hyperjax.cost.layer import LayerCost, price_layer
from hyperjax.topology import AxisSpan, Hardware


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartCost:
    """A stack of equal blocks of one module on one stage, one micro-batch on one device.

    Attributes:
      module: ``decoder``, ``encoder`` or ``language_model``.
      layers: blocks in the stack.
      layer: one block.
      head_s: the output layer's forward and backward (logits and loss, or the encoder's projection);
        0 where the part does not end the module.
      head_bytes: the output layer's activations kept for the backward.
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkCost:
    """One chunk's pipeline tasks for one micro-batch, exposed communication included.

    Attributes:
      chunk: the chunk, in model order.
      forward_s: its ``F`` task.
      backward_s: its ``B`` task (the input-gradient part only when the backward is split).
      weight_s: its ``W`` task (the weight-gradient GEMMs; 0 unless the backward is split).
      comm_s: the exposed communication inside ``F`` and ``B``, half in each.
    """

    chunk: int
    forward_s: float
    backward_s: float
    weight_s: float
    comm_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage of a run: per micro-batch times, per step data-parallel and optimizer time, memory.

    Attributes:
      stage: the stage.
      parts: its parts, chunk by chunk.
      chunks: its chunks' tasks.
      compute_s: forward and backward of every part (no recomputation, no communication).
      recompute_s: recomputation.
      comm_s: exposed tensor, context and FSDP communication.
      p2p_s: point-to-point hand-overs to the neighbouring stages.
      data_parallel_s: the gradient reduction (and ZeRO gathers) over the data axis, whole.
      data_parallel_exposed_s: the part of it not hidden behind the last micro-batch's backward.
      optimizer_s: the optimizer step over the local shard.
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
    data_parallel_s: float
    data_parallel_exposed_s: float
    optimizer_s: float
    in_flight: int
    memory: Mapping[str, float]
    spans: Mapping[str, AxisSpan]

    @property
    def per_microbatch_s(self) -> float:
        """Everything the stage does for one micro-batch."""
        return self.compute_s + self.recompute_s + self.comm_s + self.p2p_s

    @property
    def layers(self) -> int:
        """Blocks on the stage."""
        return sum(p.layers for p in self.parts)

    @property
    def head_s(self) -> float:
        """The output layers on the stage."""
        return sum(p.head_s for p in self.parts)


FRAGMENTATION = 1.05
"""Allocator fragmentation and workspace over the counted memory terms."""


def part_models(m: ModelConfig, stage: Stage, chunk_index: int) -> list[tuple[str, ModelConfig, int]]:
    """``(module, block model, layers)`` of each part of chunk ``stage.chunks[chunk_index]``: the block
    model's ``seq_len`` is the tokens a sequence has there (a language model also sees the image tokens)."""
    out = []
    if "encoder" in stage.modules:
        out.append(("encoder", m.vision.as_model(m.d_model), m.vision.layers))
    if "language_model" in stage.modules:
        lm = dataclasses.replace(m, vision=None, seq_len=m.seq_len + m.vision.patches)
        out.append(("language_model", lm, m.layers))
    if "decoder" in stage.modules:
        out.append(("decoder", m, stage.layers[chunk_index]))
    return out


def _outside(tensors: list[Tensor]) -> list[Tensor]:
    return [t for t in tensors if "/blocks/" not in f"/{t.path}"]


def price_stage(run: Run, stage: Stage, spans: Mapping[str, AxisSpan], p2p: AxisSpan | None) -> StageCost:
    """Price ``stage`` of ``run`` for one micro-batch (and its share of the step's data-parallel work).

    Args:
      run: the resolved run.
      stage: one of its stages.
      spans: the tiers each of the stage's mesh axes spans.
      p2p: the tier a hand-over to a neighbouring stage crosses (``None`` for a single stage).
    """
    hw, m, axes = run.hardware, run.config.model, stage.axes
    data, fsdp = axes["data"], axes["fsdp"]
    e = 2 if run.dtype == "bfloat16" else 4
    micro = run.rows / stage.data_parallel
    last = run.chunks - 1
    parts: list[PartCost] = []
    chunk_parts: list[list[PartCost]] = []
    for i, c in enumerate(stage.chunks):
        here = []
        for module, block, layers in part_models(m, stage, i):
            layer = price_layer(
                block,
                micro=micro,
                axes=axes,
                spans=spans,
                dtype=run.dtype,
                recompute=run.recompute,
                sequence_parallel=run.sequence_parallel,
                hardware=hw,
            )
            ends = module != "decoder" or c == last
            starts = module != "decoder" or c == 0
            here.append(_part(module, block, layers, layer, m, micro, axes, run, starts=starts, ends=ends))
        chunk_parts.append(here)
        parts += here
    compute = sum(p.layers * (p.layer.forward_s + p.layer.backward_s) + p.head_s for p in parts)
    recompute = sum(p.layers * p.layer.recompute_s for p in parts)
    first_gather = parts[0].layer.fsdp_gather_s if fsdp > 1 else 0.0
    layer_comm = [
        sum(p.layers * (p.layer.tensor_comm_s + p.layer.context_comm_s + p.layer.fsdp_exposed_s) for p in ps)
        for ps in chunk_parts
    ]
    comm = sum(layer_comm) + first_gather
    hand_over = [
        2 * collective_time("send", ps[-1].boundary_bytes, p2p, hw) if p2p is not None else 0.0 for ps in chunk_parts
    ]
    p2p_s = sum(hand_over)

    split = run.schedule == "zero-bubble"
    chunks = []
    for i, (c, ps) in enumerate(zip(stage.chunks, chunk_parts, strict=True)):
        half = (layer_comm[i] + first_gather / len(stage.chunks) + hand_over[i]) / 2
        fwd = sum(p.layers * p.layer.forward_s + p.head_s / 3 for p in ps) + half
        bwd = sum(p.layers * (p.layer.backward_s + p.layer.recompute_s) + 2 * p.head_s / 3 for p in ps) + half
        weight = sum(p.layers * p.layer.weight_s + p.head_s / 3 for p in ps) if split else 0.0
        chunks.append(ChunkCost(chunk=c, forward_s=fwd, backward_s=bwd - weight, weight_s=weight, comm_s=2 * half))

    held = sum(p.layers * p.layer.params + p.held_params for p in parts)
    trained = sum(p.layers * p.layer.params + p.trained_params for p in parts)
    kind = "all_reduce" if run.zero_stage == 0 else "reduce_scatter"
    dp_time = collective_time(kind, trained * 4, spans["data"], hw)
    if run.zero_stage >= 1:
        dp_time += collective_time("all_gather", trained * e, spans["data"], hw)
    last_backward = sum(p.layers * (p.layer.backward_s + p.layer.recompute_s) for p in parts)
    layers = sum(p.layers for p in parts)
    dp_exposed = max(0.0, dp_time - last_backward) + dp_time / max(layers, 1) if stage.data_parallel > 1 else 0.0
    opt_params = trained / (data if run.zero_stage >= 1 else 1)
    optimizer = stream_time(opt_params * (30 if e == 2 else 28), ops=8, hardware=hw)

    in_flight = _in_flight(run, stage)
    memory = {
        "params": held * (4 + (2 if e == 2 else 0)),
        "optimizer": opt_params * 8,
        "gradients": held / (data if run.zero_stage >= 2 else 1) * 4,
        "activations": in_flight * sum(p.layers * p.layer.stored_bytes for p in parts)
        + sum(p.head_bytes for p in parts),
    }
    memory["peak"] = sum(memory.values()) * FRAGMENTATION
    return StageCost(
        stage=stage,
        parts=tuple(parts),
        chunks=tuple(chunks),
        compute_s=compute,
        recompute_s=recompute,
        comm_s=comm,
        p2p_s=p2p_s,
        data_parallel_s=dp_time,
        data_parallel_exposed_s=dp_exposed,
        optimizer_s=optimizer,
        in_flight=in_flight,
        memory=memory,
        spans=spans,
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
) -> PartCost:
    """A part's output layer, the parameters it holds outside its blocks and what it hands on."""
    tp, cp, fsdp = axes["tensor"], axes["context"], axes["fsdp"]
    e = 2 if run.dtype == "bfloat16" else 4
    hw = run.hardware
    tokens = micro * block.seq_len / cp
    head_s = head_bytes = 0.0
    if ends:
        vocab = block.vocab
        head_s = 3 * gemm_time(
            tokens, vocab / tp, block.d_model, bytes_per_element=e, dtype=run.dtype, hardware=hw
        ) + stream_time(tokens * vocab / tp * 4 * 3, ops=6, hardware=hw)
        head_bytes = tokens * vocab / tp * 4 * 2
    if module == "encoder":
        outside = _outside(encoder_tensors(m.vision, m.d_model, ""))
    else:
        outside = _outside(decoder_tensors(block, "", range(0)))
    held = trained = 0.0
    for t in outside:
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
        head_bytes=head_bytes,
        held_params=held,
        trained_params=trained,
        boundary_bytes=boundary,
    )


def _in_flight(run: Run, stage: Stage) -> int:
    """Micro-batches whose activations a stage holds at its peak: all of them under GPipe; under 1F1B the
    first stage holds ``p`` and each later one one fewer; interleaving adds ``(p - 1) / (p v)`` (Korthikanti
    et al., 4.2.3)."""
    p, m, v = len(run.stages), run.microbatches, run.virtual_stages
    if p == 1:
        return 1
    if run.schedule == "gpipe":
        return m
    s = run.stages.index(stage)
    interleave = 1 + (p - 1) / (p * v) if v > 1 else 1.0
    return min(m, math.ceil((p - s) * interleave))


def boundary_span(hw: Hardware, first: int, second: int) -> AxisSpan:
    """The span of a hand-over between device ``first`` and device ``second`` (the innermost tier whose
    group holds both)."""
    for tier in hw.tiers:
        if tier.group_size is None or first // tier.group_size == second // tier.group_size:
            return AxisSpan(axis="pipeline", size=2, tier=tier.name, levels=((tier.name, 2),))
    last = hw.tiers[-1]
    return AxisSpan(axis="pipeline", size=2, tier=last.name, levels=((last.name, 2),))
