"""Check that collectives really run on an emulated mesh, and time them.

For every mesh axis, all-reduce, all-gather, reduce-scatter, all-to-all and a ring ``ppermute`` run under
``jax.shard_map`` on the live mesh; every device's result is compared with the same collective computed by
numpy on the global input. Results from all processes are combined, so every process agrees on the verdict.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax.topology.mesh import AxisSpan

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute_ring")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveCheck:
    """The outcome of one collective over one mesh axis.

    Attributes:
      collective: one of :data:`COLLECTIVES`.
      axis: the mesh axis it ran over.
      group_size: ranks per group (the axis size).
      tiers: how the axis's groups span the interconnect tiers, e.g. ``"node x8, supernode x4"``.
      bytes_per_device: the input each device contributes, in bytes.
      time_s: median wall time of one call on the emulated devices (after compilation).
      max_error: the largest absolute difference from numpy over all devices of all processes.
      ok: whether every device's result matched numpy.
    """

    collective: str
    axis: str
    group_size: int
    tiers: str
    bytes_per_device: int
    time_s: float
    max_error: float
    ok: bool


def run_selftest(
    mesh: jax.sharding.Mesh,
    spans: Mapping[str, AxisSpan],
    *,
    bytes_per_device: int = 4096,
    iters: int = 3,
    seed: int = 0,
) -> list[CollectiveCheck]:
    """Run every collective over every axis of ``mesh`` and check the results against numpy.

    Args:
      mesh: the live mesh (all processes of a multi-process job call this together).
      spans: per-axis tier spans, from :func:`hyperjax.topology.axis_spans`.
      bytes_per_device: float32 payload per device (rounded up to a whole number of chunks per rank).
      iters: timed calls per collective after the compiling one; the median is reported.
      seed: the input's random seed (the same in every process).

    Returns:
      One :class:`CollectiveCheck` per (axis, collective), combined over all processes.
    """
    rng = np.random.default_rng(seed)
    local: list[tuple[CollectiveCheck, float]] = []
    for a, axis in enumerate(mesh.axis_names):
        n = mesh.shape[axis]
        k = math.ceil(bytes_per_device / 4 / n) * n
        x = rng.standard_normal((*mesh.devices.shape, k), dtype=np.float32)
        for name in COLLECTIVES:
            body, expected = _CASES[name](x, a, axis, n)
            programs = _programs(mesh, axis, body, x, per_group=name in PER_GROUP)
            outs = [(fn(xs), where) for fn, xs, where in programs]
            jax.block_until_ready([o for o, _ in outs])
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                jax.block_until_ready([fn(xs) for fn, xs, _ in programs])
                times.append(time.perf_counter() - start)
            err = max(
                (
                    float(np.abs(np.asarray(s.data) - expected[where][s.index]).max())
                    for out, where in outs
                    for s in out.addressable_shards
                ),
                default=0.0,
            )
            tol = 1e-5 * max(1.0, float(np.abs(expected).max())) * n
            tiers = ", ".join(f"{t} x{r}" for t, r in spans[axis].levels) or "-"
            check = CollectiveCheck(
                collective=name,
                axis=axis,
                group_size=n,
                tiers=tiers,
                bytes_per_device=4 * k,
                time_s=statistics.median(times) if times else float("nan"),
                max_error=err,
                ok=err <= tol,
            )
            local.append((check, tol))
    return _combine(local)


PER_GROUP = ("ppermute_ring",)
"""Collectives run as one program per group along the axis: XLA's CPU backend runs a permute over a
communicator of every device in its program, and across processes gloo connects every pair of them (a
full mesh of 384 devices takes about 40 s to set up here); one program per group connects only the
group, as a real runtime's communicator per group does."""


def _programs(
    mesh: jax.sharding.Mesh, axis: str, body: Callable, x: np.ndarray, *, per_group: bool
) -> list[tuple[Callable, jax.Array, tuple]]:
    """The compiled programs that run ``body`` over ``axis``, each with its input and the index of the global
    array it covers: one over the whole mesh, or with ``per_group`` one per group along ``axis`` that this
    process holds devices of."""
    if not per_group:
        spec = P(*mesh.axis_names)
        xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])
        return [(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)), xs, ())]
    a = mesh.axis_names.index(axis)
    others = [i for i in range(mesh.devices.ndim) if i != a]
    me = jax.process_index()
    out = []
    for coords in np.ndindex(*(mesh.devices.shape[i] for i in others)):
        where = list(coords)
        where.insert(a, slice(None))
        devices = mesh.devices[tuple(where)]
        if not any(d.process_index == me for d in devices):
            continue
        sub = jax.sharding.Mesh(devices, (axis,), axis_types=(mesh.axis_types[a],))
        data = x[tuple(where)]
        xs = jax.make_array_from_callback(data.shape, NamedSharding(sub, P(axis)), lambda idx, data=data: data[idx])
        group = partial(_squeezed, body, pad=len(others))
        fn = jax.jit(jax.shard_map(group, mesh=sub, in_specs=P(axis), out_specs=P(axis)))
        out.append((fn, xs, tuple(where)))
    return out


def _squeezed(body: Callable, b: jax.Array, *, pad: int) -> jax.Array:
    """``body`` on a group's block ``(1, k)`` written for the whole mesh's blocks (one more leading 1 per other
    axis, which a case's collective ignores)."""
    full = b.reshape((1,) * pad + b.shape)
    return body(full).reshape(b.shape)


def _combine(local: list[tuple[CollectiveCheck, float]]) -> list[CollectiveCheck]:
    if jax.process_count() == 1:
        return [c for c, _ in local]
    from jax.experimental import multihost_utils

    errors = np.array([c.max_error for c, _ in local], dtype=np.float32)
    every = np.asarray(multihost_utils.process_allgather(errors)).reshape(jax.process_count(), -1).max(axis=0)
    combined = zip(local, every, strict=True)
    return [dataclasses.replace(c, max_error=float(e), ok=bool(e <= tol)) for (c, tol), e in combined]


Case = Callable[[np.ndarray, int, str, int], tuple[Callable, np.ndarray]]


def _all_reduce(x: np.ndarray, a: int, axis: str, n: int) -> tuple[Callable, np.ndarray]:
    return (lambda b: jax.lax.psum(b, axis)), np.broadcast_to(x.sum(axis=a, keepdims=True), x.shape)


def _all_gather(x: np.ndarray, a: int, axis: str, n: int) -> tuple[Callable, np.ndarray]:
    k = x.shape[-1]
    rest = x.shape[:a] + x.shape[a + 1 : -1]
    gathered = np.moveaxis(x, a, -2).reshape((*rest, n * k))
    expected = np.broadcast_to(np.expand_dims(gathered, a), (*x.shape[:-1], n * k))
    return (lambda b: jax.lax.all_gather(b, axis, axis=b.ndim - 1, tiled=True)), expected


def _reduce_scatter(x: np.ndarray, a: int, axis: str, n: int) -> tuple[Callable, np.ndarray]:
    k = x.shape[-1]
    rest = x.shape[:a] + x.shape[a + 1 : -1]
    total = x.sum(axis=a).reshape((*rest, n, k // n))
    expected = np.moveaxis(total, -2, a)
    return (lambda b: jax.lax.psum_scatter(b, axis, scatter_dimension=b.ndim - 1, tiled=True)), expected


def _all_to_all(x: np.ndarray, a: int, axis: str, n: int) -> tuple[Callable, np.ndarray]:
    k = x.shape[-1]
    rest = x.shape[:a] + x.shape[a + 1 : -1]
    chunks = np.moveaxis(x, a, -2).reshape((*rest, n, n, k // n))  # [..., source, chunk, :]
    received = np.swapaxes(chunks, -3, -2).reshape((*rest, n, k))  # [..., receiver, source-ordered]
    expected = np.moveaxis(received, -2, a)
    body = lambda b: jax.lax.all_to_all(b, axis, b.ndim - 1, b.ndim - 1, tiled=True)
    return body, expected


def _ppermute_ring(x: np.ndarray, a: int, axis: str, n: int) -> tuple[Callable, np.ndarray]:
    perm = [(j, (j + 1) % n) for j in range(n)]
    return (lambda b: jax.lax.ppermute(b, axis, perm)), np.roll(x, 1, axis=a)


_CASES: dict[str, Case] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "ppermute_ring": _ppermute_ring,
}
