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
from hyperjax.errors import ConfigError, HyperjaxError, ShardingError
from hyperjax.models import build_model
from hyperjax.mpmd import make_schedule
from hyperjax.mpmd.pipeline import PipelineLayout, balance_layers, layer_costs
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
      offload: the placement ``offload.policy`` gives (a :class:`hyperjax.offload.plan.OffloadPlan`);
        ``None`` under policy ``none``.
    """

    config: Config
    hardware: Hardware
    axes: dict[str, int]
    strategy: Strategy
    processes: int
    microbatches: int
    pipeline: PipelineLayout | None = None
    offload: Any = None

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
    if cfg.offload.policy != "none" and (cfg.mpmd.submeshes or p.pipeline > 1 or m.vision is not None):
        raise ConfigError(
            f"offload.policy={cfg.offload.policy!r}: training applies a placement to one SPMD program of a "
            "decoder-only model, not to a pipeline, MPMD submeshes or a vision model; set offload.policy: none "
            "(hyperjax predict prices offload for pipelines too)"
        )
    if cfg.mpmd.submeshes:
        return _plan_mpmd(cfg, hw, devices)
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
    offload = None
    if cfg.offload.policy != "none":
        from hyperjax.offload.plan import plan_offload

        resolved = dataclasses.replace(cfg, parallel=dataclasses.replace(p, data=axes["data"]))
        offload = plan_offload(resolved, hw)
        if not offload.fits:
            raise offload.error()
    return Plan(
        config=cfg,
        hardware=hw,
        axes=axes,
        strategy=strategy,
        processes=processes,
        microbatches=microbatches,
        offload=offload,
    )


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
        _check_submesh(cfg, hw, strategy, nnx.state(model), axes, f"pipeline stage {s}", t.global_batch // microbatches)
    processes = plan_processes(devices, cfg.emulate.processes)
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


def module_flops(cfg: Config) -> dict[str, float]:
    """Training FLOPs per sample of each module of a vision-language model (what sizes its submeshes)."""
    m = cfg.model
    v = m.vision
    assert v is not None
    block, _, _ = layer_costs(v.as_model())
    encoder = v.patches * (v.layers * block + 6 * v.patch_dim * v.d_model + 6 * v.d_model * m.d_model)
    lm = dataclasses.replace(m, vision=None, seq_len=m.seq_len + v.patches)
    block, _, head = layer_costs(lm)
    language = lm.seq_len * m.layers * block + m.seq_len * head
    return {"encoder": encoder, "language_model": language}


def _plan_mpmd(cfg: Config, hw: Hardware, devices: int) -> Plan:
    from hyperjax.models.vlm import MODULES

    p, t, m = cfg.parallel, cfg.train, cfg.model
    subs = cfg.mpmd.submeshes
    if m.vision is None:
        raise ConfigError("mpmd.submeshes places the modules of a vision-language model; set model.vision")
    if p.pipeline > 1:
        raise ConfigError("mpmd.submeshes and parallel.pipeline > 1 both split the devices; use one of them")
    placed = [name for sub in subs for name in sub.modules]
    for name in placed:
        if name not in MODULES:
            raise ConfigError(f"mpmd.submeshes: module {name!r} does not exist; the modules are {', '.join(MODULES)}")
    for name in MODULES:
        if placed.count(name) != 1:
            where = "no submesh" if name not in placed else f"{placed.count(name)} submeshes"
            raise ConfigError(f"mpmd.submeshes: module {name!r} is assigned to {where}; assign it to exactly one")
    if [sub.modules for sub in subs] != [(name,) for name in MODULES]:
        raise ConfigError(
            "mpmd.submeshes must list two submeshes in data-flow order, the first running [encoder], the "
            f"second [language_model]; got {[list(sub.modules) for sub in subs]}"
        )
    microbatches = t.microbatches or 2 * len(subs)
    if t.global_batch % microbatches:
        raise ConfigError(
            f"train.global_batch={t.global_batch} does not split into train.microbatches={microbatches}; "
            f"use a multiple of {microbatches}"
        )
    rows = t.global_batch // microbatches
    sizes = _submesh_sizes(cfg, devices, rows)
    stage_axes = []
    for sub, n in zip(subs, sizes, strict=True):
        try:
            stage_axes.append(mesh_axes_for(devices=n, data=sub.data, fsdp=sub.fsdp, tensor=sub.tensor))
        except ShardingError as e:
            raise ShardingError(f"mpmd submesh {sub.name or sub.modules[0]!r} ({n} devices): {e}") from None
        dp = stage_axes[-1]["data"] * sub.fsdp
        if rows % dp:
            raise ConfigError(
                f"mpmd submesh {sub.name or sub.modules[0]!r}: micro-batches of {rows} sequences "
                f"(train.global_batch / train.microbatches) do not split over its {dp} data-parallel replicas"
            )
    strategy = strategy_for(sequence_parallel=p.sequence_parallel, zero_stage=p.zero_stage, overrides=cfg.shard)
    model = nnx.eval_shape(lambda: build_model(m, dtype=t.dtype, recompute=t.recompute, seed=t.seed))
    for sub, axes, part in zip(subs, stage_axes, (model.encoder, model.language_model), strict=True):
        _check_submesh(cfg, hw, strategy, nnx.state(part), axes, f"mpmd submesh {sub.name or sub.modules[0]!r}")
    processes = plan_processes(devices, cfg.emulate.processes)
    layout = PipelineLayout(
        schedule=make_schedule(p.schedule, len(subs), microbatches, 1),
        stage_devices=tuple(sizes),
        stage_axes=tuple(stage_axes),
        chunk_layers=(m.vision.layers, m.layers),
        names=tuple(sub.name or sub.modules[0] for sub in subs),
    )
    return Plan(
        config=cfg,
        hardware=hw,
        axes=stage_axes[-1],
        strategy=strategy,
        processes=processes,
        microbatches=microbatches,
        pipeline=layout,
    )


def _submesh_sizes(cfg: Config, devices: int, rows: int) -> list[int]:
    """Devices per submesh: as configured, or (``devices: null``) balanced by predicted compute per device."""
    subs = cfg.mpmd.submeshes
    given = [sub.devices for sub in subs]
    if None not in given:
        if sum(given) != devices:
            raise ConfigError(
                f"mpmd.submeshes devices {given} sum to {sum(given)}, but there are {devices} devices "
                "(emulate.devices); make them sum to it, or set a submesh's devices: null to size it automatically"
            )
        return given
    flops = module_flops(cfg)
    work = [flops[sub.modules[0]] for sub in subs]
    best: tuple[float, list[int]] | None = None
    free = devices - sum(n for n in given if n is not None)
    open_ = [i for i, n in enumerate(given) if n is None]
    for first in range(1, free) if len(open_) == 2 else [free]:
        sizes = list(given)
        if len(open_) == 2:
            sizes[open_[0]], sizes[open_[1]] = first, free - first
        else:
            sizes[open_[0]] = free
        if any(n is None or n < 1 for n in sizes):
            continue
        ok = all(
            n % (sub.fsdp * sub.tensor) == 0 and rows % (n // sub.tensor) == 0
            for sub, n in zip(subs, sizes, strict=True)
        )
        slowest = max(w / n for w, n in zip(work, sizes, strict=True))
        if ok and (best is None or slowest < best[0]):
            best = (slowest, sizes)
    if best is None:
        raise ConfigError(
            f"mpmd: no split of the {devices} devices fits the submeshes' degrees and micro-batches of {rows} "
            "sequences; give each submesh's devices, or change train.global_batch / train.microbatches"
        )
    return best[1]


def _check_submesh(
    cfg: Config, hw: Hardware, strategy: Strategy, state: Any, axes: dict[str, int], label: str, rows: int = 0
) -> None:
    """The submesh fits the machine and the strategy places ``state`` (and, given ``rows``, the activations)."""
    axis_spans(hw, axes)
    mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
    try:
        strategy.shardings(state, mesh)
        if rows:
            _check_activations(cfg, strategy, mesh, rows)
    except ShardingError as e:
        raise ShardingError(f"{label}: {e}") from None


# what an elastic restart may change, tried in order until a plan fits the new device count; the global
# batch, the model and the optimizer stay as configured, so the run continues the same training
_ELASTIC_STEPS: tuple[tuple[str, ...], ...] = (
    ("parallel.data=null", "emulate.processes=null"),
    ("parallel.stage_devices=null",),
    ("train.micro_batch=null",),
    ("parallel.fsdp=1", "parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.context=1"),
)


def elastic_overrides(cfg_loader: Any, devices: int) -> tuple[list[str], Plan]:
    """The ``--set`` items that re-derive a run's strategy for ``devices`` devices, and the plan they give.

    Args:
      cfg_loader: ``overrides -> Config`` (the run's config file with its own ``--set`` items, then these).
      devices: the new device count.

    Raises:
      ConfigError: no strategy the steps above reach fits ``devices`` (the last reason is quoted).
    """
    sets = [f"emulate.devices={devices}"]
    reason = ""
    for step in _ELASTIC_STEPS:
        sets = [*sets, *step]
        try:
            return sets, plan_run(cfg_loader(sets))
        except HyperjaxError as e:
            reason = str(e)
    raise ConfigError(
        f"--elastic: no strategy fits {devices} devices while keeping the model and the global batch "
        f"(last reason: {reason}); give --devices a count the global batch and model divide"
    )
