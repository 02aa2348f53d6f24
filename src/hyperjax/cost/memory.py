"""A stage's memory per device as the frameworks allocate it: parameters, optimizer state, gradients and
activations (see the cost-model docs' table of mechanisms)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from hyperjax.config import Run, Stage
from hyperjax.cost.fp8 import held_bytes

if TYPE_CHECKING:
    from hyperjax.cost.stage import StageCore

FRAGMENTATION = 1.05
"""Allocator fragmentation and workspace over the counted memory terms."""


def zero_share(params: float, expert_params: float, axes: Mapping[str, int]) -> float:
    """What one device keeps of ``params`` parameters' ZeRO-sharded state (optimizer state, or gradients at
    stage 2): split over every axis the parameters are replicated on, data, context and expert (Megatron's
    distributed optimizer shards over data x context), except the routed experts' (``expert_params`` of
    them), which the expert axis already splits: theirs over data and context."""
    ways = axes["data"] * axes.get("context", 1)
    return (params - expert_params) / (ways * axes.get("expert", 1)) + expert_params / ways


def stage_memory(run: Run, stage: Stage, core: StageCore, *, in_flight: int) -> dict[str, float]:
    """Bytes per device of ``stage`` of ``run`` holding ``in_flight`` micro-batches: ``params``,
    ``optimizer``, ``gradients``, ``activations`` and ``peak`` (their sum with the allocator's share)."""
    axes = stage.axes
    e = 2 if run.dtype == "bfloat16" else 4
    trained, held = core.trained_params, core.held_params
    zero = lambda n: zero_share(n, core.expert_params, axes)
    opt_params = zero(trained) if run.zero_stage >= 1 else trained
    fsdp = axes["fsdp"]
    # FSDP materialises its unit whole: a layer's gathered parameters and the next layer's (prefetched) in
    # the compute dtype (FP8 with train.fp8.all_gather) and its full gradient in float32 before the
    # reduce-scatter (parallel.fsdp_unit: layer); or one tensor and the next, and one tensor's gradient in
    # the compute dtype (tensor)
    fp8 = run.config.train.fp8
    gathered = 1 if fp8 is not None and fp8.all_gather else e
    by_layer = run.config.parallel.fsdp_unit == "layer"
    unit = max((p.layer.params * fsdp if by_layer else p.layer.largest_param for p in core.parts), default=0.0)
    whole = unit if fsdp > 1 else 0.0
    fp8_bytes = 0.0 if fp8 is None else held_bytes(fp8, run.config.model, core.parts, fsdp)
    # float32 parameters whole; with 16-bit compute a 16-bit copy beside them, except where the float32
    # master copy is sharded: FSDP keeps float32 shards and gathers a layer in the compute dtype, and a
    # distributed optimizer (ZeRO 1 and 2, Megatron's) keeps the 16-bit weights whole and the float32
    # master with the moments, sharded over the data-parallel group: 2 + 4 + 12 / d bytes a parameter
    sharded_master = e == 2 and fsdp == 1 and run.zero_stage >= 1
    weight_bytes = 2 if sharded_master else 4 + (2 if e == 2 and fsdp == 1 else 0)
    memory = {
        "params": held * weight_bytes + whole * (2 * gathered + (4 if by_layer else e)) + fp8_bytes,
        "optimizer": opt_params * (12 if sharded_master else 8),
        "gradients": (zero(held) if run.zero_stage >= 2 else held) * 4,
        "activations": in_flight * core.kept_bytes + core.head_bytes + _halves_bytes(run, stage, core),
    }
    memory["peak"] = sum(memory.values()) * FRAGMENTATION
    return memory


def _halves_bytes(run: Run, stage: Stage, core: StageCore) -> float:
    """What ``two-microbatch`` overlap adds to a stage's memory: while one half's exchange runs the other
    half's is in flight too, so one MoE layer holds a second send and receive buffer of a half's routed
    copies (``tokens / 2 x top_k`` rows of the hidden width each); 0 for other schedules."""
    m = run.config.model
    if run.overlap != "two-microbatch" or not any(p.moe for p in core.parts):
        return 0.0
    tokens = run.rows / stage.data_parallel * m.seq_len / stage.axes["context"]
    return 2 * (tokens / 2) * m.moe.top_k * m.d_model * (2 if run.dtype == "bfloat16" else 4)
