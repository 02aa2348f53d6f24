"""The layout sections of a run config: its parallel degrees (``parallel:``) and MPMD submeshes (``mpmd:``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hyperjax.config.checks import check_fields, positive
from hyperjax.config.types import ContextImpl, Dispatcher, DpOverlap, FsdpUnit, Overlap, ScheduleName, TpOverlap
from hyperjax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel degrees (``parallel:``); their product is the device count."""

    data: int | None = None  # data-parallel replicas; null: the devices the other degrees leave
    fsdp: int = 1  # ZeRO-3 degree: parameters, gradients and optimizer state sharded, batch split too
    expert: int = 1  # expert parallelism: MoE experts sharded over this axis, which carries batch elsewhere
    expert_tensor: int | None = None  # experts' hidden split over: null = parallel.tensor; 1 = none (the tensor
    # axis then joins the expert axis inside MoE layers, Megatron's ETP 1; needs sequence_parallel)
    tensor: int = 1  # Megatron tensor parallelism (attention heads and MLP columns)
    sequence_parallel: bool = False  # shard the residual stream's sequence over the tensor axis
    context: int = 1  # context parallelism: the sequence sharded over an axis for attention
    context_impl: ContextImpl = "allgather"  # how keys and values reach the queries (priced): allgather or ring
    pipeline: int = 1  # pipeline stages
    virtual_stages: int = 1  # model chunks per pipeline stage (interleaved schedule when > 1)
    schedule: ScheduleName = "1f1b"  # pipeline schedule: gpipe, 1f1b, interleaved or zero-bubble
    overlap: Overlap = "none"  # MoE all-to-all behind compute: none, two-microbatch or fb-pair
    dispatcher: Dispatcher = "deepep"  # the MoE token exchange (priced): deepep, alltoall or allgather
    dispatcher_sms: int | None = None  # SMs deepep's kernels hold beside compute (priced; Megatron-Core's
    # moe_flex_dispatcher_num_sms, moe_hybridep_num_sms); null: the preset's device.comm_compute_share
    tp_overlap: TpOverlap = "none"  # tensor-parallel collectives beside products (priced): none, bulk, pipelined
    dp_overlap: DpOverlap = "backward"  # gradient reduction beside compute (priced): none, backward, full
    fsdp_unit: FsdpUnit = "tensor"  # what FSDP gathers and reduce-scatters at once (priced): tensor or layer
    fsdp_context: bool = False  # FSDP shards parameters over fsdp x context (torchtitan's dp_shard x cp)
    fsdp_reshard: bool = True  # FSDP frees a layer after its forward (priced); false: gathered once a step
    stage_devices: tuple[int, ...] | None = None  # devices per pipeline stage; null: equal stages
    stage_layers: tuple[int, ...] | None = None  # layers per chunk (model order); null: balanced by predicted time
    zero_stage: int = 0  # 1: optimizer state sharded over data; 2: gradients too
    gradient_buckets: bool | None = None  # each data-parallel replica's gradients summed in flat buffers
    # (PyTorch DDP's buckets); null: when the replicas span emulating processes

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        positive(self, "parallel", ("fsdp", "expert", "tensor", "context", "pipeline", "virtual_stages"))
        if self.stage_devices is not None and any(n < 1 for n in self.stage_devices):
            raise ConfigError(f"parallel.stage_devices={list(self.stage_devices)} must be positive integers")
        if self.stage_layers is not None and any(n < 0 for n in self.stage_layers):
            raise ConfigError(f"parallel.stage_layers={list(self.stage_layers)} must be integers >= 0")
        if self.stage_devices is not None and len(self.stage_devices) != self.pipeline:
            raise ConfigError(
                f"parallel.stage_devices={list(self.stage_devices)} names {len(self.stage_devices)} stages, but "
                f"parallel.pipeline={self.pipeline}; give one device count per stage"
            )
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise ConfigError(
                f"parallel.schedule={self.schedule!r} with parallel.virtual_stages={self.virtual_stages}: the "
                "interleaved schedule needs virtual_stages > 1, and virtual_stages > 1 needs schedule: interleaved"
            )
        positive(self, "parallel", ("data", "dispatcher_sms"), optional=True)
        if self.zero_stage not in (0, 1, 2):
            raise ConfigError(
                f"parallel.zero_stage={self.zero_stage} must be 0, 1 or 2; for stage 3 set parallel.fsdp instead"
            )

    @property
    def decode_split(self) -> tuple[str, str, str] | None:
        """The key that token-by-token generation cannot lay out, its value and the value that turns it off (each
        as ``--set`` writes it), or None: generation (``generate``, an ``rl:`` rollout) runs one SPMD program over
        one token at a time, so no pipeline, context split or sequence parallelism."""
        for key, value, off, on in (
            ("pipeline", self.pipeline, 1, self.pipeline > 1),
            ("context", self.context, 1, self.context > 1),
            ("sequence_parallel", "true", "false", self.sequence_parallel),
        ):
            if on:
                return key, str(value), str(off)
        return None


_OWN = "mpmd submeshes take their own degrees (data, fsdp, tensor), so the whole run's would be ignored"

MPMD_REPLACED: dict[str, str] = {
    "data": f"{_OWN}; set it in each mpmd.submeshes item",
    "fsdp": f"{_OWN}; set it in each mpmd.submeshes item",
    "tensor": f"{_OWN}; set it in each mpmd.submeshes item",
    "context": "mpmd submeshes have no context axis; drop it",
    "expert_tensor": "experts on an mpmd submesh split over its tensor axis; drop it",
    "stage_devices": "mpmd.submeshes gives each module its devices; drop it",
    "stage_layers": "an mpmd submesh runs a whole module; drop it",
    "virtual_stages": "an mpmd submesh runs a whole module as one chunk; drop it",
    "pipeline": "mpmd.submeshes and parallel.pipeline > 1 both split the devices; use one",
    "expert": "mpmd submeshes have no expert axis; set it to 1, or train as one program",
}
"""The ``parallel.*`` keys an MPMD run's submeshes replace, each with why and the fix: set away from its
:class:`ParallelConfig` default, the run refuses it (:func:`mpmd_replaced`); a planner's MPMD split resets it."""


def mpmd_replaced(p: ParallelConfig) -> tuple[str, object, str] | None:
    """The first key of :data:`MPMD_REPLACED` that ``p`` sets away from its default, with its value (as YAML
    writes it) and why, or None."""
    unset = ParallelConfig()
    for key, why in MPMD_REPLACED.items():
        value = getattr(p, key)
        if value != getattr(unset, key):
            return key, list(value) if isinstance(value, tuple) else value, why
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubmeshConfig:
    """One submesh of an MPMD run (an item of ``mpmd.submeshes``)."""

    name: str = ""  # a label for logs and traces
    modules: tuple[str, ...] = ()  # the model's modules that run here (vision models: encoder, language_model)
    devices: int | None = None  # devices of this submesh; null: sized by the cost model
    data: int | None = None  # data-parallel degree inside it; null: what fsdp and tensor leave
    fsdp: int = 1  # ZeRO-3 degree inside it
    tensor: int = 1  # tensor-parallel degree inside it

    def __post_init__(self) -> None:
        check_fields(self, "mpmd.submeshes[]")
        positive(self, "mpmd.submeshes[]", ("fsdp", "tensor"))
        positive(self, "mpmd.submeshes[]", ("devices", "data"), optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MPMDConfig:
    """Separate programs on separate submeshes (``mpmd:``); empty: one SPMD program (or a pipeline)."""

    submeshes: tuple[SubmeshConfig, ...] = ()  # in the order data flows through them

    def __post_init__(self) -> None:
        check_fields(self, "mpmd")
        names = [sub.name for sub in self.submeshes if sub.name]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            at = [i for i, sub in enumerate(self.submeshes) if sub.name == twice[0]]
            raise ConfigError(
                f"mpmd.submeshes items {', '.join(map(str, at))} are all named {twice[0]!r}: logs, traces and the "
                "plan tell submeshes apart by name; give each its own name"
            )


MODIFIERS: dict[str, str] = {
    "fsdp_reshard": "fsdp",
    "fsdp_unit": "fsdp",
    "fsdp_context": "context",
    "context_impl": "context",
    "tp_overlap": "tensor",
}
"""The ``parallel.*`` keys that say how a feature runs, each with the mesh axis the feature needs (FSDP's is
``fsdp``, or ``context`` under ``fsdp_context``). Set away from its :class:`ParallelConfig` default where no
stage spans that axis over more than one device, a key has nothing to act on: the resolver refuses it
(:func:`idle_modifiers`), and a planner's candidate without the feature resets it."""

TRAINING_ONLY = ("zero_stage", "dp_overlap", "tp_overlap", "fsdp_unit", "fsdp_reshard", "gradient_buckets", "overlap")
"""The ``parallel.*`` keys of training alone (the optimizer's sharding, the gradient reduction, what overlaps
the backward): generation and serving read none of them."""

FEATURES = {"fsdp": "FSDP", "context": "context parallelism", "tensor": "tensor parallelism"}
"""What each axis of :data:`MODIFIERS` carries, as an error names it."""


def stage_degrees(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> list[dict[str, int]]:
    """The ``fsdp``, ``context`` and ``tensor`` degrees of each stage: an MPMD run's submeshes' (``fsdp`` and
    ``tensor``: they have no context axis), else the whole run's (every pipeline stage has them)."""
    if submeshes:
        return [{"fsdp": s.fsdp, "tensor": s.tensor} for s in submeshes]
    return [{"fsdp": p.fsdp, "context": p.context, "tensor": p.tensor}]


def set_modifiers(p: ParallelConfig) -> dict[str, object]:
    """The keys of :data:`MODIFIERS` that ``p`` sets away from their :class:`ParallelConfig` defaults, with their
    values."""
    unset = ParallelConfig()
    return {k: getattr(p, k) for k in MODIFIERS if getattr(p, k) != getattr(unset, k)}


def idle_modifiers(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> dict[str, object]:
    """The keys of :data:`MODIFIERS` that ``p`` sets away from their defaults while no stage (of ``submeshes``
    when given) spans the axis their feature needs over more than one device, each with its value."""
    stages = stage_degrees(p, submeshes)
    over = {axis: any(d.get(axis, 1) > 1 for d in stages) for axis in FEATURES}
    over["fsdp"] = shards_weights(p, submeshes)
    return {k: v for k, v in set_modifiers(p).items() if not over[MODIFIERS[k]]}


def shards_weights(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> bool:
    """Whether some stage runs FSDP: over ``fsdp``, or ``fsdp x context`` under ``fsdp_context``."""
    if submeshes:
        return any(s.fsdp > 1 for s in submeshes)
    return p.fsdp > 1 or (p.fsdp_context and p.context > 1)


def exchanges_tokens(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> bool:
    """Whether a mixture of experts' layers send tokens between devices: its experts spread over the expert
    axis, or over the tensor axis too (``expert_tensor: 1``). An MPMD submesh holds every expert (its
    experts' hidden width splits over its tensor axis)."""
    return not submeshes and (p.expert > 1 or (p.tensor > 1 and p.expert_tensor not in (None, p.tensor)))


EXCHANGE_KEYS = ("dispatcher", "dispatcher_sms")
"""The ``parallel.*`` keys that say how a mixture of experts exchanges its tokens: where no stage exchanges
any (:func:`exchanges_tokens`), the resolver refuses them set and a planner's candidate resets them."""


def idle_exchange(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> dict[str, object]:
    """The keys of :data:`EXCHANGE_KEYS` that ``p`` sets away from their defaults while no stage exchanges
    tokens, each with its value."""
    if exchanges_tokens(p, submeshes):
        return {}
    unset = ParallelConfig()
    return {k: getattr(p, k) for k in EXCHANGE_KEYS if getattr(p, k) != getattr(unset, k)}


def without_idle_exchange(
    p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = (), keep: Sequence[str] = ()
) -> ParallelConfig:
    """``p`` with its :func:`idle_exchange` keys back at their defaults, but those in ``keep``."""
    unset = ParallelConfig()
    idle = [k for k in idle_exchange(p, submeshes) if k not in keep]
    return dataclasses.replace(p, **{k: getattr(unset, k) for k in idle}) if idle else p


def without_idle_modifiers(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> ParallelConfig:
    """``p`` with its :func:`idle_modifiers` back at their defaults (what a planner's candidate runs)."""
    unset = ParallelConfig()
    idle = idle_modifiers(p, submeshes)
    return dataclasses.replace(p, **{k: getattr(unset, k) for k in idle}) if idle else p


def modifier_value(value: object) -> object:
    """A modifier's value as YAML and ``--set`` write it (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else value


def check_modifiers(p: ParallelConfig, submeshes: Sequence[SubmeshConfig] = ()) -> None:
    """``p`` sets no key of :data:`MODIFIERS` whose feature no stage runs.

    Raises:
      ConfigError: naming the key, its value, each stage's degrees and the fix.
    """
    idle = idle_modifiers(p, submeshes)
    if not idle:
        return
    key, value = next(iter(idle.items()))
    axis = MODIFIERS[key]
    degrees = " | ".join(", ".join(f"{a} {n}" for a, n in d.items()) for d in stage_degrees(p, submeshes))
    if submeshes:
        fix = f", or give an mpmd.submeshes item {axis} > 1" if axis != "context" else " (mpmd submeshes have none)"
    else:
        fix = f", or set parallel.{axis} > 1"
        fix += " (or parallel.context > 1 with parallel.fsdp_context: true)" if axis == "fsdp" else ""
    raise ConfigError(
        f"parallel.{key}={modifier_value(value)} says how {FEATURES[axis]} runs, but no stage has it (each "
        f"stage's degrees: {degrees}); remove parallel.{key}{fix}"
    )


def check_sequence_parallel(p: ParallelConfig, key: str, tensor: int, needs: str) -> None:
    """``p.sequence_parallel`` (config key ``key``) splits over a tensor axis of ``tensor`` devices.

    Raises:
      ConfigError: sequence parallelism over a tensor axis of one device, naming ``needs`` as the fix.
    """
    if p.sequence_parallel and tensor == 1:
        raise ConfigError(f"{key}=true needs {needs} (it splits over the tensor axis)")
