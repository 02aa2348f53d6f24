"""Arrays between submeshes and processes: device splits, hand-overs through the key-value store, sums.

Inside one process (or when both submeshes lie in it) a hand-over is ``jax.device_put`` to the receiver's
sharding. Across emulated processes, arrays go through the distributed runtime's key-value store: XLA's
own cross-process copies need equal device counts on both sides, and on CPU they matched concurrent
copies between the same devices out of order, mixing micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from hyperjax.errors import ConfigError
from hyperjax.shard import place


def split_devices(devices: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """Cut ``devices`` (in physical order) into consecutive submeshes of ``sizes``.

    Consecutive slices of the physical order stay inside a tier whenever their sizes allow it: a
    submesh of 32 devices starting at a multiple of 32 is one CloudMatrix384 node.

    Raises:
      ConfigError: sizes that are not positive or do not sum to the devices.
    """
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(f"parallel.stage_devices={list(sizes)} must be positive integers")
    if sum(sizes) != len(devices):
        raise ConfigError(
            f"parallel.stage_devices={list(sizes)} sum to {sum(sizes)}, but the mesh has {len(devices)} devices; "
            f"make them sum to {len(devices)}"
        )
    out, start = [], 0
    for n in sizes:
        out.append(list(devices[start : start + n]))
        start += n
    return out


def sum_over_processes(value: Any) -> Any:
    """The sum of ``value`` (a number or a host array) over every process (each adds what its submeshes
    report)."""
    if jax.process_count() == 1:
        return value
    total = np.sum(multihost_utils.process_allgather(np.asarray(value, np.float64)), axis=0)
    return float(total) if np.ndim(value) == 0 else total


@functools.cache
def _identity(sharding: NamedSharding) -> Any:
    return jax.jit(lambda v: v, out_shardings=sharding)


def relayout(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` laid out as ``sharding`` on the same devices (every process holding some of them calls it)."""
    return _identity(sharding)(x)


def transfer(value: Any, src: jax.sharding.Mesh, dst: NamedSharding, shape: Any, sending: bool, key: str) -> Any:
    """Move an array from mesh ``src`` to ``dst`` when the two submeshes span different processes.

    The array goes through the distributed runtime's key-value store under ``key`` (one key per
    hand-over, the same in every process because every process walks the same grid): the sending
    submesh gathers it whole and its first process publishes the bytes; each receiving process reads
    them and places its shards. XLA's own cross-process copies (``jax.device_put`` with
    ``jax_cross_host_transfer_socket_address``) need equal device counts on both sides, and on CPU
    they matched concurrent copies between the same devices out of order, mixing micro-batches.
    """
    me = jax.process_index()
    if sending:
        whole = _whole(value, src)  # every sending process takes part
        if me == min(d.process_index for d in src.devices.flat):
            _publish(key, whole)
    if me not in {d.process_index for d in dst.mesh.devices.flat}:
        return None
    return place(_fetch(key, shape), dst)


def to_process0(value: jax.Array | None, mesh: jax.sharding.Mesh, like: Any, key: str) -> np.ndarray | None:
    """The whole of ``value`` (an array on ``mesh`` shaped as ``like``; ``None`` where this process holds
    none of the mesh's devices) as a host array on process 0; ``None`` elsewhere. Every process calls it,
    in the same order.

    The processes of ``mesh`` gather it whole; if process 0 is not among them, their first one sends the
    bytes through the key-value store under ``key`` (process 0 deletes the key once read).
    """
    me = jax.process_index()
    owners = {d.process_index for d in mesh.devices.flat}
    if me in owners:
        whole = _whole(value, mesh)
        if me == 0:
            return np.asarray(whole.addressable_data(0))
        if 0 not in owners and me == min(owners):
            _publish(key, whole)
        return None
    if me != 0:
        return None
    host = _fetch(key, like).copy()
    distributed.global_state.client.key_value_delete(key)
    return host


def from_process0(value: int, key: str) -> int:
    """Process 0's ``value``, in every process (through the key-value store under ``key``; each process
    calls it once per key). One process: ``value``."""
    if jax.process_count() == 1:
        return value
    client = distributed.global_state.client
    if jax.process_index() == 0:
        client.key_value_set(key, str(value))
        return value
    return int(client.blocking_key_value_get(key, _TRANSFER_TIMEOUT_MS))


def _whole(value: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """``value`` gathered whole onto every device of ``mesh`` (every process holding some of them calls it)."""
    return relayout(value, NamedSharding(mesh, PartitionSpec()))


def _publish(key: str, whole: jax.Array) -> None:
    """Put the bytes of ``whole`` (gathered by :func:`_whole`) in the key-value store under ``key``."""
    distributed.global_state.client.key_value_set_bytes(key, np.asarray(whole.addressable_data(0)).tobytes())


def _fetch(key: str, like: Any) -> np.ndarray:
    """The array shaped as ``like`` published under ``key``, waiting for it (a read-only view of the bytes)."""
    raw = distributed.global_state.client.blocking_key_value_get_bytes(key, _TRANSFER_TIMEOUT_MS)
    return np.frombuffer(raw, dtype=like.dtype).reshape(like.shape)


_TRANSFER_TIMEOUT_MS = 600_000  # a stage may compute for minutes on an emulated supernode


def scalar(x: jax.Array) -> float:
    """A replicated scalar's value, read from this process's copy."""
    return float(x.addressable_data(0))


def forget(keys: Sequence[str]) -> None:
    """Delete hand-overs this process published to the key-value store (once every reader has them)."""
    for key in keys:
        distributed.global_state.client.key_value_delete(key)
