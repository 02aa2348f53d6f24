"""Plan a training run before anything starts: mesh, strategy, processes, all validated on abstract shapes.

A plan is data; :func:`plan_run` needs no devices, so a bad configuration fails in milliseconds, before a
single process is spawned, with a message that names the key, the tensor and the sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from hyperjax.emulate import plan_processes
from hyperjax.errors import ConfigError, ShardingError
from hyperjax.models import build_model
from hyperjax.mpmd import make_schedule
from hyperjax.mpmd.pipeline import PipelineLayout, balance_layers
from hyperjax.shard import Strategy, mesh_axes_for, strategy_for
from hyperjax.topology import Hardware, axis_spans, load_hardware
from hyperjax.train.config import Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated training run.

    Attributes:
      config: the parsed configuration.
      hardware: the hardware preset.
      axes: mesh axis sizes, outermost first.
      strategy: the sharding strategy.
      processes: emulating processes.
      microbatches: gradient-accumulation steps per optimizer step (micro-batches of a pipeline).
      pipeline: the stages, chunks and schedule of a pipelined run (``None``: one SPMD program);
        ``axes`` are then the first stage's.
    """

    config: Config
    hardware: Hardware
    axes: dict[str, int]
    strategy: Strategy
    processes: int
    microbatches: int
    pipeline: PipelineLayout | None = None

    @property
    def devices(self) -> int:
        """Devices in the mesh (all stages of a pipeline)."""
        return sum(self.pipeline.stage_devices) if self.pipeline else math.prod(self.axes.values())

    def describe(self) -> str:
        """One line: the degrees that are not 1, sequence parallelism and ZeRO."""
        p = self.config.parallel
        parts = [f"{k}={v}" for k, v in self.axes.items() if v > 1] or ["single device"]
        if p.sequence_parallel:
            parts.append("sequence_parallel")
        if p.zero_stage:
            parts.append(f"zero_stage={p.zero_stage}")
        if self.pipeline is not None:
            extras = [x for x in parts if "=" not in x or x.startswith("zero_stage")]
            return "; ".join([self.pipeline.describe(), *extras])
        if self.microbatches > 1:
            parts.append(f"{self.microbatches} micro-batches")
        return ", ".join(parts)


def plan_run(cfg: Config, *, devices: int | None = None) -> Plan:
    """Validate ``cfg`` and derive its plan (``devices`` overrides ``emulate.devices``).

    Raises:
      HyperjaxError: any inconsistency, naming the key or tensor and the fix.
    """
    hw = load_hardware(cfg.hardware)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    devices = cfg.emulate.devices if devices is None else devices
    if p.pipeline > 1:
        return _plan_pipeline(cfg, hw, devices)
    axes = mesh_axes_for(devices=devices, data=p.data, fsdp=p.fsdp, context=p.context, tensor=p.tensor)
    axis_spans(hw, axes)  # the machine can hold this many devices
    strategy = strategy_for(sequence_parallel=p.sequence_parallel, zero_stage=p.zero_stage, overrides=cfg.shard)
    dp = axes["data"] * axes["fsdp"]
    if t.micro_batch is None:
        microbatches = 1
    elif t.global_batch % (t.micro_batch * dp):
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch={t.micro_batch} x "
            f"{dp} data-parallel replicas (data x fsdp); choose a global batch divisible by {t.micro_batch * dp}"
        )
    else:
        microbatches = t.global_batch // (t.micro_batch * dp)
    mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
    model = nnx.eval_shape(lambda: build_model(m, dtype=t.dtype, recompute=t.recompute, seed=t.seed))
    strategy.shardings(nnx.state(model), mesh)
    _check_activations(cfg, strategy, mesh, t.global_batch // microbatches)
    processes = plan_processes(devices, cfg.emulate.processes)
    return Plan(config=cfg, hardware=hw, axes=axes, strategy=strategy, processes=processes, microbatches=microbatches)


def _check_activations(cfg: Config, strategy: Strategy, mesh: Any, batch: int) -> None:
    m = cfg.model
    acts = {
        "tokens": ((batch, m.seq_len), ("batch", "seq")),
        "residual": ((batch, m.seq_len, m.d_model), ("batch", "res_seq", "act_embed")),
        "queries": ((batch, m.seq_len, m.heads, m.head_dim), ("batch", "seq", "act_heads", None)),
        "keys": ((batch, m.seq_len, m.n_kv_heads, m.head_dim), ("batch", None, "act_kv_heads", None)),
        "mlp_hidden": ((batch, m.seq_len, m.d_ff), ("batch", "seq", "act_mlp")),
        "logits": ((batch, m.seq_len, m.vocab), ("batch", "seq", "act_vocab")),
    }
    for name, (shape, logical) in acts.items():
        try:
            strategy.check(f"activation {name}", shape, logical, mesh)
        except ShardingError as e:
            raise ShardingError(f"{e} (batch per micro-batch {batch}, model.seq_len={m.seq_len})") from None


def _plan_pipeline(cfg: Config, hw: Hardware, devices: int) -> Plan:
    p, t, m = cfg.parallel, cfg.train, cfg.model
    sizes = p.stage_devices or (devices // p.pipeline,) * p.pipeline
    if p.stage_devices is None and devices % p.pipeline:
        raise ConfigError(
            f"parallel.pipeline={p.pipeline} does not divide the {devices} devices; choose a divisor or give "
            "parallel.stage_devices (one device count per stage)"
        )
    if sum(sizes) != devices:
        raise ConfigError(
            f"parallel.stage_devices={list(sizes)} sum to {sum(sizes)}, but there are {devices} devices "
            "(emulate.devices); make them sum to it"
        )
    stage_axes = []
    for s, n in enumerate(sizes):
        try:
            data = p.data if p.stage_devices is None else None
            stage_axes.append(mesh_axes_for(devices=n, data=data, fsdp=p.fsdp, context=p.context, tensor=p.tensor))
        except ShardingError as e:
            raise ShardingError(f"pipeline stage {s} ({n} devices): {e}") from None
    dps = [a["data"] * a["fsdp"] for a in stage_axes]
    if t.microbatches is not None:
        microbatches = t.microbatches
    elif t.micro_batch is not None:
        microbatches = max(1, t.global_batch // (t.micro_batch * dps[0]))
    else:
        microbatches = 2 * p.pipeline
    lcm = math.lcm(*dps)
    if t.global_batch % microbatches or (t.global_batch // microbatches) % lcm:
        raise ConfigError(
            f"train.global_batch={t.global_batch} in train.microbatches={microbatches} micro-batches gives "
            f"{t.global_batch / microbatches:g} sequences each, which the stages' data-parallel degrees {dps} "
            f"must divide; use a global batch that is a multiple of {microbatches * lcm}"
        )
    schedule = make_schedule(p.schedule, p.pipeline, microbatches, p.virtual_stages)
    chunk_devices = [sizes[c % p.pipeline] for c in range(p.pipeline * p.virtual_stages)]
    layers = balance_layers(m, chunk_devices, p.stage_layers)
    strategy = strategy_for(sequence_parallel=p.sequence_parallel, zero_stage=p.zero_stage, overrides=cfg.shard)
    model = nnx.eval_shape(lambda: build_model(m, dtype=t.dtype, recompute=t.recompute, seed=t.seed))
    for s, axes in enumerate(stage_axes):
        axis_spans(hw, axes)
        mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
        try:
            strategy.shardings(nnx.state(model), mesh)
            _check_activations(cfg, strategy, mesh, t.global_batch // microbatches)
        except ShardingError as e:
            raise ShardingError(f"pipeline stage {s}: {e}") from None
    processes = plan_processes(devices, cfg.emulate.processes)
    if processes > 1:
        raise ConfigError(
            f"a pipeline of {devices} devices needs {processes} processes here, but pipeline stages run in one "
            "process for now; use at most 256 devices (emulate.devices) with emulate.processes: 1"
        )
    layout = PipelineLayout(
        schedule=schedule, stage_devices=tuple(sizes), stage_axes=tuple(stage_axes), chunk_layers=tuple(layers)
    )
    return Plan(
        config=cfg,
        hardware=hw,
        axes=stage_axes[0],
        strategy=strategy,
        processes=processes,
        microbatches=microbatches,
        pipeline=layout,
    )
