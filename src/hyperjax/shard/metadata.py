"""Logical axes read from a variable's metadata: hyperjax's ``logical_axes``, or flax's own annotation.

flax 0.12 stores every sharding annotation (``nnx.with_partitioning``, ``out_sharding=``, and the
deprecated ``sharding_names=`` / ``sharding=`` keywords) under ``out_sharding``; the older keys are read for
older flax. The names are logical axes here: a :class:`hyperjax.Strategy`'s ``rules`` place them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
