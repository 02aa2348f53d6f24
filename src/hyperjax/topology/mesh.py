"""Meshes shaped like the machine.

A mesh's axes are listed outermost first; the last axis varies fastest over the devices in physical
order, so inner axes stay inside the fastest interconnect tier. :func:`axis_spans` reports, for every mesh
axis, how its device groups spread over the tiers: the cost model prices a collective over an axis from
exactly this decomposition (for example 8 ranks on the node tier times 4 on the supernode tier).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hyperjax.errors import MeshError, positive_int
from hyperjax.topology.hardware import Hardware, load_hardware

if TYPE_CHECKING:
    import jax

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AxisSpan:
    """How the device groups of one mesh axis spread over the interconnect tiers.

    Attributes:
      axis: the mesh axis name.
      size: ranks in one group (the axis size).
      tier: the slowest tier any group crosses (the innermost tier when ``size`` is 1).
      levels: ``(tier name, ranks)`` pairs, innermost first: a group holds ``ranks`` devices (or lower-tier
        blocks) joined by that tier. The ranks multiply to ``size`` when the axis aligns with the tier
        boundaries; a group straddling a boundary rounds up (3 devices split 2 + 1 over two nodes give
        ``(node, 2), (network, 2)``). Tiers contributing 1 are left out.
      torus: on a torus tier (``Tier.torus_dims``), ``(ranks, wraps)`` of each torus dimension the group
        spans: its ranks along it, and whether they close a ring (the whole dimension, with wraparound);
        empty elsewhere.
    """

    axis: str
    size: int
    tier: str
    levels: tuple[tuple[str, int], ...]
    torus: tuple[tuple[int, bool], ...] = ()


def parse_axes(text: str) -> dict[str, int]:
    """Parse ``"data=12,tensor=32"`` into ``{"data": 12, "tensor": 32}`` (outermost axis first).

    Raises:
      MeshError: the text is malformed, a name repeats, or a size is not a positive integer.
    """
    axes: dict[str, int] = {}
    example = "expected NAME=SIZE pairs separated by commas, e.g. --axes data=12,tensor=32"
    if not isinstance(text, str):
        raise MeshError(f"parse_axes(text): text is {text!r}, not a str; {example} (a mapping is parsed already)")
    for item in text.split(","):
        name, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not name or not size:
            raise MeshError(f"malformed mesh axes {text!r}: item {item!r} is not NAME=SIZE; {example}")
        if not _AXIS_NAME.match(name):
            raise MeshError(f"malformed mesh axes {text!r}: axis name {name!r} is not an identifier; {example}")
        if name in axes:
            raise MeshError(f"malformed mesh axes {text!r}: axis {name!r} appears twice; give each axis once")
        if not re.fullmatch(r"[+-]?[0-9]+", size):  # int() would take 1_0 and other scripts' digits
            raise MeshError(f"malformed mesh axes {text!r}: size {size!r} of axis {name!r} is not an integer")
        axes[name] = int(size)
    check_axes(axes)
    return axes


def check_axes(axes: Mapping[str, int], devices: int | None = None) -> None:
    """Check mesh axis sizes: positive integers whose product is ``devices`` (when given).

    Raises:
      MeshError: an axis size is not a positive integer, or the product differs from ``devices``.
    """
    if isinstance(axes, str):
        raise MeshError(f"mesh axes {axes!r} are text; read them with hyperjax.parse_axes({axes!r})")
    if not isinstance(axes, Mapping):
        raise MeshError(f"mesh axes {axes!r} must be a mapping of axis name to size, e.g. {{'data': 2, 'tensor': 4}}")
    if not axes:
        raise MeshError("mesh axes are empty; give at least one axis, e.g. {'data': 8}")
    for name, size in axes.items():
        if not isinstance(name, str) or not _AXIS_NAME.match(name):
            raise MeshError(f"mesh axis name {name!r} is not an identifier; name axes like 'data' or 'tensor'")
        if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
            raise MeshError(f"mesh axis {name!r} has size {size!r}; axis sizes must be positive integers")
    product = math.prod(axes.values())
    if devices is not None and product != devices:
        raise MeshError(
            f"mesh axes {dict(axes)} multiply to {product} devices but {devices} devices are in use; "
            f"choose sizes whose product is {devices} (or set the device count to {product})"
        )


def default_axes(hardware: Hardware | str | Path, devices: int) -> dict[str, int]:
    """The mesh axes a command uses when given none.

    The preset's own ``default_axes`` when ``devices`` is the preset's device count; otherwise a
    ``tensor`` axis filling the innermost tier as far as ``devices`` allows and a ``data`` axis outside it.

    Raises:
      MeshError: ``devices`` is not a positive integer.
    """
    hardware = load_hardware(hardware)
    devices = positive_int(devices, "devices", MeshError)
    if devices == hardware.devices:
        return dict(hardware.default_axes)
    inner = math.gcd(devices, hardware.tiers[0].group_size or devices)
    return {"data": devices // inner, "tensor": inner}


def axis_spans(
    hardware: Hardware | str | Path, axes: Mapping[str, int], *, groups: Mapping[str, Sequence[str]] | None = None
) -> dict[str, AxisSpan]:
    """Report, for every mesh axis, which tiers its device groups span.

    Device ``i`` in physical order sits in group ``i // tier.group_size`` of each tier; the mesh places
    devices in that order with the last axis fastest (as :func:`make_mesh` does).

    Args:
      hardware: the machine (a :class:`Hardware`, a preset name or a preset file's path).
      axes: mesh axis sizes, outermost first.
      groups: composite groups to report as well, by name: ``{"data+expert": ("data", "expert")}`` is the
        span of a collective over both axes at once (a gradient reduced over every device holding a batch
        shard, an all-to-all over experts spread on two axes).

    Returns:
      One :class:`AxisSpan` per axis, in the order of ``axes``, then one per composite group.

    Raises:
      MeshError: invalid sizes, more devices than the machine's tiers connect, or a group naming an axis
        that is not in ``axes``.
    """
    hardware = load_hardware(hardware)
    check_axes(axes)
    total = math.prod(axes.values())
    check_capacity(hardware, total)
    positions = np.arange(total).reshape(tuple(axes.values()))
    names = list(axes)
    spans = {name: _span(hardware, positions, [k], name) for k, name in enumerate(names)}
    if groups is not None and not isinstance(groups, Mapping):
        raise MeshError(f"groups={groups!r} must map a group's name to its mesh axes, e.g. {{'dp': ('data',)}}")
    for group, members in (groups or {}).items():
        if isinstance(members, str) or not isinstance(members, Sequence):
            raise MeshError(f"group {group!r} is {members!r}; give a tuple of mesh axis names, e.g. ('data',)")
        unknown = [a for a in members if a not in axes]
        if unknown:
            raise MeshError(f"group {group!r} names mesh axes {unknown} that are not among {names}")
        if len(set(members)) != len(members):
            raise MeshError(f"group {group!r} names a mesh axis twice ({tuple(members)}); give each axis once")
        if not members:
            raise MeshError(f"group {group!r} names no mesh axes; give one or more of {names}")
        if group in axes:
            raise MeshError(
                f"group {group!r} has the name of a mesh axis, whose span it would replace; name the group otherwise"
            )
        spans[group] = _span(hardware, positions, [names.index(a) for a in members], group)
    return spans


def _span(hardware: Hardware, positions: np.ndarray, dims: list[int], name: str) -> AxisSpan:
    """The span of the device groups varying along mesh dimensions ``dims`` together."""
    size = math.prod(positions.shape[d] for d in dims)
    moved = np.moveaxis(positions, dims, list(range(positions.ndim - len(dims), positions.ndim)))
    groups = np.sort(moved.reshape(-1, size), axis=1)
    ranks = _group_levels(hardware, groups)  # (groups, tiers)
    # the group reaching the slowest tier decides; ties go to the first such group
    reach = np.where(ranks > 1, np.arange(len(hardware.tiers)), -1).max(axis=1)
    chosen = int(np.argmax(reach))
    row = ranks[chosen]
    kept = tuple((t.name, int(r)) for t, r in zip(hardware.tiers, row, strict=True) if r > 1)
    torus = _torus(hardware, groups[chosen], positions.size, {n for n, _ in kept})
    return AxisSpan(
        axis=name, size=size, tier=kept[-1][0] if kept else hardware.tiers[0].name, levels=kept, torus=torus
    )


def _torus(hardware: Hardware, group: np.ndarray, total: int, crossed: set[str]) -> tuple[tuple[int, bool], ...]:
    """``(ranks, wraps)`` of each torus dimension ``group`` (device positions) spans on the torus tier it
    crosses: the devices of a tier group fill its torus shape fastest dimension first."""
    for tier in hardware.tiers:
        if tier.name not in crossed or tier.torus_dims is None:
            continue
        block = min(total, tier.group_size or total)
        shape = tier.torus_for(block)
        if shape is None:
            return ()
        out, stride = [], 1
        for length, wraps in shape:
            ranks = len(np.unique((group % block) // stride % length))
            stride *= length
            if ranks > 1:
                out.append((ranks, wraps and ranks == length))
        return tuple(out)
    return ()


def _group_levels(hardware: Hardware, groups: np.ndarray) -> np.ndarray:
    """Ranks per tier of every group (a row of device positions, ascending): on each tier, the devices (or
    lower-tier blocks) of the group that one block of the tier joins, rounded up."""
    below = np.full(len(groups), groups.shape[1])
    out = []
    for tier in hardware.tiers:
        if tier.group_size is None:
            blocks = np.ones(len(groups), dtype=int)
        else:  # positions ascend along a row, so blocks are counted where the block index changes
            blocks = np.count_nonzero(np.diff(groups // tier.group_size, axis=1), axis=1) + 1
        out.append(-(-below // blocks))
        below = blocks
    return np.stack(out, axis=1)


def check_capacity(hardware: Hardware, devices: int) -> None:
    """The machine connects ``devices`` devices.

    Raises:
      MeshError: more devices than the preset's outermost tier connects.
    """
    top = hardware.max_devices
    if top is not None and devices > top:
        raise MeshError(
            f"{devices} devices exceed what preset {hardware.name!r} connects ({top}, its outermost tier "
            f"{hardware.tiers[-1].name!r}); use at most {top} devices or a preset with a scale-out tier"
        )


def physical_order(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Sort devices into physical order: by slice, then host process, then torus coordinates, then id."""

    def key(d: jax.Device) -> tuple:
        return (getattr(d, "slice_index", 0) or 0, d.process_index, tuple(getattr(d, "coords", ()) or ()), d.id)

    return sorted(devices, key=key)


def make_mesh(
    hardware: Hardware | str | Path,
    axes: Mapping[str, int],
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: Sequence[jax.sharding.AxisType] | None = None,
) -> jax.sharding.Mesh:
    """Build a ``jax.sharding.Mesh`` over the machine with inner axes inside the fastest tiers.

    Args:
      hardware: the machine (its tiers decide nothing about the order here, but bound the device count): a
        :class:`Hardware`, a shipped preset's name (``"cloudmatrix384"``) or the path of a preset YAML file,
        loaded with :func:`~hyperjax.topology.hardware.load_hardware`.
      axes: mesh axis sizes, outermost first; the last axis varies fastest over physical devices.
      devices: the devices to use (default: all of ``jax.devices()``).
      axis_types: one ``AxisType`` per axis (default: ``Auto`` for every axis).

    Returns:
      The mesh. :func:`axis_spans` with the same ``hardware`` and ``axes`` tells which tiers each axis spans.

    Raises:
      MeshError: axis sizes that do not multiply to the number of devices, or too many devices.
      PresetError: ``hardware`` names an unknown preset or a malformed preset file.
    """
    import jax

    hardware = load_hardware(hardware)
    if devices is not None:
        if isinstance(devices, jax.Device) or not isinstance(devices, Iterable):
            raise MeshError(f"devices={devices!r} is not a sequence of devices; pass a list, e.g. jax.devices()[:8]")
        devices = list(devices)
        strays = [d for d in devices if not isinstance(d, jax.Device)]
        if strays:
            raise MeshError(f"devices holds {strays[0]!r}, not a jax.Device; pass devices from jax.devices()")
        if len(set(devices)) != len(devices):
            twice = next(d for d in devices if devices.count(d) > 1)
            raise MeshError(f"devices holds {twice} twice; give each device once")
    devs = physical_order(jax.devices() if devices is None else devices)
    if not devs:
        raise MeshError("devices is empty; pass the devices of the mesh (default: all of jax.devices())")
    check_axes(axes, len(devs))
    check_capacity(hardware, len(devs))
    if axis_types is None:
        axis_types = (jax.sharding.AxisType.Auto,) * len(axes)
    if isinstance(axis_types, str) or not isinstance(axis_types, Iterable):
        raise MeshError(f"axis_types={axis_types!r} must be a sequence of jax.sharding.AxisType, one per axis")
    axis_types = tuple(axis_types)
    if len(axis_types) != len(axes) or not all(isinstance(t, jax.sharding.AxisType) for t in axis_types):
        raise MeshError(
            f"axis_types={list(axis_types)} must give one jax.sharding.AxisType per mesh axis ({len(axes)}: "
            f"{', '.join(axes)}), e.g. (jax.sharding.AxisType.Explicit,) * {len(axes)}"
        )
    grid = np.array(devs, dtype=object).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(grid, tuple(axes), axis_types=axis_types)
