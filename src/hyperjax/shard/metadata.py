"""Logical axes read from a variable's metadata: hyperjax's ``logical_axes``, or flax's own annotation.

flax 0.12 stores every NNX sharding annotation (``nnx.with_partitioning``, ``out_sharding=``, and the
deprecated ``sharding_names=`` / ``sharding=`` keywords) under ``out_sharding``; the older keys are read for
older flax. A linen parameter carries its names in a box (``nn.with_partitioning``'s ``nn.Partitioned``,
``nn.with_logical_partitioning``'s ``nn.LogicallyPartitioned``). The names are logical axes here: a
:class:`hyperjax.Strategy`'s ``rules`` place them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
from flax.core import meta
from jax.sharding import PartitionSpec as P

from hyperjax.errors import ShardingError

LogicalAxes = tuple[str | tuple[str, ...] | None, ...]
"""One entry per dimension: a logical axis name, ``None`` (replicated) or a tuple of names."""

METADATA_KEYS = ("logical_axes", "out_sharding", "sharding_names", "sharding")
"""Variable metadata that names logical axes, in order of precedence: hyperjax's own key, then flax's."""


def metadata_axes(path: str, meta: Mapping[str, Any]) -> LogicalAxes | None:
    """The logical axes a variable's metadata names (``None`` when it carries no sharding metadata)."""
    found = {key: meta[key] for key in METADATA_KEYS if meta.get(key) is not None}
    read = {}
    for key, value in found.items():
        problem = unreadable(value)
        if problem:
            raise ShardingError(
                f"tensor {path!r}: cannot read logical axes from its sharding metadata {found}: {key} {problem}. "
                "Give one entry per dimension, each a logical axis name, None or a tuple of names, e.g. "
                "nnx.with_partitioning(init, ('embed', 'mlp')) or nnx.Param(value, out_sharding=('embed', None))"
            )
        read[key] = tuple(value)
    if len(set(read.values())) > 1:
        raise ShardingError(
            f"tensor {path!r}: its sharding metadata {found} name different logical axes; keep one of "
            f"{', '.join(found)}"
        )
    return next(iter(read.values()), None)


def unreadable(value: Any) -> str:
    """Why ``value`` is not a readable tuple of logical axes ('' when it is)."""
    if isinstance(value, str):
        return f"is the string {value!r}, not a tuple of logical axis names (one per dimension: ({value!r},))"
    if not isinstance(value, tuple | list | P):
        return f"is a {type(value).__name__}, not a tuple or PartitionSpec of logical axis names"
    for i, entry in enumerate(value):
        if entry is None or isinstance(entry, str):
            continue
        if isinstance(entry, tuple) and all(isinstance(name, str) for name in entry):
            continue
        return f"entry {i} ({entry!r}) is neither a name, None nor a tuple of names"
    return ""


def is_annotated(x: Any) -> bool:
    """Whether ``x`` is a leaf that can carry its own logical axes: an ``nnx.Variable`` or a linen box."""
    return isinstance(x, nnx.Variable | meta.Partitioned)


def leaf_value(x: Any) -> Any:
    """The array (or shape) inside an annotated leaf; any other leaf itself."""
    if isinstance(x, nnx.Variable):
        return x.get_value()
    return x.value if isinstance(x, meta.Partitioned) else x


def own_axes(path: str, x: Any) -> LogicalAxes | None:
    """The logical axes an annotated leaf names (``None`` for any other leaf, or a variable without them)."""
    if isinstance(x, nnx.Variable):
        return metadata_axes(path, x.get_metadata())
    if isinstance(x, meta.Partitioned):
        return metadata_axes(path, {"logical_axes": x.names})
    return None


def reboxed(x: Any, value: Any) -> Any:
    """``value`` in the box (variable, linen box) ``x`` is in; ``value`` itself for a bare leaf."""
    if isinstance(x, nnx.Variable):
        return x.replace(value=value)
    return x.replace_boxed(value) if isinstance(x, meta.Partitioned) else value
