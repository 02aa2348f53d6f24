"""``resolve(config)``: the one place every value a config leaves open is decided.

Devices, processes, every parallel degree, the stages with their devices and layers, the micro-batches
and the schedule are worked out here and nowhere else, and the whole run is checked on abstract shapes:
a run that resolves can be priced (``predict``, ``plan``), placed (the offload pass) and trained
(``train``), and each of them reads the same :class:`hyperjax.Run`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

from hyperjax.config import Config, ModelConfig, Run, Stage
from hyperjax.config.parallel import ParallelConfig, check_modifiers
from hyperjax.config.run import replica_axes, spans_processes, stage_replica_axes, stage_schedule, staged
from hyperjax.emulate import plan_processes
from hyperjax.errors import ConfigError, EmulationError, ShardingError, expect, integral
from hyperjax.mpmd.schedules import PAIRED, check_sizes, warm_up
from hyperjax.resolver.checks import check_idle_settings, check_preset, check_stage
from hyperjax.resolver.stages import mpmd_stages, pipeline_axes, pipeline_sizes, pipeline_stages, spmd_stage
from hyperjax.shard import check_overrides, strategy_for
from hyperjax.shard.strategy import entry_axes
from hyperjax.topology import Hardware, load_hardware
from hyperjax.topology.mesh import check_capacity

DEFAULT_DEVICES = 8
"""Devices of a run that names neither ``emulate.devices`` nor every degree: the emulated default machine."""


def device_count(cfg: Config, devices: int | None = None) -> int:
    """The devices of a run: ``devices``, else ``emulate.devices``, else what the degrees or the stages
    multiply to when they say it, else :data:`DEFAULT_DEVICES`.

    Raises:
      ConfigError: ``devices`` is not a positive integer.
    """
    if devices is not None:
        if not integral(devices) or devices < 1:
            raise ConfigError(f"devices={devices!r} must be a positive integer (--devices / emulate.devices)")
        return int(devices)  # a NumPy one too
    if cfg.emulate.devices is not None:
        return cfg.emulate.devices
    p, subs = cfg.parallel, cfg.mpmd.submeshes
    if subs and all(sub.devices is not None for sub in subs):
        return sum(sub.devices for sub in subs)
    if not subs and p.stage_devices is not None:
        return sum(p.stage_devices)
    if not subs and p.data is not None:
        return p.data * p.fsdp * p.expert * p.context * p.tensor * p.pipeline
    return DEFAULT_DEVICES


def resolve(config: Config, devices: int | None = None, *, hardware: Hardware | str | None = None) -> Run:
    """Resolve ``config`` into the run it describes.

    Args:
      config: the config as read.
      devices: the device count (``--devices``); default :func:`device_count`.
      hardware: the machine, loaded or a preset's name or path (default: ``config.hardware``'s preset).

    Raises:
      HyperjaxError: any inconsistency, naming the key or tensor, the sizes and the fix.
    """
    expect(config, Config, "resolve(config): config", "pass hyperjax.load_config(path)")
    hw = load_hardware(config.hardware if hardware is None else hardware)
    t, p = config.train, config.parallel
    check_preset(config, hw)
    n = device_count(config, devices)
    check_capacity(hw, n)
    if config.mpmd.submeshes:
        if t.micro_batch is not None:
            raise ConfigError(
                "train.micro_batch: mpmd submeshes have data-parallel degrees of their own; set "
                "train.microbatches (micro-batches per step) instead"
            )
        microbatches = t.microbatches or 2 * len(config.mpmd.submeshes)
        _check_rows(config, microbatches)
        stages = mpmd_stages(config, n, t.global_batch // microbatches)
    elif p.pipeline > 1:
        if config.model.vision is not None:  # the runtime's chunks of such a model are its encoder and its LM
            raise ConfigError(
                f"parallel.pipeline={p.pipeline} cuts a decoder's layers into stages; a vision-language model "
                "(model.vision) pipelines as its encoder and its language model on two submeshes: set "
                "mpmd.submeshes (configs/vlm-tiny-mpmd.yaml), or parallel.pipeline: 1"
            )
        sizes = pipeline_sizes(config, n)
        axes = pipeline_axes(config, sizes)
        microbatches = _microbatches(
            config, axes[0]["data"] * axes[0]["fsdp"] * axes[0]["expert"], default=2 * p.pipeline
        )
        check_sizes(p.schedule, p.pipeline, microbatches, p.virtual_stages)
        stages = pipeline_stages(config, sizes, axes)
    else:
        if p.stage_layers is not None:
            raise ConfigError(
                f"parallel.stage_layers={list(p.stage_layers)} gives each pipeline chunk its layers, but "
                "parallel.pipeline=1 runs them as one; set parallel.stage_layers=null, or parallel.pipeline > 1"
            )
        if p.virtual_stages > 1:
            raise ConfigError(
                f"parallel.virtual_stages={p.virtual_stages} interleaves pipeline chunks, but parallel.pipeline=1 "
                "runs the layers as one; set parallel.virtual_stages=1 and parallel.schedule=1f1b, or "
                "parallel.pipeline > 1"
            )
        if p.schedule != "1f1b":
            raise ConfigError(
                f"parallel.schedule={p.schedule!r} orders a pipeline's stages, but parallel.pipeline=1 runs one stage "
                "(one program, or with parallel.overlap: fb-pair its forwards and backwards paired as 1F1B pairs "
                "them); remove parallel.schedule, or set parallel.pipeline > 1"
            )
        stages = (spmd_stage(config, n),)
        microbatches = _microbatches(config, stages[0].data_parallel, default=1)
    check_modifiers(p, config.mpmd.submeshes)  # after the stages: an MPMD run's refused whole-run keys first
    check_idle_settings(config)
    rows = t.global_batch // microbatches
    dps = [s.data_parallel for s in stages]
    if rows % math.lcm(*dps):
        raise ConfigError(
            f"train.global_batch={t.global_batch} in {microbatches} micro-batches gives {rows} sequences each, "
            f"which the batch degrees (data x fsdp x expert) {dps} must divide; use a global batch that is a "
            f"multiple of {microbatches * math.lcm(*dps)}"
        )
    check_overrides(config.shard, ConfigError)
    split = _experts_split(p)
    _check_fp8_tiles(config)
    _check_stages(config, stages, rows, p.zero_stage)
    try:
        processes, limit = plan_processes(n, config.emulate.processes), None
    except EmulationError as e:
        if config.emulate.processes is not None:
            raise
        processes, limit = None, str(e)
    first = stages[0].axes
    _check_overlap(config, stages, rows, microbatches, split)
    per_chunk = staged(len(stages), p.overlap)
    buckets = _gradient_buckets(config, [s.axes for s in stages], n // (processes or 1), staged=per_chunk)
    return Run(
        config=config,
        hardware=hw,
        devices=n,
        processes=processes,
        emulation_limit=limit,
        parallel={
            **first,
            "pipeline": len(stages),
            "virtual_stages": p.virtual_stages,
            "expert_tensor": first["tensor"] if split else 1,
        },
        sequence_parallel=p.sequence_parallel,
        zero_stage=p.zero_stage,
        micro_batch=rows // stages[0].data_parallel,
        microbatches=microbatches,
        schedule=stage_schedule(len(stages), p.overlap, p.schedule),
        stages=stages,
        gradient_buckets=buckets,
        recompute=t.recompute,
        dtype=t.dtype,
        offload=config.offload.policy,
        overlap=p.overlap,
    )


def _check_fp8_tiles(config: Config) -> None:
    """Blockwise FP8 tiles an expert's hidden width inside the experts' exchange, where each device holds
    its own share of it: the share must hold whole tiles, or one device would scale a tile the others
    hold too."""
    fp8, moe, tp = config.train.fp8, config.model.moe, config.parallel.tensor
    if fp8 is None or fp8.recipe != "blockwise" or moe is None or tp == 1 or config.parallel.expert_tensor == 1:
        return
    tile = min(fp8.block, moe.d_ff)
    if moe.d_ff % tp or (moe.d_ff // tp) % tile:
        raise ConfigError(
            f"train.fp8.recipe=blockwise scales each expert's hidden width (model.moe.d_ff={moe.d_ff}) in tiles of "
            f"{tile}, but parallel.tensor={tp} splits it into {moe.d_ff / tp:g} per device; set "
            f"parallel.expert_tensor: 1 (experts over expert x tensor, with sequence parallelism) or a tensor "
            f"degree that leaves a multiple of {tile} per device"
        )


def _check_overlap(cfg: Config, stages: tuple[Stage, ...], rows: int, microbatches: int, split: bool) -> None:
    """``parallel.overlap`` can be honoured: an all-to-all to hide, and the sizes its schedule needs.

    Raises:
      ConfigError: naming the key, the sizes and the fix.
    """
    p, moe, overlap = cfg.parallel, cfg.model.moe, cfg.parallel.overlap
    if overlap == "none":
        return
    if moe is None:
        raise ConfigError(
            f"parallel.overlap={overlap!r} hides a mixture of experts' all-to-all, but the model has no MoE "
            "layers (model.moe is null); set parallel.overlap: none"
        )
    if overlap == "fb-pair" and cfg.mpmd.submeshes:
        raise ConfigError(
            "parallel.overlap='fb-pair' pairs forwards and backwards of one model's chunks, not of mpmd "
            "submeshes running different modules; set parallel.overlap: none"
        )
    exchanged = [s for s in stages if s.axes.get("expert", 1) > 1 or (not split and s.axes["tensor"] > 1)]
    if not exchanged:
        raise ConfigError(
            f"parallel.overlap={overlap!r}: with parallel.expert=1 every device holds every expert, so there is "
            "no all-to-all to hide; set parallel.expert > 1 or parallel.overlap: none"
        )
    if overlap == "two-microbatch":
        if cfg.model.vision is not None:
            raise ConfigError(
                "parallel.overlap='two-microbatch' runs a decoder's micro-batch as two halves; a vision-language "
                "model does not split its micro-batches; set parallel.overlap: none"
            )
        if moe.capacity_factor is not None:
            raise ConfigError(
                f"parallel.overlap='two-microbatch' with model.moe.capacity_factor={moe.capacity_factor}: which "
                "copies a capacity drops depends on the whole micro-batch's routing, so one half's dispatch "
                "would wait for the other half's attention; use a dropless MoE (capacity_factor: null) or "
                "parallel.overlap: none"
            )
        for s in stages:
            if (rows // s.data_parallel) % 2:
                raise ConfigError(
                    f"parallel.overlap='two-microbatch' splits each replica's micro-batch in two halves, but "
                    f"{s.name} has {rows // s.data_parallel} sequences per replica per micro-batch (train."
                    f"global_batch={cfg.train.global_batch} / {microbatches} micro-batches / {s.data_parallel} "
                    "replicas); use an even number (a larger global batch or fewer micro-batches)"
                )
    if overlap == "fb-pair":
        if len(stages) > 1 and p.schedule not in PAIRED:
            raise ConfigError(
                f"parallel.overlap='fb-pair' pairs one micro-batch's forward with another's backward in 1F1B's "
                f"steady state; it needs parallel.schedule: 1f1b or interleaved, or parallel.pipeline: 1 (got "
                f"pipeline={p.pipeline}, schedule={p.schedule!r})"
            )
        if len(stages) == 1 and cfg.model.vision is not None:  # (virtual stages need a pipeline: refused above)
            raise ConfigError(
                "parallel.overlap='fb-pair' without a pipeline pairs the forwards and backwards of one chunk, the "
                "whole model; model.vision (an encoder and a language model: two chunks) needs more; set "
                "parallel.overlap: none"
            )
        if len(stages) == 1 and microbatches < 2:
            raise ConfigError(
                f"parallel.overlap='fb-pair' without a pipeline pairs each micro-batch's forward with the previous "
                f"one's backward, but the step has {microbatches} micro-batch; set train.microbatches >= 2 (or a "
                "smaller train.micro_batch)"
            )
        if microbatches < 2 * len(stages):
            raise ConfigError(
                f"parallel.overlap='fb-pair' with {microbatches} micro-batches on {len(stages)} stages leaves the "
                f"first stage no forward to pair after its warm-up of "
                f"{warm_up(0, len(stages), p.virtual_stages, paired=True)} forwards; set "
                f"train.microbatches >= {2 * len(stages)}"
            )


def _gradient_buckets(cfg: Config, stages: Sequence[Mapping[str, int]], per_process: int, *, staged: bool) -> bool:
    """``parallel.gradient_buckets``, or when null: whether the replicas span the emulating processes (there a
    collective costs the same whatever its size, and XLA's CPU backend runs one per tensor).

    A pipeline's (or MPMD run's) stages split out their ``data`` replicas alone, as does one stage pairing its
    forwards and backwards (``staged``: it runs as a pipeline of one stage): each replica accumulates its
    own gradients over the micro-batches, and they are summed once per step rather than in every
    micro-batch's backward program.

    Raises:
      ConfigError: buckets asked for where the step has no replicas to sum.
    """
    asked = cfg.parallel.gradient_buckets
    replicas = [stage_replica_axes(a) for a in stages] if staged else [replica_axes(stages[0])]
    if asked is None:  # off where a `shard` override moves any logical axis onto or off a replica axis
        return not any(_overrides_touch(cfg, r) for r in replicas) and any(
            spans_processes(a, r, per_process) for a, r in zip(stages, replicas, strict=True)
        )
    if asked and not any(replicas):
        needs = "data > 1 on some stage" if staged else "data > 1, or expert > 1 with fsdp 1"
        if staged and len(stages) == 1:  # a stage's chunk programs split out data alone, as a pipeline's do
            needs = "data > 1 (parallel.overlap=fb-pair runs the step as a pipeline of one stage)"
        meshes = " | ".join(str(dict(a)) for a in stages)
        raise ConfigError(
            f"parallel.gradient_buckets=true needs data-parallel replicas to sum: {needs} (the mesh is {meshes}); "
            "set it to null or false"
        )
    return asked


def _overrides_touch(cfg: Config, replicas: tuple[str, ...]) -> bool:
    """Whether the config's ``shard`` overrides name ``batch`` or put any logical axis on a replica axis (the
    standard rules that :func:`hyperjax.config.run.replica_axes` assumes then may not hold)."""
    return any(logical == "batch" or set(entry_axes(target)) & set(replicas) for logical, target in cfg.shard.items())


def check_zero(run: Run, zero_stage: int) -> None:
    """``run``'s tensors placed again under ``zero_stage`` (a search prices a resolved run at another ZeRO stage
    without resolving it again), so that a ZeRO axis that divides no dimension of a tensor is refused there too.

    Raises:
      ShardingError: naming the tensor, the axis, the sizes and the fix.
    """
    if zero_stage != run.zero_stage:
        _check_stages(run.config, run.stages, run.rows, zero_stage)


def _experts_split(p: ParallelConfig) -> bool:
    """Whether an expert's hidden width splits over the tensor axis (rather than the experts spreading over it)."""
    return p.expert_tensor in (None, p.tensor) or p.tensor == 1


def _check_stages(config: Config, stages: Sequence[Stage], rows: int, zero_stage: int) -> None:
    """:func:`_check` for every stage, the stage named in the error when there are several."""
    p = config.parallel
    shard = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.shard.items()))
    for s in stages:
        try:
            _check(
                config.model,
                p.sequence_parallel,
                zero_stage,
                _experts_split(p),
                shard,
                tuple(s.axes.items()),
                s.modules,
                rows,
                p.fsdp_context,
            )
        except ShardingError as e:
            raise ShardingError(f"{s.name}: {e}" if len(stages) > 1 else str(e)) from None


@functools.lru_cache(maxsize=65536)
def _check(
    m: ModelConfig,
    sequence_parallel: bool,
    zero_stage: int,
    expert_tensor: bool,
    shard: tuple,
    axes: tuple[tuple[str, int], ...],
    modules: tuple[str, ...],
    rows: int,
    fsdp_context: bool = False,
) -> None:
    """:func:`check_stage` for one stage, remembered: a search checks the same few stages thousands of times."""
    strategy = strategy_for(
        sequence_parallel=sequence_parallel,
        zero_stage=zero_stage,
        expert_tensor=expert_tensor,
        overrides=dict(shard),
        fsdp_context=fsdp_context,
    )
    stage = Stage(name="", devices=0, first_device=0, axes=dict(axes), chunks=(), layers=(), modules=modules)
    check_stage(m, strategy, stage, rows)


def _microbatches(cfg: Config, dp: int, *, default: int) -> int:
    """Micro-batches per step from ``train.microbatches`` or ``train.micro_batch`` (per replica of ``dp``)."""
    t = cfg.train
    if t.microbatches is not None:
        if t.micro_batch is not None and t.micro_batch * dp * t.microbatches != t.global_batch:
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} x {dp} data-parallel replicas x train.microbatches="
                f"{t.microbatches} is not train.global_batch={t.global_batch}; give one of the two"
            )
        _check_rows(cfg, t.microbatches)
        return t.microbatches
    if t.micro_batch is not None:
        if t.global_batch % (t.micro_batch * dp):
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch={t.micro_batch} x "
                f"{dp} batch shards (data x fsdp x expert); choose a global batch divisible by "
                f"{t.micro_batch * dp}"
            )
        return t.global_batch // (t.micro_batch * dp)
    _check_rows(cfg, default)
    return default


def _check_rows(cfg: Config, microbatches: int) -> None:
    t = cfg.train
    if t.global_batch % microbatches:
        raise ConfigError(
            f"train.global_batch={t.global_batch} does not split into {microbatches} micro-batches "
            f"(train.microbatches, or its default); use a multiple of {microbatches} or set train.microbatches"
        )
