"""A stage's memory per device as the frameworks allocate it: parameters, optimizer state, gradients and
activations (see the cost-model docs' table of mechanisms)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hyperjax.config import ParallelConfig, Run, Stage, TrainConfig
from hyperjax.cost.fp8 import held_bytes


class StageCore(Protocol):
    """What memory reads of a :class:`hyperjax.cost.stage.StageCore` (named here to keep the import one-way)."""

    parts: Sequence[Any]
    held_params: float
    trained_params: float
    expert_params: float
    kept_bytes: float
    head_bytes: float


def zero_share(params: float, expert_params: float, axes: Mapping[str, int]) -> float:
    """What one device keeps of ``params`` parameters' ZeRO-sharded state (optimizer state, or gradients at
    stage 2): split over every axis the parameters are replicated on, data, context and expert (Megatron's
    distributed optimizer shards over data x context), except the routed experts' (``expert_params`` of
    them), which the expert axis already splits: theirs over data and context."""
    ways = axes["data"] * axes.get("context", 1)
    return (params - expert_params) / (ways * axes.get("expert", 1)) + expert_params / ways


def sharding_axes(parallel: ParallelConfig, axes: Mapping[str, int]) -> dict[str, int]:
    """``axes`` as the parameters see them: with ``parallel.fsdp_context`` FSDP shards over ``fsdp x
    context``, so ``fsdp`` stands for both (the context axis still splits the sequence)."""
    if parallel.fsdp_context:
        return dict(axes, fsdp=axes["fsdp"] * axes["context"])
    return dict(axes)


def sharding_spans(parallel: ParallelConfig, axes: Mapping[str, int], spans: Mapping[str, Any]) -> dict[str, Any]:
    """``spans`` as FSDP's collectives see them: over ``fsdp x context`` with ``parallel.fsdp_context``."""
    if parallel.fsdp_context and axes["context"] > 1:
        return dict(spans, fsdp=spans["fsdp+context"])
    return dict(spans)


def replica_axes(parallel: ParallelConfig, axes: Mapping[str, int]) -> dict[str, int]:
    """``axes`` as ZeRO and the gradient reduction see them: the axes the parameters are replicated on,
    without ``context`` where FSDP already shards over it."""
    return dict(axes, context=1) if parallel.fsdp_context else dict(axes)


def state_bytes(
    run: Run, axes: Mapping[str, int], held: float, trained: float, expert_params: float
) -> tuple[float, float, float]:
    """Bytes of ``(weights, gradients, optimizer state)`` one device keeps for ``held`` parameters (``trained``
    of them updated here, ``expert_params`` routed experts') on a stage with mesh ``axes``: float32 weights,
    with 16-bit compute a 16-bit copy beside them, except where the float32 master is sharded: FSDP keeps
    float32 shards and gathers in the compute dtype, and a distributed optimizer (ZeRO 1 and 2, Megatron's)
    keeps the 16-bit weights whole and the float32 master with both moments sharded (2 + 4 + 12 / d). The
    gradient buffer holds ``train.grad_dtype`` (Megatron's main gradients: float32; NeMo's
    ``grad_sync_dtype: bf16``: two bytes); ``train.optimizer_state`` sets the master and moments
    (:func:`optimizer_bytes`)."""
    e = 2 if run.dtype == "bfloat16" else 4
    g = grad_bytes(run.config.train)
    master, moments = optimizer_bytes(run.config.train)
    fsdp = sharding_axes(run.config.parallel, axes)["fsdp"]
    zero = lambda n: zero_share(n, expert_params, replica_axes(run.config.parallel, axes))
    lean = e == 2 and fsdp == 1  # 16-bit weights whole, the master apart (FSDP shards the master itself)
    sharded_master = lean and run.zero_stage >= 1
    unsharded = 2 + (0 if sharded_master else master)
    weights = held * (unsharded if lean else shard_weight_bytes(run.config.train))
    gradients = (zero(held) if run.zero_stage >= 2 else held) * g
    optimizer = (zero(trained) if run.zero_stage >= 1 else trained) * (moments + (master if sharded_master else 0))
    return weights, gradients, optimizer


def optimizer_bytes(train: TrainConfig) -> tuple[int, int]:
    """Bytes per parameter of ``(master copy, both moments)`` beside 16-bit weights (``train.optimizer_state``):
    a float32 master and moments (4, 8); the master's low 16 bits (2, 8); bfloat16 moments, no master (0, 4)."""
    return {"float32": (4, 8), "remainders": (2, 8), "bfloat16": (0, 4)}[train.optimizer_state]


def shard_weight_bytes(train: TrainConfig) -> int:
    """Bytes per parameter of the weights FSDP (or float32 compute) keeps, as the optimizer updates them:
    float32, or the 16-bit weights themselves where there is no master (``train.optimizer_state:
    bfloat16``)."""
    return 2 if train.dtype == "bfloat16" and optimizer_bytes(train)[0] == 0 else 4


def optimizer_traffic(run: Run) -> int:
    """HBM bytes the optimizer step moves per parameter: the gradient read, both moments read and written, and
    the weights: float32 weights read and written; with 16-bit compute the master read and written and the
    16-bit copy written, the 16-bit weights and their remainders read and written, or the 16-bit weights
    alone."""
    master, moments = optimizer_bytes(run.config.train)
    weights = 8 if run.dtype != "bfloat16" else {4: 2 * 4 + 2, 2: 2 * (2 + 2), 0: 2 * 2}[master]
    return grad_bytes(run.config.train) + 2 * moments + weights


def grad_bytes(train: TrainConfig) -> int:
    """Bytes of one gradient element as a run keeps and reduces it (``train.grad_dtype``)."""
    return 2 if train.grad_dtype == "bfloat16" else 4


def stage_memory(run: Run, stage: Stage, core: StageCore, *, in_flight: int) -> dict[str, float]:
    """Bytes per device of ``stage`` of ``run`` holding ``in_flight`` micro-batches: ``params``,
    ``optimizer``, ``gradients``, ``activations`` and ``peak`` (their sum with the allocator's share,
    ``device.allocator_overhead``)."""
    e = 2 if run.dtype == "bfloat16" else 4
    fsdp = sharding_axes(run.config.parallel, stage.axes)["fsdp"]
    weights, gradients, optimizer = state_bytes(
        run, stage.axes, core.held_params, core.trained_params, core.expert_params
    )
    # FSDP materialises its unit whole: a layer's gathered parameters and the next layer's (prefetched) in
    # the compute dtype (FP8 with train.fp8.all_gather) and its full gradient (train.grad_dtype) before the
    # reduce-scatter (parallel.fsdp_unit: layer); or one tensor and the next, and one tensor's gradient
    # (tensor). Gathered once a step (parallel.fsdp_reshard: false), every layer of the stage stays
    # gathered, and its gradients accumulate unsharded in the compute dtype until the step's reduce-scatter
    fp8 = run.config.train.fp8
    gathered = 1 if fp8 is not None and fp8.all_gather else e
    by_layer = run.config.parallel.fsdp_unit == "layer"
    whole = kept = 0.0  # a unit gathered at a time; the whole stage gathered
    if fsdp > 1 and run.config.parallel.fsdp_reshard:
        blocks = [p for p in core.parts if p.layers]  # a chunk of no block gathers none
        whole = max((p.layer.params * fsdp if by_layer else p.layer.largest_param for p in blocks), default=0.0)
    elif fsdp > 1:
        kept = sum(p.layers * p.layer.params * fsdp for p in core.parts)
    fp8_bytes = 0.0 if fp8 is None else held_bytes(fp8, run.config.model, core.parts, fsdp)
    memory = {
        "params": weights + whole * (2 * gathered + grad_bytes(run.config.train)) + kept * gathered + fp8_bytes,
        "optimizer": optimizer,
        "gradients": gradients + kept * e,
        "activations": in_flight * core.kept_bytes + core.head_bytes + _halves_bytes(run, stage, core),
    }
    memory["peak"] = sum(memory.values()) * run.hardware.device.allocator_factor
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
