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

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
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
    """

    kind: str
    result_bytes: int
    group_size: int
    source: str = ""


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


def _group_size(rest: str, devices: int) -> int:
    named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}", rest)
    if named:  # replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}
        sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in named.group(1).split(","))}
        return math.prod(sizes[a.strip("' ")] for a in named.group(2).split(",") if a.strip())
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if listed:
        return len([x for x in listed.group(1).split(",") if x])
    return devices


def read_compiled(compiled: Any, devices: int) -> CompiledInventory:
    """The inventory of a ``jax.stages.Compiled`` SPMD program over ``devices`` devices."""
    collectives = []
    for line in compiled.as_text().splitlines():
        m = _OP.match(line)
        if m and "-done" not in line:
            collectives.append(
                Collective(
                    kind=m.group("kind"),
                    result_bytes=_shape_bytes(m.group("shape")),
                    group_size=_group_size(m.group("rest"), devices),
                    source=next(iter(re.findall(r'op_name="([^"]*)"', m.group("rest"))), ""),
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
