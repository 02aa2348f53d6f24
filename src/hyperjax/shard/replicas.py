"""Gradient reduction in buckets: many per-tensor reductions over the data-parallel replicas as one.

Left to XLA's SPMD partitioner, every parameter's gradient is reduced on its own where the backward pass
makes it. XLA combines independent reductions into one instruction, but its CPU backend still runs the
combined instruction as one collective per tensor, and an emulated collective over many devices costs
about the same whatever its size (it is bound by the rounds of its algorithm, not by bytes). Real
runtimes do what this module does (PyTorch DDP's gradient buckets, Megatron-Core's contiguous gradient
buffer): each replica computes its own gradients, and they are summed in few large flat buffers.

The training step computes per-replica values under ``jax.shard_map`` over the *manual* axes (see
:class:`hyperjax.shard.constrainer.Constrainer`) and stacks them on a new leading axis, one entry per
replica that must be summed; :func:`bucket_sum` concatenates every device's local pieces that are summed
over the same axes into one buffer, sums each buffer with one collective, and cuts the result back.

Where the processes of a multi-process job each hold several replicas, a sum can run inside each process
first (``hosts``): ``psum`` over the replicas a process holds, then over the processes. On the emulated
machine a collective's cost grows with the ranks in its group, so two small groups beat one large one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hyperjax.errors import ShardingError
from hyperjax.shard.constrainer import without
from hyperjax.shard.strategy import Strategy, entry_axes, spec_entry


def manual_part(spec: P, manual: Sequence[str]) -> P:
    """The part of ``spec`` over the ``manual`` mesh axes (what a ``shard_map`` over them takes)."""
    return without(spec, tuple(a for a in axes_in(spec) if a not in manual))


def bucket_sum(
    values: Sequence[jax.Array],
    *,
    mesh: jax.sharding.Mesh,
    specs: Sequence[P],
    over: Sequence[tuple[str, ...]],
    hosts: dict[str, int] | None = None,
) -> list[jax.Array]:
    """Sum per-replica values over their replicas, one collective per group of values summed alike (over the
    same axes, in the same dtype).

    Args:
      values: arrays, each with a leading axis that stacks the replicas to sum, laid out as
        ``P(over[i], *specs[i])``.
      mesh: the mesh.
      specs: each value's ``PartitionSpec`` without the leading axis.
      over: the mesh axes each value is summed over (empty: nothing to sum; its leading axis has size 1).
      hosts: for mesh axes whose replicas span processes, how many consecutive replicas along the axis
        one process holds (see :func:`host_blocks`); those sums run inside processes first.

    Returns:
      The sums, each laid out as its spec.
    """
    if not (len(values) == len(specs) == len(over)):
        raise ValueError(f"values, specs and over differ in length: {len(values)}, {len(specs)}, {len(over)}")
    hosts = hosts or {}
    groups: dict[tuple[tuple[str, ...], np.dtype], list[int]] = {}  # one buffer per axes and dtype
    for i, axes in enumerate(over):
        groups.setdefault((tuple(axes), np.dtype(values[i].dtype)), []).append(i)

    def body(*local: jax.Array) -> tuple[jax.Array, ...]:
        out: list[jax.Array] = [x[0] for x in local]
        for (axes, _), members in groups.items():
            if not axes:
                continue
            flat = jnp.concatenate([local[i].reshape(-1) for i in members])
            for step in _rounds(axes, hosts):
                flat = jax.lax.psum(flat, step)
            offsets = np.cumsum([0] + [local[i].size for i in members])
            for i, start, end in zip(members, offsets[:-1], offsets[1:], strict=True):
                out[i] = flat[start:end].reshape(local[i].shape[1:])
        return tuple(out)

    in_specs = tuple(_split_spec(P(spec_entry(tuple(o)), *s), hosts) for o, s in zip(over, specs, strict=True))
    out_specs = tuple(_split_spec(s, hosts) for s in specs)
    split = _split_mesh(mesh, hosts)
    return list(jax.shard_map(body, mesh=split, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*values))


def check_replicas(
    strategy: Strategy, params: Any, mesh: jax.sharding.Mesh, replicas: tuple[str, ...]
) -> tuple[str, ...]:
    """``replicas`` (a run's :attr:`hyperjax.Run.replica_axes`), checked against the strategy: they must be the
    leading axes of ``batch`` (those of size 1 aside) and store no parameter, except the routed experts'
    weights over ``expert`` (a mixture of experts reaches those through its own exchange, so each replica
    along ``expert`` computes its own experts' gradients from every replica's tokens).

    Raises:
      ShardingError: a replica axis out of order or storing a parameter, naming the axis, tensor and fix.
    """
    batch = tuple(a for a in strategy.mesh_axes("batch") if mesh.shape[a] > 1)
    if batch[: len(replicas)] != replicas:
        raise ShardingError(
            f"gradient buckets over mesh axes {replicas}: they must lead the batch's mesh axes {batch}; map "
            "'batch' to them first or set parallel.gradient_buckets: false"
        )
    logical = strategy.logical_axes(params)
    shardings = strategy.shardings(params, mesh)
    for (path, sharding), axes in zip(
        jax.tree_util.tree_flatten_with_path(shardings)[0],
        jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple) or x is None),
        strict=True,
    ):
        routed = bool(axes) and axes[0] == "experts"
        stored = [a for a in replicas if a in axes_in(sharding.spec) and not (a == "expert" and routed)]
        if stored:
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ShardingError(
                f"gradient buckets over mesh axes {replicas}: tensor {name!r} "
                f"is stored over {stored[0]!r} ({sharding.spec}), so its replicas do not hold it whole; set "
                "parallel.gradient_buckets: false or store it elsewhere"
            )
    return replicas


def host_blocks(mesh: jax.sharding.Mesh, axes: Sequence[str]) -> dict[str, int]:
    """For each of ``axes`` whose groups span several processes, the consecutive replicas along it that one
    process holds, where that is the same everywhere and more than one (a sum can then run inside each
    process first); axes that stay inside a process, or whose layout is irregular, are left out."""
    found = {}
    process = np.vectorize(lambda d: d.process_index)(mesh.devices)
    for axis in axes:
        n = mesh.shape[axis]
        along = np.moveaxis(process, mesh.axis_names.index(axis), -1).reshape(-1, n)
        changes = [j for j in range(1, n) if (along[:, j] != along[:, j - 1]).any()]
        if not changes:
            continue
        block = changes[0]
        steady = n % block == 0 and changes == list(range(block, n, block))
        same = all((along[:, j] == along[:, j - j % block]).all() for j in range(n))
        if steady and same and block > 1:
            found[axis] = block
    return found


def _rounds(axes: tuple[str, ...], hosts: dict[str, int]) -> list[tuple[str, ...]]:
    """The psums that sum over ``axes``: the in-process parts first, then the rest, where ``hosts`` splits
    an axis into ``AXIS@hosts`` (across processes) and ``AXIS@local`` (inside one)."""
    local = tuple(f"{a}@local" for a in axes if a in hosts)
    if not local:
        return [axes]
    rest = tuple(f"{a}@hosts" if a in hosts else a for a in axes)
    return [local, rest]


def _split_mesh(mesh: jax.sharding.Mesh, hosts: dict[str, int]) -> jax.sharding.Mesh:
    """``mesh`` with each axis in ``hosts`` cut into ``AXIS@hosts`` x ``AXIS@local`` (the same devices in the
    same order, so arrays keep their layout)."""
    if not hosts:
        return mesh
    names, shape, types = [], [], []
    for a, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
        if a in hosts:
            names += [f"{a}@hosts", f"{a}@local"]
            shape += [mesh.shape[a] // hosts[a], hosts[a]]
            types += [kind, kind]
        else:
            names.append(a)
            shape.append(mesh.shape[a])
            types.append(kind)
    return jax.sharding.Mesh(mesh.devices.reshape(shape), tuple(names), axis_types=tuple(types))


def _split_spec(spec: P, hosts: dict[str, int]) -> P:
    if not hosts:
        return spec
    split = lambda a: (f"{a}@hosts", f"{a}@local") if a in hosts else (a,)
    return P(*(spec_entry(tuple(n for a in entry_axes(entry) for n in split(a))) for entry in spec))


def axes_in(spec: P) -> tuple[str, ...]:
    """Every mesh axis ``spec`` names, in order."""
    return tuple(a for entry in spec for a in entry_axes(entry))
