"""The inventory of a compiled program, read from XLA: FLOPs, bytes and every collective with its groups.

This is the measured side of the cost model: the collectives the SPMD partitioner really inserted
(``compiled.as_text()``), XLA's own FLOP count (``cost_analysis()``) and memory sizes
(``memory_analysis()``), for programs small enough to compile here. The analytic inventory
(:mod:`hyperjax.cost.inventory`) must agree with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import Any

import numpy as np

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>\S+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective in a compiled program.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or ``collective-permute``.
      result_bytes: bytes of the result on one device (all arrays of a combined op together).
      group_size: devices per replica group (the whole program's devices for a permute).
      source: the JAX operation it comes from (XLA's ``op_name`` metadata), or ``""``.
      name: the instruction's name in the program (what profiles call it).
      arrays: the arrays it moves (XLA combines independent collectives into one over several arrays;
        its CPU backend still runs one collective per array).
      groups: the replica groups, as positions in the program's device assignment (every device in one
        group for a permute: XLA's CPU backend runs it over a communicator of them all).
    """

    kind: str
    result_bytes: int
    group_size: int
    source: str = ""
    name: str = ""
    arrays: int = 1
    groups: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledInventory:
    """What a compiled program does on one device."""

    flops: float
    bytes_accessed: float
    collectives: tuple[Collective, ...]
    memory: dict[str, int]

    def bytes_by_kind(self) -> Counter:
        """Result bytes per collective kind (a collective over groups of one device moves nothing and is
        left out: XLA emits such no-ops where a ``shard_map`` transposes over a mesh axis it does not use)."""
        out: Counter = Counter()
        for c in self.collectives:
            if c.group_size > 1:
                out[c.kind] += c.result_bytes
        return out

    def count_by_kind(self) -> Counter:
        """Collectives per kind (those over groups of one device left out)."""
        return Counter(c.kind for c in self.collectives if c.group_size > 1)


def _shape_bytes(shape: str) -> int:
    return sum(
        _DTYPE_BYTES.get(dt, 4) * math.prod(int(x) for x in dims.split(",") if x) for dt, dims in _ARRAY.findall(shape)
    )


def _groups(rest: str, devices: int) -> tuple[tuple[int, ...], ...]:
    """The replica groups an HLO collective's attributes (``rest``) name, in any of XLA's notations."""
    named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(?(\S+?)\)?)?\s*\{([^}]*)\}", rest)
    if named:  # replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}
        sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in named.group(1).split(","))}
        ids = _iota(named.group(2)) if named.group(2) else np.arange(math.prod(sizes.values()))
        grid = ids.reshape(tuple(sizes.values()))
        chosen = [list(sizes).index(a.strip("' ")) for a in named.group(3).split(",") if a.strip()]
        moved = np.moveaxis(grid, chosen, list(range(grid.ndim - len(chosen), grid.ndim)))
        return _rows(moved.reshape(-1, math.prod(grid.shape[i] for i in chosen)))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]*\](?:T\([\d,]*\))?)", rest)
    if iota:  # replica_groups=[4,2]<=[2,4]T(1,0)
        return _rows(_iota(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2))))
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}", rest)
    if listed:  # replica_groups={{0,1,2,3},{4,5,6,7}}
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", listed.group(1)))
    return (tuple(range(devices)),)


def _iota(text: str) -> np.ndarray:
    """The device order of an iota notation, ``[4,2]T(1,0)``: ``arange`` reshaped, transposed, flattened."""
    m = re.fullmatch(r"\[([\d,]*)\](?:T\(([\d,]*)\))?", text)
    if m is None:
        raise ValueError(f"unknown device order notation {text!r}")
    dims = [int(x) for x in m.group(1).split(",") if x]
    grid = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        grid = grid.transpose([int(x) for x in m.group(2).split(",")])
    return grid.reshape(-1)


def _rows(grid: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(x) for x in row) for row in grid)


def read_compiled(compiled: Any, devices: int) -> CompiledInventory:
    """The inventory of a ``jax.stages.Compiled`` SPMD program over ``devices`` devices."""
    collectives = []
    for line in compiled.as_text().splitlines():
        m = _OP.match(line)
        if m and "-done" not in line:
            groups = _groups(m.group("rest"), devices)
            collectives.append(
                Collective(
                    kind=m.group("kind"),
                    result_bytes=_shape_bytes(m.group("shape")),
                    group_size=len(groups[0]),
                    source=next(iter(re.findall(r'op_name="([^"]*)"', m.group("rest"))), ""),
                    name=m.group("name").lstrip("%"),
                    arrays=max(1, len(_ARRAY.findall(m.group("shape")))),
                    groups=groups,
                )
            )
    cost = compiled.cost_analysis() or {}
    mem = compiled.memory_analysis()
    memory = (
        {}
        if mem is None
        else {
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
            "aliased": mem.alias_size_in_bytes,
        }
    )
    return CompiledInventory(
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collectives=tuple(collectives),
        memory=memory,
    )
