"""Predict a training step on real hardware: time, memory and communication, from the configuration alone.

An analytic inventory of one transformer training step on one device (matrix multiplies, element-wise
traffic, collectives, memory terms) is priced by :mod:`hyperjax.cost.compute` and
:mod:`hyperjax.cost.collectives` and combined with the strategy's overlap and the pipeline schedule. It
answers in milliseconds for any size: thousands of devices, hundreds of billions of parameters.

Conventions (Megatron's, so published runs compare directly):
- FLOPs count attention scores over the full ``s x s`` square, and model FLOPs exclude recomputation.
- Stored activations per layer follow Korthikanti et al. (2022), ``s b h (34 + 5 a s / h)`` bytes in
  16-bit, split by tensor and sequence parallelism and cut by selective or full recomputation.
- Tensor-parallel and context-parallel collectives sit on the critical path; data-parallel gradient
  reduction overlaps the last micro-batch's backward pass; FSDP gathers overlap the previous layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.errors import ConfigError
from hyperjax.mpmd.schedules import grid_bubble, uniform_bubble
from hyperjax.shard import mesh_axes_for
from hyperjax.topology import Hardware, axis_spans
from hyperjax.train.config import Config

GIB = 2**30
PLACEMENT = ("pipeline", "data", "fsdp", "context", "tensor")  # outermost first: tensor stays in the fast tier


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """A predicted training step.

    Attributes:
      step_time_s: seconds per optimizer step.
      devices: devices in the job.
      model_flops_per_step: FLOPs of forward and backward over the global batch, recomputation excluded.
      mfu: model FLOPs utilisation, ``model_flops_per_step / (step_time_s * devices * peak)``, the peak
        the compute dtype's products run at (:meth:`Hardware.matmul_flops`: TF32's for float32 on A100/H100).
      memory_per_device_gib: ``params``, ``optimizer``, ``gradients``, ``activations`` and ``peak``.
      fits: whether ``peak`` fits the device memory.
      overflow: when it does not fit, the largest memory term.
      breakdown_s: ``compute``, ``exposed_communication``, ``pipeline_bubble``, ``recompute``,
        ``optimizer`` (they add up to ``step_time_s``).
      communication_s: every collective's total time per step, by name, exposed or not.
      details: derived sizes (micro-batches, layers per stage, mesh axes, ...).
    """

    step_time_s: float
    devices: int
    model_flops_per_step: float
    mfu: float
    memory_per_device_gib: dict[str, float]
    fits: bool
    overflow: str | None
    breakdown_s: dict[str, float]
    communication_s: dict[str, float]
    details: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (the ``hyperjax predict --json`` object)."""
        return dataclasses.asdict(self)


def predict_axes(cfg: Config) -> dict[str, int]:
    """Mesh axis sizes for prediction: the product of the degrees (``parallel.data: null`` means 1)."""
    p = cfg.parallel
    data = 1 if p.data is None else p.data
    devices = data * p.fsdp * p.context * p.tensor * p.pipeline
    axes = mesh_axes_for(
        devices=devices, data=data, fsdp=p.fsdp, context=p.context, tensor=p.tensor, pipeline=p.pipeline
    )
    return {"pipeline": p.pipeline, **axes}


def estimate(cfg: Config, hardware: Hardware) -> Estimate:
    """Predict one training step of ``cfg`` on ``hardware``.

    Raises:
      ConfigError: degrees that do not divide the model (heads, layers, batch, sequence).
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if m.vision is not None:
        raise ConfigError(
            "model.vision: predict prices decoder-only models; a vision-language model is priced module by "
            "module, as one SPMD program and as MPMD submeshes, by hyperjax.cost.mpmd (python benchmarks/mpmd.py)"
        )
    axes = predict_axes(cfg)
    ordered = {k: axes[k] for k in PLACEMENT}
    spans = _spans(hardware, tuple(ordered.items()))
    devices = math.prod(axes.values())
    tp, cp, pp, v = p.tensor, p.context, p.pipeline, p.virtual_stages
    dp = axes["data"] * p.fsdp
    _check_divisible(cfg, dp)
    e = 2 if t.dtype == "bfloat16" else 4  # activation and matmul operand bytes
    dtype = t.dtype
    if pp > 1 and t.microbatches is not None and t.micro_batch is None:
        micro = max(1, t.global_batch // (t.microbatches * dp))
    else:
        micro = t.micro_batch if t.micro_batch is not None else (1 if pp > 1 else t.global_batch // dp)
    microbatches = t.global_batch // (micro * dp)
    layers_per_chunk = math.ceil(m.layers / (pp * v))
    layers_per_stage = layers_per_chunk * v
    s, h, a, kv, hd, f, vocab = m.seq_len, m.d_model, m.heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab
    gated = m.family == "llama"
    tokens = micro * s / cp  # tokens of one micro-batch on one device
    gemm = lambda mm, nn, kk, count=1: gemm_time(
        mm,
        nn,
        kk,
        count=count,
        bytes_per_element=e,
        dtype=dtype,
        hardware=hardware,
    )

    # ---- one layer, one micro-batch, one device --------------------------------------------------------
    gemms = {
        "qkv": gemm(tokens, (a + 2 * kv) * hd / tp, h),
        "attn_out": gemm(tokens, h, a * hd / tp),
        "mlp_hidden": gemm(tokens, f * (2 if gated else 1) / tp, h) + gemm(tokens, h, f / tp),
    }
    proj = sum(gemms.values())
    core = 2 * gemm(s / cp, s, hd, count=micro * a / tp)  # scores and attention-weighted values
    sbh = micro * (s / cp) * h
    scale = e / 2  # Korthikanti's byte counts are for 16-bit activations
    replicated = 10 * sbh * scale / (tp if p.sequence_parallel else 1)
    split = 24 * sbh * scale / tp
    attn_acts = 5 * a * (s / cp) * s * micro * scale / tp
    stored_full = replicated + split + attn_acts
    ew_fwd = stream_time(2 * (replicated + split), ops=12, hardware=hardware)
    ew_core_fwd = stream_time(2 * attn_acts, ops=4, hardware=hardware)
    fwd = proj + core + ew_fwd + ew_core_fwd
    bwd = 2 * (proj + core) + 2 * (ew_fwd + ew_core_fwd)
    recompute = {"none": 0.0, "selective": core + ew_core_fwd, "full": fwd}[t.recompute]
    stored = {
        "none": stored_full,
        "selective": replicated + split,
        "full": 2 * sbh * scale / (tp if p.sequence_parallel else 1),
    }[t.recompute]

    # the activations kept for backward, by the names the models tag (Korthikanti's 34 sbh + 5 a s^2 b:
    # the block input 2, the norms and the mid-block residual 8, Q/K/V 6, the output projection's input 2,
    # the MLP's hidden 16, the attention core 5 a s / h), and what recomputing each costs: the forward ops
    # that produce or read it, so that recomputing all of them costs the whole forward (``full``) and the
    # attention core alone is ``selective``
    rep = tp if p.sequence_parallel else 1
    layer_acts = {
        "block_in": 2 * sbh * scale / rep,
        "norms": 8 * sbh * scale / rep,
        "qkv": 6 * sbh * scale / tp,
        "attn_out": 2 * sbh * scale / tp,
        "mlp_hidden": 16 * sbh * scale / tp,
        "attn_core": attn_acts,
    }
    ew_share = lambda name: ew_fwd * layer_acts[name] / (replicated + split)
    layer_recompute = {
        "norms": ew_fwd * (layer_acts["norms"] + layer_acts["block_in"]) / (replicated + split),
        **{k: g + ew_share(k) for k, g in gemms.items()},
        "attn_core": core + ew_core_fwd,
    }

    comm: dict[str, float] = {}

    def add(name: str, seconds: float) -> float:
        comm[name] = comm.get(name, 0.0) + seconds
        return seconds

    act_bytes = sbh * e
    tp_calls = 4 + (2 if t.recompute == "full" else 0)  # fwd 2, bwd 2, re-forward 2 (all-reduce or AG+RS pairs)
    tp_layer = tp_calls * collective_time("all_reduce", act_bytes, spans["tensor"], hardware)
    kv_bytes = 2 * micro * s * kv * hd * e / tp
    cp_calls = 2 + (1 if t.recompute == "full" else 0)
    cp_layer = cp_calls * collective_time("all_gather", kv_bytes, spans["context"], hardware)

    # ---- per stage, per micro-batch -------------------------------------------------------------------
    logits = 3 * gemm(tokens, vocab / tp, h) + stream_time(tokens * vocab / tp * 4 * 3, ops=6, hardware=hardware)
    fsdp_layer_params = _layer_params(cfg) / tp
    fsdp_gather = collective_time("all_gather", fsdp_layer_params * e, spans["fsdp"], hardware)
    fsdp_scatter = collective_time("reduce_scatter", fsdp_layer_params * 4, spans["fsdp"], hardware)
    layer_compute = fwd + bwd + recompute
    fsdp_exposed = max(0.0, 2 * fsdp_gather + fsdp_scatter - layer_compute)
    stage_compute = layers_per_stage * (fwd + bwd) + logits
    stage_recompute = layers_per_stage * recompute
    stage_comm = layers_per_stage * (tp_layer + cp_layer + fsdp_exposed) + (fsdp_gather if p.fsdp > 1 else 0.0)
    p2p = 0.0
    if pp > 1:
        boundary = act_bytes / (tp if p.sequence_parallel else 1)
        p2p = 2 * v * collective_time("send", boundary, spans["pipeline"], hardware)
    per_micro = stage_compute + stage_recompute + stage_comm + p2p
    add("tensor_parallel", microbatches * layers_per_stage * tp_layer)
    add("context_parallel", microbatches * layers_per_stage * cp_layer)
    add("fsdp", microbatches * layers_per_stage * (2 * fsdp_gather + fsdp_scatter))
    add("pipeline_p2p", microbatches * p2p)

    # one task of one chunk (a stage holds v chunks); exposed communication is split between F and B.
    # A split backward (zero-bubble) leaves the weight-gradient GEMMs (as many FLOPs as the forward's)
    # and the head's to W.
    half_comm = (stage_comm + p2p) / 2
    task_f = (layers_per_stage * fwd + logits / 3 + half_comm) / v
    task_b = (layers_per_stage * (bwd + recompute) + 2 * logits / 3 + half_comm) / v
    task_w = (layers_per_stage * proj + logits / 3) / v if p.schedule == "zero-bubble" else 0.0
    task_b -= task_w
    # the bubble: the schedule's own grid (the one the runtime executes) replayed with these task lengths.
    # For GPipe and 1F1B over equal stages that is the grid's own fraction, whatever the lengths; for
    # interleaved and zero-bubble only the ratios matter, rounded to three figures so the cache is shared
    idle = 0.0
    if pp > 1 and p.schedule in ("gpipe", "1f1b"):
        idle = grid_bubble(p.schedule, pp, microbatches, v)
    elif pp > 1:
        ratio = lambda x: float(f"{x / task_f:.3g}")
        idle = uniform_bubble(p.schedule, pp, microbatches, v, 1.0, ratio(task_b), ratio(task_w))
    bubble = microbatches * per_micro * idle / (1 - idle)

    # ---- data parallel, optimizer -----------------------------------------------------------------------
    total_params = count_params(cfg)
    local_params = total_params / (tp * pp)
    grad_local = local_params / p.fsdp  # parameters (and their gradients) held per device
    dp_kind = "all_reduce" if p.zero_stage == 0 else "reduce_scatter"
    dp_time = collective_time(dp_kind, grad_local * 4, spans["data"], hardware)
    if p.zero_stage >= 1:
        dp_time += collective_time("all_gather", grad_local * e, spans["data"], hardware)
    add("data_parallel", dp_time)
    last_backward = layers_per_stage * (bwd + recompute)
    dp_exposed = max(0.0, dp_time - last_backward) + dp_time / max(layers_per_stage, 1)
    opt_params = grad_local / (axes["data"] if p.zero_stage >= 1 else 1)
    optimizer = stream_time(opt_params * (30 if e == 2 else 28), ops=8, hardware=hardware)

    steady_compute = microbatches * stage_compute
    step = microbatches * per_micro + bubble + (dp_exposed if dp > 1 else 0.0) + optimizer
    breakdown = {
        "compute": steady_compute,
        "exposed_communication": microbatches * (stage_comm + p2p) + (dp_exposed if dp > 1 else 0.0),
        "pipeline_bubble": bubble,
        "recompute": microbatches * stage_recompute,
        "optimizer": optimizer,
    }

    # ---- memory -----------------------------------------------------------------------------------------
    in_flight = 1
    if pp > 1:
        # 1F1B: the first stage holds p micro-batches; interleaving adds (p - 1) / (p v) (Korthikanti 4.2.3)
        interleave = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0
        in_flight = microbatches if p.schedule == "gpipe" else min(microbatches, math.ceil(pp * interleave))
    memory = {
        "params": grad_local * (4 + (2 if e == 2 else 0)),
        "optimizer": opt_params * 8,
        "gradients": grad_local / (axes["data"] if p.zero_stage >= 2 else 1) * 4,
        "activations": in_flight * layers_per_stage * stored + tokens * vocab / tp * 4 * 2,
    }
    memory["peak"] = sum(memory.values()) * 1.05  # allocator fragmentation and workspace
    layer_params = _layer_params(cfg) / (tp * p.fsdp)
    layer = {
        # one layer on one device: its tensor groups (bytes) and its compute per micro-batch (seconds)
        "params_bytes": layer_params * (4 + (2 if e == 2 else 0)),
        "param_transfer_bytes": layer_params * e,
        "gradients_bytes": layer_params / (axes["data"] if p.zero_stage >= 2 else 1) * 4,
        "optimizer_bytes": layer_params / (axes["data"] if p.zero_stage >= 1 else 1) * 8,
        "activation_bytes": layer_acts,
        "recompute_s": layer_recompute,
        "forward_s": fwd,
        "backward_s": bwd,
    }
    fits = memory["peak"] <= hardware.device.hbm_bytes
    overflow = None if fits else max(("params", "optimizer", "gradients", "activations"), key=memory.__getitem__)

    model_flops = model_flops_per_step(cfg)
    mfu = model_flops / (step * devices * hardware.matmul_flops(dtype))
    return Estimate(
        step_time_s=step,
        devices=devices,
        model_flops_per_step=model_flops,
        mfu=mfu,
        memory_per_device_gib={k: v / GIB for k, v in memory.items()},
        fits=fits,
        overflow=overflow,
        breakdown_s=breakdown,
        communication_s=comm,
        details={
            "axes": ordered,
            "microbatches": microbatches,
            "micro_batch": micro,
            "layers_per_stage": layers_per_stage,
            "params": total_params,
            "tiers": {k: sp.tier for k, sp in spans.items()},
            # one stage, one micro-batch: what the trace draws
            "stage_forward_s": layers_per_stage * fwd + logits / 3,
            "stage_backward_s": layers_per_stage * (bwd + recompute) + 2 * logits / 3,
            "stage_comm_s": stage_comm + p2p,
            # one task of one chunk, exposed communication included: what the schedule grid is replayed with
            "task_s": {"F": task_f, "B": task_b, "W": task_w},
            "task_comm_s": half_comm / v,
            "dp_exposed_s": dp_exposed if dp > 1 else 0.0,
            "optimizer_s": optimizer,
            "schedule": p.schedule,
            "virtual_stages": v,
            "in_flight": in_flight,
            "logits_s": logits,
            "bubble_ratio": idle / (1 - idle),
            "layer": layer,
        },
    )


_SPANS: dict[tuple, dict[str, Any]] = {}


def _spans(hardware: Hardware, axes: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    # axis_spans walks every device; the planner asks for the same few meshes thousands of times
    key = (hardware.name, hardware.tiers, axes)
    if key not in _SPANS:
        _SPANS[key] = axis_spans(hardware, dict(axes))
    return _SPANS[key]


def matrix_params(cfg: Config) -> float:
    """Parameters in one block's attention and MLP matrices (what tensor parallelism splits)."""
    return cfg.model.block_matrix_params


def _layer_params(cfg: Config) -> float:
    return matrix_params(cfg) + 4 * cfg.model.d_model


def count_params(cfg: Config) -> float:
    """Parameters of the model (embeddings once when tied, as ``gpt`` ties them)."""
    m = cfg.model
    embed = m.vocab * m.d_model * (1 if m.family == "gpt" else 2) + (m.seq_len * m.d_model if m.family == "gpt" else 0)
    return m.layers * _layer_params(cfg) + embed


def model_flops_per_step(cfg: Config) -> float:
    """Forward + backward FLOPs over the global batch, recomputation excluded (Korthikanti eq. 7 for GPT)."""
    m = cfg.model
    s, h = m.seq_len, m.d_model
    per_layer = 2 * s * m.block_matrix_params + 4 * s * s * m.heads * m.head_dim
    forward = m.layers * per_layer + 2 * s * h * m.vocab
    return 3 * forward * cfg.train.global_batch


def _check_divisible(cfg: Config, dp: int) -> None:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    checks = [
        ("model.heads", m.heads, "parallel.tensor", p.tensor),
        ("model.kv_heads", m.n_kv_heads, "parallel.tensor", p.tensor),
        ("model.d_ff", m.d_ff, "parallel.tensor", p.tensor),
        ("model.seq_len", m.seq_len, "parallel.context", p.context),
        ("model.layers", m.layers, "parallel.pipeline x parallel.virtual_stages", p.pipeline * p.virtual_stages),
        ("train.global_batch", t.global_batch, "data-parallel replicas (data x fsdp)", dp),
    ]
    if t.micro_batch is not None:
        checks.append(("train.global_batch", t.global_batch, "train.micro_batch x data x fsdp", t.micro_batch * dp))
    for key, size, by, ways in checks:
        if size % ways:
            raise ConfigError(f"{key}={size} is not divisible by {by}={ways}; choose degrees that divide {size}")
