"""A resolved run: what a config asks for with every inferred value decided, as one frozen value.

:func:`hyperjax.resolve` builds it, once; ``predict``, ``plan``, the offload pass and ``train`` all read
it, so the run a person reads about is the run they get. Nothing here is ``null`` that a program needs:
devices and processes, every parallel degree, the micro-batches, the stages with their devices and
layers, the schedule.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hyperjax.config.sections import Config
from hyperjax.config.types import DType, ModuleName, OffloadPolicy, Overlap, Recompute, ScheduleName
from hyperjax.topology.hardware import Hardware


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One submesh of a run: the whole mesh of an SPMD run, a pipeline stage, or an MPMD module's submesh.

    Attributes:
      name: a label (``stage 0``, or an MPMD submesh's name).
      devices: devices in the submesh.
      first_device: its first device in physical order (stages are consecutive slices of that order).
      axes: its mesh axes (``data``, ``fsdp``, ``expert``, ``context``, ``tensor``), outermost first.
      chunks: the model chunks it holds, in model order (chunk ``c`` lives on stage ``c mod stages``).
      layers: the blocks of each of those chunks.
      modules: the model's modules it runs: ``("decoder",)`` for a language model alone, ``("encoder",)``,
        ``("language_model",)`` or both for a vision-language model.
    """

    name: str
    devices: int
    first_device: int
    axes: Mapping[str, int]
    chunks: tuple[int, ...]
    layers: tuple[int, ...]
    modules: tuple[ModuleName, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", MappingProxyType(dict(self.axes)))

    @property
    def data_parallel(self) -> int:
        """Ways the batch is split: ``data x fsdp x expert`` (the expert axis carries batch outside the experts)."""
        return self.axes["data"] * self.axes["fsdp"] * self.axes.get("expert", 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return {
            "name": self.name,
            "devices": self.devices,
            "first_device": self.first_device,
            "parallel": dict(self.axes),
            "chunks": list(self.chunks),
            "layers": list(self.layers),
            "modules": list(self.modules),
        }

    def describe(self) -> str:
        """``2 devices (data=2) 2+2 layers``."""
        degrees = ",".join(f"{k}={v}" for k, v in self.axes.items() if v > 1)
        devices = f"{self.devices} devices ({degrees})" if degrees else "1 device"
        return f"{devices} {'+'.join(map(str, self.layers))} {'layer' if self.layers == (1,) else 'layers'}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """A config resolved for a machine: the one answer to every question the config leaves open.

    Attributes:
      config: the config as read (model, optimizer, data and everything not resolved here).
      hardware: the machine's preset.
      devices: devices in the run.
      processes: emulating processes on this machine; ``None`` when this machine cannot emulate the run
        (``emulation_limit`` says why; ``predict`` still answers, ``train`` refuses).
      emulation_limit: why this machine cannot emulate the run, or ``None``.
      parallel: every degree by name: ``data``, ``fsdp``, ``expert``, ``context``, ``tensor`` (the first stage's),
        ``pipeline`` (stages), ``virtual_stages`` and ``expert_tensor`` (ways an expert's hidden width is split:
        ``tensor``, or 1 when the tensor axis joins the expert axis inside MoE layers).
      sequence_parallel: the residual stream's sequence split over the tensor axis.
      zero_stage: ZeRO over the data axis (1: optimizer state, 2: also gradients).
      micro_batch: sequences per micro-batch on one data-parallel replica of the first stage.
      microbatches: micro-batches per optimizer step (gradient accumulation, or the pipeline's).
      schedule: the pipeline schedule; ``None`` for a single stage (``1f1b`` where its forwards and backwards
        pair, ``parallel.overlap: fb-pair``).
      stages: the submeshes, in the order data flows through them.
      gradient_buckets: whether the training step computes each data-parallel replica's gradients apart and
        sums them in flat buffers (:attr:`replica_axes`), rather than leaving every reduction to XLA.
      overlap: how a mixture of experts' all-to-all meets compute (``parallel.overlap``; ``none`` when dense).
      recompute: activation recomputation per block.
      dtype: compute dtype.
      offload: how the placement of tensor groups is chosen (``offload.policy``).
    """

    config: Config
    hardware: Hardware
    devices: int
    processes: int | None
    emulation_limit: str | None
    parallel: Mapping[str, int]
    sequence_parallel: bool
    zero_stage: int
    micro_batch: int
    microbatches: int
    schedule: ScheduleName | None
    stages: tuple[Stage, ...]
    gradient_buckets: bool
    recompute: Recompute
    dtype: DType
    offload: OffloadPolicy
    overlap: Overlap = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "parallel", MappingProxyType(dict(self.parallel)))

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.config.train.global_batch

    @property
    def rows(self) -> int:
        """Sequences per micro-batch over all replicas."""
        return self.global_batch // self.microbatches

    @property
    def pipelined(self) -> bool:
        """Whether the run has several stages (a pipeline, or MPMD submeshes)."""
        return len(self.stages) > 1

    @property
    def staged(self) -> bool:
        """Whether the step runs as a schedule of per-chunk programs: several stages, or one stage whose
        forwards and backwards pair (``parallel.overlap: fb-pair`` with ``parallel.pipeline: 1``, as
        Megatron-Core's EP overlap runs without pipelining): see :func:`staged`."""
        return staged(len(self.stages), self.overlap)

    @property
    def exchange_share(self) -> float:
        """The share of a device's compute units a mixture of experts' dispatch and combine hold while they
        run beside compute: ``parallel.dispatcher_sms`` of ``device.compute_units``, else the preset's
        ``device.comm_compute_share``."""
        sms, device = self.config.parallel.dispatcher_sms, self.hardware.device
        return sms / device.compute_units if sms is not None else device.comm_compute_share

    @property
    def virtual_stages(self) -> int:
        """Model chunks per stage."""
        return self.parallel["virtual_stages"]

    @property
    def expert_tensor_split(self) -> bool:
        """Whether experts' hidden widths are split over the tensor axis (else experts spread over it too)."""
        return self.parallel["expert_tensor"] == self.parallel["tensor"]

    @property
    def experts_per_device(self) -> int:
        """Routed experts of an MoE layer on one device (0 for a dense model)."""
        m = self.config.model
        if m.moe is None:
            return 0
        return m.moe.experts // (self.parallel["expert"] * (1 if self.expert_tensor_split else self.parallel["tensor"]))

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes whose replicas sum their gradients in buckets (empty unless ``gradient_buckets``):
        see :func:`replica_axes`; a pipeline's stages split out ``data`` alone, where any stage has it)."""
        if not self.gradient_buckets:
            return ()
        if self.staged:
            return next(filter(None, (stage_replica_axes(s.axes) for s in self.stages)), ())
        return replica_axes(self.axes)

    @property
    def chunks(self) -> int:
        """Model chunks in all."""
        return sum(len(s.chunks) for s in self.stages)

    @property
    def axes(self) -> dict[str, int]:
        """The first stage's mesh axes (the whole mesh of an SPMD run)."""
        return dict(self.stages[0].axes)

    def chunk_layers(self) -> tuple[int, ...]:
        """Layers of every chunk, in model order."""
        layers = {c: n for s in self.stages for c, n in zip(s.chunks, s.layers, strict=True)}
        return tuple(layers[c] for c in range(len(layers)))

    def stage_of(self, chunk: int) -> Stage:
        """The stage that holds ``chunk``."""
        return next(s for s in self.stages if chunk in s.chunks)

    def to_dict(self) -> dict[str, Any]:
        """The ``"run"`` object of ``predict --json`` and ``train --plan-only --json``."""
        return {
            "hardware": self.hardware.name,
            "devices": self.devices,
            "processes": self.processes,
            "parallel": dict(self.parallel),
            "sequence_parallel": self.sequence_parallel,
            "zero_stage": self.zero_stage,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "microbatches": self.microbatches,
            "stages": [s.to_dict() for s in self.stages],
            "schedule": self.schedule,
            "gradient_buckets": self.gradient_buckets,
            "overlap": self.overlap,
            "recompute": self.recompute,
            "dtype": self.dtype,
            "offload": self.offload,
            "emulation_limit": self.emulation_limit,
        }

    def describe(self, *, serving: bool = False) -> str:
        """The strategy in one line, as ``predict`` and ``train`` print it; ``serving``: the layout alone."""
        extras = []
        if self.sequence_parallel:
            extras.append("sequence_parallel")
        if self.zero_stage and not serving:
            extras.append(f"zero_stage={self.zero_stage}")
        if self.gradient_buckets and not serving:
            extras.append("gradient buckets over " + " x ".join(self.replica_axes))
        if self.overlap != "none" and not serving:
            extras.append(f"{self.overlap} overlap")
        if self.config.model.moe is not None and not self.expert_tensor_split:
            extras.append("experts over expert x tensor")
        if not self.pipelined:
            parts = [f"{k}={v}" for k, v in self.stages[0].axes.items() if v > 1] or ["single device"]
            if self.microbatches > 1 and not serving:
                extras.append(f"{self.microbatches} micro-batches")
            return ", ".join([*parts, *extras])
        mpmd = self.stages[0].modules != ("decoder",)
        if mpmd:  # each submesh by its name
            stages = " | ".join(f"{s.name}: {s.describe()}" for s in self.stages)
        else:  # a run of like stages named once: 31 stages of 8 devices (data=4,tensor=2) 3 layers
            runs = [(d, len(list(same))) for d, same in itertools.groupby(s.describe() for s in self.stages)]
            stages = " | ".join(f"{n} stages of {d}" if n > 1 else d for d, n in runs)
        kind = "mpmd" if mpmd else "pipeline"
        if serving:
            return "; ".join([f"{kind} {stages}", *extras])
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        head = f"{kind} {stages}, {self.schedule}{v}, {self.microbatches} micro-batches"
        return "; ".join([head, *extras])


def replica_axes(axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a training step can split into replicas that sum their gradients in buckets, under the
    standard rules: the leading batch axes (``data``, ``fsdp``, ``expert``, those of size 1 skipped) that
    store no parameter, routed experts' weights excepted on ``expert`` (each replica there computes its
    own experts' gradients from every replica's tokens): ``data``, then ``expert`` unless FSDP stores
    parameters over the axis between them."""
    out = ["data"] if axes["data"] > 1 else []
    if axes.get("expert", 1) > 1 and axes["fsdp"] == 1:
        out.append("expert")
    return tuple(out)


def staged(stages: int, overlap: str) -> bool:
    """Whether a step of ``stages`` stages runs as a schedule of per-chunk programs: several stages, or one
    whose forwards and backwards pair (``parallel.overlap: fb-pair``)."""
    return stages > 1 or overlap == "fb-pair"


def stage_schedule(stages: int, overlap: str, schedule: str) -> str | None:
    """The schedule a step runs: ``parallel.schedule`` for a pipeline, ``1f1b`` for one paired stage (its
    forwards and backwards interleave as one stage's 1F1B does), none for a step of one program."""
    if not staged(stages, overlap):
        return None
    return schedule if stages > 1 else "1f1b"


def stage_replica_axes(axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a pipeline or MPMD stage splits into replicas that sum their gradients in buckets:
    ``data`` alone, where it has more than one replica (a mixture of experts keeps its exchange over
    ``expert`` inside each replica)."""
    return ("data",) if axes["data"] > 1 else ()


def spans_processes(axes: Mapping[str, int], of: tuple[str, ...], devices_per_process: int) -> bool:
    """Whether the groups along any of the mesh axes ``of`` hold devices of several processes, the mesh laid
    over the devices in order (the innermost axis fastest) and each process holding consecutive devices."""
    names = list(axes)
    return any(math.prod(axes[b] for b in names[names.index(a) :]) > devices_per_process for a in of)
