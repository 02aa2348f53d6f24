"""Strategies composed from parallel degrees (the ``parallel:`` section of a config).

The mesh has one axis per degree, outermost first: ``data``, ``fsdp``, ``expert``, ``context``,
``tensor``; the tensor axis is innermost so it stays inside the fastest interconnect tier, and the expert
axis next to it, so the MoE all-to-all crosses as few tiers as the degrees allow. The logical rules:

| logical axis | used by | mesh axes |
|---|---|---|
| ``batch`` | activations | ``data``, ``fsdp`` and ``expert`` (all three carry batch outside the experts) |
| ``seq`` | attention and MLP activations | ``context`` |
| ``res_seq`` | residual-stream activations | ``context``, plus ``tensor`` with sequence parallelism |
| ``act_heads``, ``act_kv_heads``, ``act_mlp``, ``act_vocab`` | activations | ``tensor`` |
| ``act_embed`` | activations | replicated |
| ``embed`` | parameters | ``fsdp`` (ZeRO-3: parameters, gradients and optimizer state sharded) |
| ``heads``, ``kv_heads``, ``mlp``, ``vocab`` | parameters | ``tensor`` (Megatron column / row split) |
| ``experts`` | MoE expert weights | ``expert`` (expert parallelism; tokens reach them by all-to-all) |
| ``expert_mlp`` | an expert's hidden width | ``tensor`` (``expert_tensor: 1``: none; ``experts`` takes it) |
| ``head_dim``, ``layers`` | parameters | replicated |

``zero_stage`` 1 shards optimizer state over ``data``, ``context`` and ``expert`` (a routed expert's
over ``data`` and ``context``: ``expert`` already splits it), 2 also gradients. A ``shard:`` mapping overrides any rule.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping

import numpy as np

from hyperjax.errors import HyperjaxError, ShardingError, integral, positive_int
from hyperjax.shard.strategy import MeshAxes, Strategy, entry_axes

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
LOGICAL_AXES = (
    *("batch", "seq", "res_seq", "act_embed", "act_heads", "act_kv_heads", "act_mlp", "act_vocab"),
    *("embed", "heads", "kv_heads", "mlp", "vocab", "head_dim", "layers", "experts", "expert_mlp"),
)
"""The logical axes hyperjax's models name (the table above): what a config's ``shard:`` may map."""


def mesh_axes_for(
    *,
    devices: int,
    data: int | None = None,
    fsdp: int = 1,
    expert: int = 1,
    context: int = 1,
    tensor: int = 1,
    pipeline: int = 1,
) -> dict[str, int]:
    """Mesh axis sizes for the degrees; ``data=None`` takes the devices left over.

    Raises:
      ShardingError: a degree is not a positive integer, or the degrees do not multiply to ``devices``.
    """
    devices = positive_int(devices, "devices", ShardingError)
    degrees = {"fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor, "pipeline": pipeline}
    if data is not None:
        degrees["data"] = data
    degrees = {key: positive_int(value, f"parallel.{key}", ShardingError) for key, value in degrees.items()}
    fsdp, expert, context, tensor, pipeline = (degrees[k] for k in ("fsdp", "expert", "context", "tensor", "pipeline"))
    data = degrees.get("data")
    rest = math.prod(degrees.values())
    if data is None:
        if devices % rest:
            raise ShardingError(
                f"parallel degrees fsdp={fsdp} x expert={expert} x context={context} x tensor={tensor} x "
                f"pipeline={pipeline} = {rest} "
                f"do not divide the {devices} devices, so parallel.data cannot take the rest; choose degrees "
                f"that divide {devices}"
            )
        data = devices // rest
    elif rest != devices:
        raise ShardingError(
            f"parallel degrees data={data} x fsdp={fsdp} x expert={expert} x context={context} x tensor={tensor} x "
            f"pipeline={pipeline} = {rest}, but there are {devices} devices; make the product {devices} "
            "(or set parallel.data: null to infer it)"
        )
    return {"data": data, "fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor}


def strategy_for(
    *,
    sequence_parallel: bool = False,
    zero_stage: int = 0,
    expert_tensor: bool = True,
    overrides: Mapping[str, MeshAxes] | None = None,
    fsdp_context: bool = False,
) -> Strategy:
    """The strategy for the standard mesh axes (see the module docstring), with ``overrides`` applied.

    ``expert_tensor=False`` (``parallel.expert_tensor: 1``) keeps each expert whole and spreads the experts
    over the ``expert`` and ``tensor`` axes instead (Megatron-Core's expert tensor parallelism of 1).

    Raises:
      ShardingError: a flag that is not a bool, a ``zero_stage`` other than 0, 1 or 2, or an override that names
        a mesh axis that is not one of :data:`MESH_AXES`.
    """
    flags = {"sequence_parallel": sequence_parallel, "expert_tensor": expert_tensor, "fsdp_context": fsdp_context}
    for key, value in flags.items():
        if not isinstance(value, bool | np.bool_):
            raise ShardingError(f"strategy_for({key}={value!r}): give True or False")
    sequence_parallel, expert_tensor, fsdp_context = (bool(v) for v in flags.values())
    if not integral(zero_stage) or zero_stage not in (0, 1, 2):
        raise ShardingError(f"strategy_for(zero_stage={zero_stage!r}): give 0, 1 or 2 (for stage 3, shard over fsdp)")
    zero_stage = int(zero_stage)  # a NumPy one too
    rules: dict[str, MeshAxes] = {
        "batch": ("data", "fsdp", "expert"),
        "seq": "context",
        "res_seq": ("context", "tensor") if sequence_parallel else "context",
        "act_embed": None,
        "act_heads": "tensor",
        "act_kv_heads": "tensor",
        "act_mlp": "tensor",
        "act_vocab": "tensor",
        "embed": ("fsdp", "context") if fsdp_context else "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "head_dim": None,
        "layers": None,
        "experts": "expert" if expert_tensor else ("expert", "tensor"),
        "expert_mlp": "tensor" if expert_tensor else None,
    }
    check_overrides(overrides or {})
    for name, axes in (overrides or {}).items():
        listed = entry_axes(axes)
        unknown = [a for a in listed if a not in MESH_AXES]
        if unknown:
            raise ShardingError(
                f"shard.{name}: mesh axis {unknown[0]!r} does not exist; the mesh axes are {', '.join(MESH_AXES)}"
            )
        rules[name] = axes
    return Strategy(rules=rules, zero_stage=zero_stage, zero_axes=("data", "context", "expert"))


def check_overrides(overrides: Mapping[str, MeshAxes], error: type[HyperjaxError] = ShardingError) -> None:
    """``shard:`` overrides name logical axes of hyperjax's models, each mapped to mesh axes or null.

    Raises:
      error: naming the override, with a did-you-mean.
    """
    if not isinstance(overrides, Mapping):
        raise error(f"overrides={overrides!r} must map logical axes to mesh axes, e.g. {{'vocab': None}}")
    for name, axes in overrides.items():
        if name not in LOGICAL_AXES:
            close = difflib.get_close_matches(str(name), LOGICAL_AXES, n=1)
            raise error(
                f"shard.{name}: {name!r} is not a logical axis of the model"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" The logical axes are {', '.join(LOGICAL_AXES)}"
            )
        if axes is not None and not isinstance(axes, str | tuple | list):
            raise error(f"shard.{name}={axes!r}: give a mesh axis, a list of them, or null")
