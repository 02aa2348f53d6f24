"""The checks a :class:`~hyperjax.shard.strategy.Strategy` makes of what it is given: its fields, the logical
axes of one tensor, its ``params`` patterns against a tree, and the mesh (or the one ``jax.set_mesh`` set)."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from hyperjax.errors import ShardingError, integral
from hyperjax.shard.metadata import LogicalAxes, unreadable


def checked_fields(
    rules_in: Any, params_in: Any, zero_stage: Any, zero_axes: Any
) -> tuple[dict[str, str | tuple[str, ...] | None], dict[str, LogicalAxes], tuple[str, ...]]:
    """A strategy's ``rules``, ``params`` and ``zero_axes`` as it keeps them (tuples for lists), checked with
    its ``zero_stage``.

    Raises:
      ShardingError: a field of the wrong kind, naming it and giving an example of the right one.
    """
    if not isinstance(rules_in, Mapping) or not all(isinstance(k, str) for k in rules_in):
        raise ShardingError(
            f"rules={rules_in!r} must map logical axis names to a mesh axis, a tuple of them or None, "
            "e.g. rules={'batch': 'data', 'mlp': 'tensor', 'embed': None}"
        )
    rules = {}
    for name, axes in rules_in.items():
        if axes is not None and not isinstance(axes, str):
            if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
                raise ShardingError(
                    f"rule for logical axis {name!r} is {axes!r}; give a mesh axis name, a list of them, or null"
                )
            axes = tuple(axes)
        rules[name] = axes
    if not isinstance(params_in, Mapping) or not all(isinstance(k, str) for k in params_in):
        raise ShardingError(
            f"params={params_in!r} must map key-path glob patterns to logical axes, "
            "e.g. params={'*/mlp/w_in': ('embed', 'mlp')}"
        )
    params = {}
    for pattern, axes in params_in.items():
        problem = unreadable(axes)
        if problem:
            raise ShardingError(
                f"params[{pattern!r}]={axes!r} {problem}; give one logical axis (or None) per dimension, "
                "e.g. ('embed', 'mlp') or ('mlp',)"
            )
        params[pattern] = tuple(axes)
    if not integral(zero_stage) or zero_stage not in (0, 1, 2):
        raise ShardingError(
            f"zero_stage={zero_stage!r} must be 0, 1 or 2 (stage 3 is FSDP: shard 'embed' over an axis)"
        )
    zero = zero_axes
    if isinstance(zero, str) or not isinstance(zero, Sequence) or not all(isinstance(a, str) for a in zero):
        raise ShardingError(f"zero_axes={zero!r} must be a tuple of mesh axis names, e.g. ('data',)")
    return rules, params, tuple(zero)


def one_per_dimension(logical_axes: Any) -> None:
    """``logical_axes`` is a sequence of entries, one per dimension, not a bare name.

    Raises:
      ShardingError: showing the one-entry tuple meant.
    """
    if isinstance(logical_axes, str) or not isinstance(logical_axes, Sequence):
        raise ShardingError(
            f"logical axes {logical_axes!r} must be a sequence with one entry per dimension (a logical axis "
            f"name, None or a tuple of names), e.g. ({logical_axes!r},)"
        )


def check_one_use(what: str, logical_axes: Sequence[Any], per_dim: Sequence[Sequence[str]]) -> None:
    """No mesh axis splits two dimensions of one tensor (``per_dim``: each dimension's mesh axes).

    Raises:
      ShardingError: naming both logical axes and the fix.
    """
    seen: dict[str, Any] = {}
    for name, axes in zip(logical_axes, per_dim, strict=True):
        for axis in axes:
            if axis in seen:
                raise ShardingError(
                    f"{what}: mesh axis {axis!r} is used twice in one spec, by logical axes "
                    f"{seen[axis]!r} and {name!r}; map one of them to another mesh axis or to null"
                )
            seen[axis] = name


def check_mesh(mesh: Any) -> None:
    """``mesh`` is a JAX mesh.

    Raises:
      ShardingError: naming what was given and how to make one.
    """
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise ShardingError(
            f"mesh={mesh!r} is a {type(mesh).__name__}, not a jax.sharding.Mesh; make one with "
            "hyperjax.make_mesh(hardware, axes)"
        )


def check_patterns(patterns: list[str], paths: list[str], bare: list[str]) -> None:
    """A ``params`` pattern that matches none of a tree's ``paths`` while tensors of it carry no logical axes
    (``bare``, replicated) is a pattern meant for them, misspelt.

    Raises:
      ShardingError: naming the pattern, the tensors nothing names, and the closest of them.
    """
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(path, p) for path in paths)]
    if unused and bare:
        close = difflib.get_close_matches(unused[0], bare, n=1, cutoff=0.0)
        shown = ", ".join(bare[:4]) + (f" and {len(bare) - 4} more" if len(bare) > 4 else "")
        they = "it carries" if len(bare) == 1 else "they carry"
        raise ShardingError(
            f"params pattern {unused[0]!r} matches no tensor of the tree, and {shown}: {they} no logical axes, so "
            f"would be replicated; did you mean {close[0]!r}? Fix the pattern, or name those tensors' axes (None "
            "replicates on purpose)"
        )


def context_mesh(x: Any) -> jax.sharding.Mesh | jax.sharding.AbstractMesh | None:
    """The mesh ``jax.set_mesh`` set, concrete where ``x`` is (outside ``jit``); ``None`` when none is set."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        return None
    if isinstance(x, jax.core.Tracer):
        return abstract
    try:
        # a concrete array outside jit needs the concrete mesh; jax refuses it while tracing
        return jax.sharding.get_mesh()
    except ValueError:
        return abstract


def unsplit(
    what: str,
    shape: tuple[int, ...],
    logical_axes: LogicalAxes,
    ruled: Sequence[int],
    placed: Sequence[str],
    axis: str,
    mesh: jax.sharding.Mesh,
    zero_stage: int,
) -> str:
    """The error for a tensor whose ZeRO-sharded state no dimension can split over mesh ``axis`` (``ruled``:
    the ways the rules split each dimension; ``placed``: the ZeRO axes already placed on it)."""
    n = mesh.shape[axis]
    local = tuple(size // ways for size, ways in zip(shape, ruled, strict=True))
    before = f"per device by the rules: {local}"
    if placed:
        others = " and ".join(f"{a!r} ({mesh.shape[a]})" for a in placed)
        before += f", then split by ZeRO's {others}"
    fewer = f", a {' or '.join(repr(a) for a in placed)} degree that leaves room" if placed else ""
    return (
        f"{what} of shape {tuple(shape)}, logical axes {tuple(logical_axes)}: zero_stage={zero_stage} shards its "
        f"state over mesh axis {axis!r} ({n} devices), but no dimension of it divides by {n} ({before}); kept "
        f"whole over {axis!r}, each device would hold {n}x the share of its state the cost model prices. Choose a "
        f"{axis!r} degree that divides one of its dimensions{fewer}, or zero_stage=0"
    )
