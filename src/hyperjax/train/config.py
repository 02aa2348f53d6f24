"""Run configuration: YAML files under ``configs/`` parsed once, at the entry point, into frozen dataclasses.

``--set key=value`` overrides any key by its dotted name (``--set parallel.tensor=4``); values are read
as YAML (``true``, ``null``, ``3e-4``). Unknown keys (with a did-you-mean), wrong types and out-of-range
values are :class:`hyperjax.ConfigError` s that name the key. ``null`` means "infer", never ``-1``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hyperjax.errors import ConfigError
from hyperjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmulateConfig:
    """The emulated machine (``emulate:``)."""

    devices: int = 8  # CPU devices to emulate
    processes: int | None = None  # processes to emulate them in; null: the fewest that work on this machine

    def __post_init__(self) -> None:
        _positive(self, "emulate", ("devices",))
        _positive(self, "emulate", ("processes",), optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training run (``train:``)."""

    global_batch: int = 32  # sequences per optimizer step
    micro_batch: int | None = None  # sequences per micro-batch per data-parallel replica; null: no accumulation
    microbatches: int | None = None  # micro-batches per step (pipeline); null: from micro_batch, else 2 x pipeline
    steps: int = 50  # optimizer steps
    lr: float = 3e-4  # peak learning rate (AdamW)
    warmup_steps: int | None = None  # linear warm-up steps; null: a tenth of the steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW decoupled weight decay, matrices only
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # global gradient-norm clip; 0 turns it off
    dtype: str = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    recompute: str = "none"  # activation recomputation per block: none, selective or full
    seed: int = 0  # parameter initialisation and data order
    data: str = "text"  # text: the shipped corpus, byte-level; synthetic: a learnable token sequence
    checkpoint_every: int = 50  # steps between checkpoints (written only when --checkpoint-dir is given)
    keep_checkpoints: int = 3  # the newest checkpoints kept; older ones are deleted

    def __post_init__(self) -> None:
        _positive(self, "train", ("global_batch", "steps", "checkpoint_every", "keep_checkpoints"))
        _positive(self, "train", ("micro_batch", "microbatches"), optional=True)
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps={self.steps}]")
        for key in ("min_lr_ratio", "beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1 + (key == "min_lr_ratio"):
                raise ConfigError(f"train.{key}={getattr(self, key)} is out of range [0, 1]")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("train.weight_decay and train.grad_clip must be >= 0")
        _choice(self, "train", "dtype", ("float32", "bfloat16"))
        _choice(self, "train", "recompute", ("none", "selective", "full"))
        _choice(self, "train", "data", ("text", "synthetic"))

    @property
    def warmup(self) -> int:
        """Warm-up steps actually used."""
        return self.steps // 10 if self.warmup_steps is None else self.warmup_steps


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel degrees (``parallel:``); their product is the device count."""

    data: int | None = None  # data-parallel replicas; null: the devices the other degrees leave
    fsdp: int = 1  # ZeRO-3 degree: parameters, gradients and optimizer state sharded, batch split too
    tensor: int = 1  # Megatron tensor parallelism (attention heads and MLP columns)
    sequence_parallel: bool = False  # shard the residual stream's sequence over the tensor axis
    context: int = 1  # context parallelism: the sequence sharded over an axis for attention
    pipeline: int = 1  # pipeline stages
    virtual_stages: int = 1  # model chunks per pipeline stage (interleaved schedule when > 1)
    schedule: str = "1f1b"  # pipeline schedule: gpipe, 1f1b, interleaved or zero-bubble
    stage_devices: tuple[int, ...] | None = None  # devices per pipeline stage; null: equal stages
    stage_layers: tuple[int, ...] | None = None  # layers per chunk (model order); null: balanced by predicted time
    zero_stage: int = 0  # 1: optimizer state sharded over data; 2: gradients too

    def __post_init__(self) -> None:
        _positive(self, "parallel", ("fsdp", "tensor", "context", "pipeline", "virtual_stages"))
        _choice(self, "parallel", "schedule", ("gpipe", "1f1b", "interleaved", "zero-bubble"))
        for key in ("stage_devices", "stage_layers"):
            value = getattr(self, key)
            if value is not None and any(n < 1 for n in value):
                raise ConfigError(f"parallel.{key}={list(value)} must be positive integers")
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
        _positive(self, "parallel", ("data",), optional=True)
        if self.zero_stage not in (0, 1, 2):
            raise ConfigError(
                f"parallel.zero_stage={self.zero_stage} must be 0, 1 or 2; for stage 3 set parallel.fsdp instead"
            )
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError(
                "parallel.sequence_parallel=true needs parallel.tensor > 1 (it splits over the tensor axis)"
            )


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
        _positive(self, "mpmd.submeshes[]", ("fsdp", "tensor"))
        _positive(self, "mpmd.submeshes[]", ("devices", "data"), optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MPMDConfig:
    """Separate programs on separate submeshes (``mpmd:``); empty: one SPMD program (or a pipeline)."""

    submeshes: tuple[SubmeshConfig, ...] = ()  # in the order data flows through them


OFFLOAD_OPTIONS = ("device", "host", "recompute")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where each tensor group lives during a step (``offload:``; see :mod:`hyperjax.offload`)."""

    policy: str = "none"  # none: train.recompute decides; auto: the exact pass; greedy: evict by size x reuse; manual
    device_memory_gib: float | None = None  # the device-memory budget; null: the preset's HBM
    prefetch: int = 1  # layers of compute a host transfer may overlap (0: fetched when needed)
    manual: Mapping[str, str] = dataclasses.field(default_factory=dict)  # group pattern -> device|host|recompute

    def __post_init__(self) -> None:
        _choice(self, "offload", "policy", ("none", "auto", "greedy", "manual"))
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ConfigError(f"offload.device_memory_gib={self.device_memory_gib} must be > 0 (GiB per device)")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ConfigError(f"offload.prefetch={self.prefetch!r} must be an integer >= 0 (layers)")
        for pattern, option in self.manual.items():
            if option not in OFFLOAD_OPTIONS:
                raise ConfigError(f"offload.manual[{pattern!r}]={option!r} is not one of {OFFLOAD_OPTIONS}")
        if self.manual and self.policy != "manual":
            raise ConfigError(f"offload.manual is given but offload.policy={self.policy!r}; set offload.policy: manual")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run."""

    hardware: str = "cloudmatrix384"  # hardware preset name or YAML path
    emulate: EmulateConfig = dataclasses.field(default_factory=EmulateConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    shard: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # logical axis -> mesh axes overrides
    mpmd: MPMDConfig = dataclasses.field(default_factory=MPMDConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        if self.train.data == "text" and self.model.vocab < 256:
            raise ConfigError(
                f"train.data=text reads bytes (256 symbols) but model.vocab={self.model.vocab}; set model.vocab: 256 "
                "or train.data: synthetic"
            )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config and apply ``key=value`` overrides.

    Args:
      path: the YAML file (``None``: all defaults).
      overrides: ``--set`` items such as ``"parallel.tensor=4"``.

    Raises:
      ConfigError: a missing or malformed file, an unknown key, a wrong type, or an invalid value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass the path of a YAML file, "
                "such as configs/quickstart.yaml"
            )
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item)
    return build(Config, raw, "")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override to the raw mapping in place.

    Raises:
      ConfigError: the item is not ``key=value`` or the value is not valid YAML.
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r} is not KEY=VALUE; e.g. --set parallel.tensor=4")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"--set {item!r}: value {text!r} is not valid YAML") from None
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass ``cls`` from a raw mapping, checking every key and type.

    Raises:
      ConfigError: unknown keys, wrong types, or what the dataclass's own validation rejects.
    """
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            raise ConfigError(f"unknown config key {prefix}{key}{hint} Known keys here: {', '.join(fields)}")
        hint_type = hints[key]
        options = typing.get_args(hint_type) if isinstance(hint_type, types.UnionType) else ()
        nested = [o for o in options if dataclasses.is_dataclass(o)]
        items = typing.get_args(hint_type) if typing.get_origin(hint_type) is tuple else ()
        if dataclasses.is_dataclass(hint_type):
            kwargs[key] = build(hint_type, value if value is not None else {}, f"{prefix}{key}.")
        elif nested and value is not None:  # an optional section
            kwargs[key] = build(nested[0], value, f"{prefix}{key}.")
        elif items and dataclasses.is_dataclass(items[0]):  # a list of sections
            if not isinstance(value, list):
                raise ConfigError(f"{prefix}{key} must be a list of mappings, got {value!r}")
            kwargs[key] = tuple(build(items[0], v, f"{prefix}{key}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[key] = _coerce(value, hint_type, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    options = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} must not be null; give a {_name(hint)}")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if option is float and isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads 3e-4 as a string
            except ValueError:
                pass
        if option is str and isinstance(value, str):
            return value
        if option is Any or (typing.get_origin(option) in (Mapping, dict) and isinstance(value, dict)):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list | tuple):
            kind = typing.get_args(option)[0]
            if all(isinstance(x, kind) and not isinstance(x, bool) for x in value):
                return tuple(value)
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {_name(hint)}, got {type(value).__name__}")


def _name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _positive(obj: Any, section: str, keys: Sequence[str], optional: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{section}.{key}={value!r} must be a positive integer{' or null' if optional else ''}")


def _choice(obj: Any, section: str, key: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, key) not in choices:
        raise ConfigError(f"{section}.{key}={getattr(obj, key)!r} is not one of {choices}")
