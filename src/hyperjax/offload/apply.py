"""A placement applied to a training step's arrays: memory kinds per leaf, and the moves inside the step.

Parameters and optimizer state a placement puts on the host live in ``pinned_host`` shardings between
steps; the step moves them to the device where it starts and back when it ends (its output shardings).
Host gradients are moved to ``pinned_host`` after each micro-batch is accumulated. Activations go by
the models' rematerialisation policies (:func:`block_policies`).
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
from jax.sharding import NamedSharding

from hyperjax.models import BlockPolicy
from hyperjax.offload.placement import Placement

HOST, DEVICE = "pinned_host", "device"


def block_policies(placement: Placement, layers: int) -> tuple[BlockPolicy, ...]:
    """Each block's rematerialisation policy under ``placement``: activations on the device are saved, those
    on the host offloaded, the rest recomputed (``None`` where everything stays on the device)."""
    out: list[BlockPolicy] = []
    for i in range(layers):
        where = placement.block(i)
        saved = tuple(a for a, o in where.items() if o == "device")
        offloaded = tuple(a for a, o in where.items() if o == "host")
        out.append(None if len(saved) == len(where) else (saved, offloaded))
    return tuple(out)


def layer_of(path: tuple[Any, ...]) -> int | None:
    """The block index of a leaf's path (``...["blocks"][i]...``), or ``None`` outside the blocks."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
    for a, b in itertools.pairwise(keys):
        if a == "blocks" and isinstance(b, int):
            return b
        if a == "blocks" and isinstance(b, str) and b.isdigit():
            return int(b)
    return None


def place_kinds(shardings: Any, placement: Any, kind: str) -> Any:
    """``shardings`` with each leaf's memory kind set by ``placement`` for group kind ``kind``
    (``params``, ``optimizer`` or ``gradients``): ``pinned_host`` for host-placed layers."""

    def one(path: tuple[Any, ...], sharding: NamedSharding) -> NamedSharding:
        layer = layer_of(path)
        where = placement[f"layers.{layer}.{kind}"] if layer is not None else "device"
        return sharding.with_memory_kind(HOST if where == "host" else DEVICE)

    return jax.tree_util.tree_map_with_path(one, shardings)


def to_kind(tree: Any, shardings: Any, kind: str) -> Any:
    """Move every leaf of ``tree`` whose sharding is on the host to memory kind ``kind`` (inside ``jit``)."""
    space = jax.memory.Space.Host if kind == HOST else jax.memory.Space.Device  # the layout stays as it is
    return jax.tree.map(lambda x, s: jax.device_put(x, space) if s.memory_kind == HOST else x, tree, shardings)


def on_device(shardings: Any) -> Any:
    """``shardings`` with every memory kind the device's (for sharding constraints inside the step)."""
    return jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings)
