"""A placement: where every tensor group of a training step lives, as a frozen, printable value.

Tensor groups are named by path: ``layers.{i}.params``, ``layers.{i}.optimizer`` (moments and, in
mixed precision, master weights), ``layers.{i}.gradients``, and ``layers.{i}.act.{name}`` for each
activation the models tag with ``checkpoint_name`` and keep for backward. Each group is on ``device``,
on ``host`` (memory kind ``pinned_host``, prefetched before use) or, for activations, ``recompute``d
in backward. The block input (``layers.{i}.act.block_in``, the rematerialisation boundary: MaxText's
``decoder_layer_input``) is on the device or the host, never recomputed. Groups a placement does not name
stay on the device.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from collections.abc import Mapping
from pathlib import Path

from hyperjax.config import ACTIVATIONS, Activation, OffloadOption, Recompute, choices, recomputed
from hyperjax.errors import ConfigError

OPTIONS: tuple[OffloadOption, ...] = choices(OffloadOption)
KINDS = ("params", "optimizer", "gradients")
BLOCK_INPUT = "block_in"
PLACED_ACTIVATIONS: tuple[str, ...] = (BLOCK_INPUT, *ACTIVATIONS)
"""A block's activation groups: its input (kept or sent to the host, the boundary a recomputation starts
from) and the activations it can also recompute."""
_GROUP = re.compile(r"layers\.(\d+)\.(params|optimizer|gradients|kv\.\d+|act\.(\w+))$")


def group_names(layers: int) -> list[str]:
    """Every placeable tensor group of a stack of ``layers`` blocks, in layer order."""
    return [f"layers.{i}.{k}" for i in range(layers) for k in (*KINDS, *(f"act.{a}" for a in PLACED_ACTIVATIONS))]


def is_block_input(group: str) -> bool:
    """Whether ``group`` is a block's input (``layers.N.act.block_in``)."""
    return group.endswith(f".act.{BLOCK_INPUT}")


def options_of(group: str) -> tuple[str, ...]:
    """The placements group ``group`` can take."""
    return OPTIONS if ".act." in group and not is_block_input(group) else OPTIONS[:2]


def parse_group(group: str) -> tuple[int, str]:
    """``(layer, kind)`` of a group name, where kind is ``params``, ``optimizer``, ``gradients``, ``act.NAME``
    or (serving) ``kv.BLOCK``."""
    match = _GROUP.fullmatch(group)
    if match is None or (match.group(3) is not None and match.group(3) not in PLACED_ACTIVATIONS):
        raise ConfigError(
            f"offload: {group!r} is not a tensor group; groups are layers.N.params, layers.N.optimizer, "
            f"layers.N.gradients and layers.N.act.NAME with NAME one of {PLACED_ACTIVATIONS}"
        )
    return int(match.group(1)), match.group(2)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each tensor group lives: ``choices`` is a sorted tuple of ``(group, option)`` pairs.

    Build one with :meth:`of`; read it with ``placement[group]``.
    """

    choices: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, mapping: Mapping[str, str]) -> Placement:
        """A placement from ``{group: option}`` (options checked against each group's kind)."""
        for group, option in mapping.items():
            parse_group(group)
            if option not in options_of(group):
                raise ConfigError(f"offload: {group} cannot be placed on {option!r}; it takes {options_of(group)}")
        return cls(tuple(sorted(mapping.items(), key=lambda kv: (parse_group(kv[0])[0], kv[0]))))

    def __getitem__(self, group: str) -> str:
        return dict(self.choices).get(group, "device")

    def on(self, option: str) -> list[str]:
        """The groups placed on ``option``."""
        return [g for g, o in self.choices if o == option]

    def block(self, layer: int) -> dict[str, str]:
        """``{activation name: option}`` for one block (its input, ``block_in``, first)."""
        return {a: self[f"layers.{layer}.act.{a}"] for a in PLACED_ACTIVATIONS}

    def to_dict(self) -> dict[str, str]:
        """``{group: option}`` for every group not on the device."""
        return {g: o for g, o in self.choices if o != "device"}

    def save(self, path: str | Path) -> None:
        """Write the placement as JSON, atomically."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(target)

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """Read a placement written by :meth:`save`."""
        return cls.of(json.loads(Path(path).read_text()))

    def rows(self, layers: int) -> list[tuple[str, ...]]:
        """One row per run of consecutive layers placed alike: ``(layers, params, optimizer, gradients, *acts)``."""
        out: list[tuple[str, ...]] = []
        start = 0
        for i in range(1, layers + 1):
            if i == layers or self._row(i) != self._row(start):
                span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
                out.append((span, *self._row(start)))
                start = i
        return out

    def _row(self, i: int) -> tuple[str, ...]:
        return tuple(self[f"layers.{i}.{k}"] for k in KINDS) + tuple(self.block(i).values())

    def __str__(self) -> str:
        return ", ".join(f"{g}={o}" for g, o in self.choices if o != "device") or "everything on the device"


def from_patterns(patterns: Mapping[str, str], layers: int, base: Placement | None = None) -> Placement:
    """A placement from ``{glob pattern: option}`` (``offload.manual``), over ``base``.

    Raises:
      ConfigError: a pattern that names no group, or an option the group cannot take.
    """
    names = group_names(layers)
    choice = dict(base.choices) if base is not None else {}
    for pattern, option in patterns.items():
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ConfigError(
                f"offload.manual[{pattern!r}] names no tensor group of this {layers}-layer model; groups look "
                f"like layers.0.params, layers.*.optimizer, layers.*.act.attn_core"
            )
        # a wildcard over a block's activations recomputes all but the input, where a recomputation starts
        takes = [g for g in matched if option in options_of(g)]
        refused = [g for g in matched if option not in options_of(g)]
        if refused and (not takes or not all(map(is_block_input, refused))):
            g = refused[0]
            raise ConfigError(
                f"offload.manual[{pattern!r}]={option!r}: {g} takes one of {options_of(g)}"
                + (" (a block's input is where its recomputation starts)" if is_block_input(g) else "")
            )
        choice |= dict.fromkeys(takes, option)
    return Placement.of(choice)


def from_recompute(recompute: Recompute, layers: int, modules: tuple[Activation, ...] | None = None) -> Placement:
    """The placement ``train.recompute`` means: everything on the device, the activations it names (with
    ``selective``, ``modules``: ``train.recompute_modules``) recomputed."""
    names = recomputed(recompute, modules)
    return Placement.of({f"layers.{i}.act.{a}": "recompute" for i in range(layers) for a in names})
