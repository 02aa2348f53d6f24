"""Where every tensor of a tree lives under a strategy: a row per tensor and the bytes one device holds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from hyperjax.shard.metadata import LogicalAxes


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorPlacement:
    """Where one tensor lives: a row of :meth:`Strategy.explain`."""

    path: str
    shape: tuple[int, ...]
    logical_axes: LogicalAxes | None
    spec: P
    bytes_per_device: int
    bytes_total: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Explanation:
    """The placement of every tensor of a tree, and what one device holds in all."""

    rows: tuple[TensorPlacement, ...]
    mesh_shape: Mapping[str, int]

    @property
    def bytes_per_device(self) -> int:
        """Bytes one device holds for the whole tree."""
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def bytes_total(self) -> int:
        """Bytes of the whole tree, unsharded."""
        return sum(r.bytes_total for r in self.rows)

    def table(self, title: str = "placement") -> Any:
        """A ``rich.table.Table`` of the rows with a totals line."""
        from rich.table import Table

        mesh = ",".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        table = Table(title=f"{title} on mesh {mesh}")
        for col in ("tensor", "shape", "logical axes", "PartitionSpec", "bytes/device"):
            table.add_column(col, justify="right" if col == "bytes/device" else "left")
        for r in self.rows:
            axes = "-" if r.logical_axes is None else "(" + ", ".join(str(a) for a in r.logical_axes) + ")"
            spec = "(" + ", ".join(str(e) for e in r.spec) + ")"
            table.add_row(r.path, "x".join(map(str, r.shape)) or "scalar", axes, spec, f"{r.bytes_per_device:,}")
        table.add_row(
            "[bold]total[/bold]", "", "", f"{self.bytes_total:,} unsharded", f"[bold]{self.bytes_per_device:,}[/bold]"
        )
        return table


def placement(path: str, value: Any, axes: LogicalAxes | None, sharding: jax.sharding.NamedSharding) -> TensorPlacement:
    """The row of one tensor (an array or its shape) placed by ``sharding``."""
    shape = tuple(np.shape(value))
    itemsize = _itemsize(value)
    return TensorPlacement(
        path=path,
        shape=shape,
        logical_axes=axes,
        spec=sharding.spec,
        bytes_per_device=int(math.prod(sharding.shard_shape(shape))) * itemsize,
        bytes_total=int(math.prod(shape)) * itemsize,
    )


def _itemsize(value: Any) -> int:
    """Bytes per element of an array, a ``jax.ShapeDtypeStruct`` or a typed PRNG key (its key data's)."""
    dtype = getattr(value, "dtype", np.float32)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(np.shape(value), dtype))
        return data.dtype.itemsize * math.prod(data.shape[np.ndim(value) :])
    return np.dtype(dtype).itemsize
