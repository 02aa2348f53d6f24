"""HyperShard strategies: logical axis names mapped to mesh axes, as data.

A :class:`Strategy` says where every named dimension of every tensor lives on the mesh. Tensors name their
dimensions with *logical axes* (``batch``, ``embed``, ``heads``, ...): model parameters carry them as
``logical_axes`` metadata on their ``nnx.Param``, or as flax's own sharding annotation (``out_sharding``,
what ``nnx.with_partitioning`` and ``nnx.Param(..., sharding_names=...)`` store), and plain arrays get
them from ``params``, glob patterns over the pytree key path. ``rules`` maps each logical axis to a mesh
axis, a tuple of mesh axes, or ``None`` (replicated); a dimension may name several logical axes (a tuple),
and is then sharded over all their mesh axes. Turning logical axes into a
``PartitionSpec`` is one pure function, :meth:`Strategy.spec`; everything else (shardings for a whole
tree, constraints inside ``jit``, the explanation table) is built on it and checked before anything
compiles.

Unlike a per-module sharding annotation, the strategy is one value that can be printed, compared, saved
and swapped without touching the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import keystr

from hyperjax.errors import ShardingError
from hyperjax.shard.checks import (
    check_mesh,
    check_one_use,
    check_patterns,
    checked_fields,
    context_mesh,
    one_per_dimension,
    unsplit,
)
from hyperjax.shard.explanation import Explanation, placement
from hyperjax.shard.metadata import LogicalAxes, is_annotated, leaf_value, own_axes, reboxed

MeshAxes = str | tuple[str, ...] | None
Role = Literal["params", "gradients", "optimizer"]
ROLES: tuple[Role, ...] = ("params", "gradients", "optimizer")
Constrain = Callable[[jax.Array, LogicalAxes], jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """A declarative parallel strategy.

    Attributes:
      rules: logical axis name -> mesh axis, tuple of mesh axes, or ``None`` (replicated).
      params: key-path glob pattern -> logical axes, for tensors that carry no logical axes of their own
        (``"*/attn/o_proj/kernel": ("heads", "embed")``); the first matching pattern wins. Paths join
        the pytree keys with ``/`` (``blocks/0/attn/o_proj/kernel``).
      zero_stage: ZeRO over ``zero_axes``: 1 shards optimizer state, 2 also gradients (parameters stay as
        ``rules`` place them; FSDP, i.e. ZeRO-3, is a rule that shards ``embed`` over an axis).
      zero_axes: the mesh axes ZeRO shards over: the data-parallel axes a tensor is not already sharded
        over (a routed expert's state, sharded over ``expert``, is split over ``data`` alone).
    """

    rules: Mapping[str, MeshAxes]
    params: Mapping[str, LogicalAxes] = dataclasses.field(default_factory=dict)
    zero_stage: int = 0
    zero_axes: tuple[str, ...] = ("data",)
    # the patterns with_param_axes added: they mirror a state's variables, and may match nothing in a tree
    _derived: frozenset[str] = dataclasses.field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rules, params, zero_axes = checked_fields(self.rules, self.params, self.zero_stage, self.zero_axes)
        object.__setattr__(self, "rules", MappingProxyType(rules))
        object.__setattr__(self, "params", MappingProxyType(params))
        object.__setattr__(self, "zero_axes", zero_axes)
        object.__setattr__(self, "zero_stage", int(self.zero_stage))  # a NumPy integer kept as Python's

    def _key(self) -> tuple:
        # rules in any order; params in theirs, since the first pattern that matches wins
        return frozenset(self.rules.items()), tuple(self.params.items()), self.zero_stage, self.zero_axes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Strategy) and type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __reduce__(self) -> tuple:
        # the read-only mappings do not pickle; a strategy is rebuilt from plain ones
        fields = dict(rules=dict(self.rules), params=dict(self.params), zero_stage=self.zero_stage)
        return (_rebuilt, (type(self), {**fields, "zero_axes": self.zero_axes}, self._derived))

    def mesh_axes(self, logical: str | tuple[str, ...] | None) -> tuple[str, ...]:
        """The mesh axes of one dimension's logical axis (empty when replicated).

        Args:
          logical: a logical axis name, ``None``, or a tuple of names (the dimension is sharded over the mesh
            axes of all of them, in order).

        Returns:
          The mesh axes, outermost first.

        Raises:
          ShardingError: a logical axis has no rule.
        """
        if logical is None:
            return ()
        if isinstance(logical, tuple) and all(isinstance(name, str) for name in logical):
            return tuple(axis for name in logical for axis in self.mesh_axes(name))
        if not isinstance(logical, str):
            raise ShardingError(
                f"logical axis {logical!r} is a {type(logical).__name__}; give a logical axis name, None, or a "
                "tuple of names"
            )
        if logical not in self.rules:
            close = difflib.get_close_matches(logical, list(self.rules), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            known = f"the rules name {', '.join(self.rules)}" if self.rules else "the rules are empty"
            raise ShardingError(
                f"logical axis {logical!r} has no rule{hint} ({known}); add one, e.g. rules={{{logical!r}: None}} "
                f"to replicate it (in a config, shard: {{{logical}: null}})"
            )
        axes = self.rules[logical]
        return () if axes is None else (axes,) if isinstance(axes, str) else axes

    def spec(self, logical_axes: Sequence[str | tuple[str, ...] | None]) -> P:
        """The ``PartitionSpec`` of a tensor whose dimensions have these logical axes.

        Args:
          logical_axes: one entry per dimension: a logical axis name, ``None``, or a tuple of names.

        Returns:
          The spec, with each logical axis replaced by its mesh axes from ``rules``.

        Raises:
          ShardingError: a logical axis has no rule, or two dimensions map to one mesh axis.
        """
        one_per_dimension(logical_axes)
        per_dim = [self.mesh_axes(name) for name in logical_axes]
        check_one_use(f"spec({tuple(logical_axes)!r})", logical_axes, per_dim)
        return P(*(spec_entry(axes) for axes in per_dim))

    def logical_axes(self, tree: Any) -> Any:
        """The logical axes of every leaf of ``tree`` (a tuple per leaf; ``None`` where nothing names them).

        A leaf that is an ``nnx.Variable`` uses its sharding metadata: hyperjax's ``logical_axes``, or flax's
        ``out_sharding`` (where flax 0.12 keeps ``nnx.with_partitioning(init, names)``,
        ``nnx.Param(value, out_sharding=names)`` and the deprecated ``sharding_names=`` / ``sharding=``), a
        tuple or ``PartitionSpec`` whose names are logical axes here: they go through ``rules`` (flax's own
        ``sharding_rules`` metadata and ``nnx.logical_axis_rules`` are not consulted). A linen parameter boxed
        by ``nn.with_partitioning`` or ``nn.with_logical_partitioning`` uses its box's names alike. A variable
        without such metadata, and any other leaf, uses the first ``params`` pattern that matches its key
        path; a pattern that names other axes for an annotated leaf is an error (one source per tensor).

        Args:
          tree: a pytree of arrays, ``jax.ShapeDtypeStruct`` s or ``nnx.Variable`` s (an NNX state).

        Returns:
          The same tree structure with a tuple of logical axes (or ``None``) per leaf.

        Raises:
          ShardingError: a variable's sharding metadata is not a tuple (or ``PartitionSpec``) of logical axis
            names, ``None`` and tuples of names, two of its metadata keys name different axes, or a ``params``
            pattern names other axes than its metadata.
        """

        def one(path: tuple, leaf: Any) -> LogicalAxes | None:
            name = keystr(path, simple=True, separator="/")
            matched = next(((p, a) for p, a in self.params.items() if fnmatch.fnmatchcase(name, p)), None)
            own = own_axes(name, leaf)
            if own is None:
                return None if matched is None else matched[1]
            if matched is not None and matched[0] not in self._derived and tuple(matched[1]) != own:
                raise ShardingError(
                    f"tensor {name!r}: its sharding metadata names logical axes {own}, but params pattern "
                    f"{matched[0]!r} names {tuple(matched[1])}; drop the pattern or the annotation, so that one "
                    "source names its axes"
                )
            return own

        return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_annotated)

    def shardings(self, tree: Any, mesh: jax.sharding.Mesh, *, role: Role = "params") -> Any:
        """A ``NamedSharding`` for every leaf of ``tree``, checked against the leaf's shape.

        Args:
          tree: arrays, ``jax.ShapeDtypeStruct`` s, or an NNX state whose variables carry logical axes.
          mesh: the mesh to place them on.
          role: ``params`` as the rules say; ``gradients`` and ``optimizer`` add ZeRO sharding over
            ``zero_axis`` when ``zero_stage`` asks for it.

        Returns:
          The same tree structure with ``NamedSharding`` leaves (inside ``nnx.Variable`` s for NNX state).

        Raises:
          ShardingError: a rule is missing, a mesh axis is used twice in one spec, a mesh axis is not in
            ``mesh``, or a dimension is not divisible by its mesh axes.
        """
        if role not in ROLES:
            raise ShardingError(f"role={role!r} is not one of {', '.join(ROLES)}")
        check_mesh(mesh)
        zero = self.zero_for(role)
        if zero and not any(a in mesh.shape for a in zero):  # ZeRO over those of them the mesh has
            raise ShardingError(
                f"zero_stage={self.zero_stage} shards the {role} over zero_axes={self.zero_axes}, none of which the "
                f"mesh {dict(mesh.shape)} has; give zero_axes among the mesh's axes"
            )

        paths, bare = [], []  # every leaf's path; those of the tensors nothing names, which are replicated

        def one(path: tuple, leaf: Any) -> Any:
            value = leaf_value(leaf)
            (axes,) = self._axes_of(leaf, path)
            name = keystr(path, simple=True, separator="/")
            paths.append(name)
            bare.extend([name] if axes is None and np.ndim(value) > 0 else [])
            sharding = NamedSharding(mesh, self.check(name, np.shape(value), axes, mesh, zero=zero))
            return reboxed(leaf, sharding)

        out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_annotated)
        check_patterns([p for p in self.params if p not in self._derived], paths, bare)
        return out

    def zero_for(self, role: Role) -> tuple[str, ...]:
        """The mesh axes ZeRO splits ``role``'s tensors over: ``zero_axes`` for the optimizer state from
        ``zero_stage`` 1 and for the gradients from 2; none for the parameters."""
        if role == "params":  # split by the rules alone (FSDP is a rule)
            return ()
        return self.zero_axes if self.zero_stage >= (1 if role == "optimizer" else 2) else ()

    def check(
        self,
        path: str,
        shape: tuple[int, ...],
        logical_axes: LogicalAxes | None,
        mesh: jax.sharding.Mesh,
        *,
        zero: tuple[str, ...] = (),
    ) -> P:
        """The checked ``PartitionSpec`` of one tensor (``zero``: also shard over those of these axes it is not
        sharded over already, on the first dimension they divide).

        Raises:
          ShardingError: as :meth:`shardings`.
        """
        return self._check(f"tensor {path!r}", shape, logical_axes, mesh, zero=zero)

    def _check(
        self,
        what: str,
        shape: tuple[int, ...],
        logical_axes: LogicalAxes | None,
        mesh: jax.sharding.Mesh,
        *,
        zero: tuple[str, ...] = (),
    ) -> P:
        if logical_axes is None:
            logical_axes = (None,) * len(shape)
        one_per_dimension(logical_axes)
        if len(logical_axes) != len(shape):
            raise ShardingError(
                f"{what} has shape {shape} ({len(shape)} dims) but logical axes {tuple(logical_axes)} "
                f"({len(logical_axes)}); give one logical axis (or null) per dimension"
            )
        try:
            per_dim = [list(self.mesh_axes(name)) for name in logical_axes]
        except ShardingError as e:
            raise ShardingError(f"{what}: {e}") from None
        for name, axes in zip(logical_axes, per_dim, strict=True):
            for axis in axes:
                if axis not in mesh.shape:
                    raise ShardingError(
                        f"{what}: logical axis {name!r} maps to mesh axis {axis!r}, which the mesh "
                        f"{dict(mesh.shape)} does not have; fix the rule for {name!r}"
                    )
        check_one_use(what, logical_axes, per_dim)
        seen = {axis for axes in per_dim for axis in axes}
        for name, axes, size in zip(logical_axes, per_dim, shape, strict=True):
            ways = math.prod(mesh.shape[a] for a in axes)
            if size % ways:
                raise ShardingError(
                    f"{what}: dimension {name!r} of size {size} is not divisible by mesh axes "
                    f"{tuple(axes)} of total size {ways}; choose degrees that divide {size} or map {name!r} "
                    "to fewer mesh axes"
                )
        extra = [a for a in zero if a not in seen and mesh.shape.get(a, 1) > 1]
        ruled = [math.prod(mesh.shape[a] for a in axes) for axes in per_dim]  # each dimension's split by the rules
        for axis in extra:
            for axes, size in zip(per_dim, shape, strict=True):
                if size % (math.prod(mesh.shape[a] for a in axes) * mesh.shape[axis]) == 0:
                    axes.append(axis)
                    break
            else:  # a scalar (the optimizer's step count) has nothing to split and is kept whole
                if shape:
                    placed = [a for a in extra if a != axis and any(a in axes for axes in per_dim)]
                    error = unsplit(what, shape, logical_axes, ruled, placed, axis, mesh, self.zero_stage)
                    raise ShardingError(error)
        return P(*(spec_entry(tuple(axes)) for axes in per_dim))

    def with_param_axes(self, state: Any) -> Strategy:
        """This strategy, plus a ``params`` pattern for every variable of an NNX ``state``.

        Pure-array copies of the state (its ``nnx.to_pure_dict``, gradients, optimizer moments nested
        under optimizer-state fields) then shard like the variables they mirror: the pattern for
        ``blocks/0/mlp/w_in`` is that path itself and ``*/blocks/0/mlp/w_in``.
        """
        named: dict[str, LogicalAxes] = {}

        def record(path: tuple, leaf: Any) -> None:
            (axes,) = self._axes_of(leaf, path)
            if axes is not None:
                named[keystr(path, simple=True, separator="/")] = axes

        jax.tree_util.tree_map_with_path(record, state, is_leaf=is_annotated)
        # the longest paths first: the first pattern that matches wins, and ``*/out/kernel`` also matches the
        # moments of ``stages/0/out/kernel``, which ``*/stages/0/out/kernel`` must claim before it
        found: dict[str, LogicalAxes] = {}
        for name in sorted(named, key=lambda n: -n.count("/")):
            found[name] = found[f"*/{name}"] = named[name]
        # a pattern of the caller's that named variables of the state is mirrored by theirs: the copies of the
        # state need not match it
        covered = {p for p in self.params if any(fnmatch.fnmatchcase(n, p) for n in named)}
        out = dataclasses.replace(self, params={**found, **self.params})
        object.__setattr__(out, "_derived", self._derived | (found.keys() - self.params.keys()) | covered)
        return out

    def explain(self, tree: Any, mesh: jax.sharding.Mesh, *, role: Role = "params") -> Explanation:
        """Per tensor: path, shape, logical axes, ``PartitionSpec`` and bytes per device; and totals.

        Raises:
          ShardingError: as :meth:`shardings`.
        """
        shardings = self.shardings(tree, mesh, role=role)
        rows = [
            placement(
                keystr(path, simple=True, separator="/"), leaf_value(leaf), self._axes_of(leaf, path)[0], sharding
            )
            for (path, leaf), sharding in zip(_leaves(tree), jax.tree.leaves(shardings), strict=True)
        ]
        return Explanation(rows=tuple(rows), mesh_shape=dict(mesh.shape))

    def _axes_of(self, leaf: Any, path: tuple) -> list[LogicalAxes | None]:
        return jax.tree.leaves(
            self.logical_axes(_at_path(path, leaf)), is_leaf=lambda x: isinstance(x, tuple) or x is None
        ) or [None]

    def constrain(
        self,
        x: jax.Array,
        logical_axes: Sequence[str | tuple[str, ...] | None],
        *,
        mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    ) -> jax.Array:
        """A sharding constraint inside ``jit``: ``x`` is laid out as its logical axes say.

        Args:
          x: the array.
          logical_axes: one logical axis (or ``None``, or a tuple of them) per dimension of ``x``.
          mesh: the mesh; without it, the mesh set by ``jax.set_mesh``.

        Returns:
          ``x`` with the constraint applied.

        Raises:
          ShardingError: as :meth:`shardings` (``x`` named by its logical axes), or no ``mesh`` is given and
            none is set.
        """
        one_per_dimension(logical_axes)
        what = f"x in constrain(x, {tuple(logical_axes)!r})"
        if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
            raise ShardingError(f"{what}: x is a {type(x).__name__}, not an array; pass a jax.Array (jnp.asarray(x))")
        if mesh is None:
            mesh = context_mesh(x)
            if mesh is None:
                raise ShardingError(
                    f"constrain(x, {tuple(logical_axes)!r}) has no mesh: pass mesh=, or set one around the call "
                    "with `with jax.set_mesh(mesh):`"
                )
        check_mesh(mesh)
        mesh = _reachable(what, x, mesh)
        spec = self._check(what, np.shape(x), tuple(logical_axes), mesh)
        manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == jax.sharding.AxisType.Manual}
        inside = sorted({a for e in spec for a in entry_axes(e)} & manual)
        if inside:
            raise ShardingError(
                f"{what} asks for {spec}, but inside this shard_map mesh axes {inside} are manual (each device holds "
                "its own block): constrain only over the other axes, or constrain outside the shard_map"
            )
        if jax.sharding.AxisType.Explicit in mesh.axis_types:  # the layout is the array's type: change it
            if isinstance(x, jax.core.Tracer) and jax.sharding.get_abstract_mesh().empty:
                raise ShardingError(
                    f"{what}: the mesh {dict(mesh.shape)} has Explicit axes, whose layouts jit types only under "
                    "a mesh set around it; call the jitted function inside `with jax.set_mesh(mesh):`, or make "
                    "the mesh with hyperjax.make_mesh (Auto axes)"
                )
            return jax.sharding.reshard(x, NamedSharding(mesh, spec))
        try:
            return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        except (ValueError, TypeError) as e:  # what the checks above do not foresee, named as this call's
            first = str(e).strip().splitlines()[0]
            raise ShardingError(
                f"{what} as {spec} over the mesh {dict(mesh.shape)}: JAX refuses it ({first})"
            ) from None


def _reachable(
    what: str, x: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
    """The mesh a constraint on ``x`` over ``mesh`` is applied with: inside ``shard_map``, the context's, whose
    mapped axes are manual; an abstract mesh only where devices are known (set around the call, or ``x`` already
    on them).

    Raises:
      ShardingError: ``mesh`` is not the ``shard_map``'s, or an abstract mesh names no devices here.
    """
    context = jax.sharding.get_abstract_mesh()
    manual = not context.empty and jax.sharding.AxisType.Manual in context.axis_types
    if manual:
        if dict(context.shape) != dict(mesh.shape):
            raise ShardingError(
                f"{what}: mesh {dict(mesh.shape)} is not the mesh of the shard_map around the call "
                f"{dict(context.shape)}; pass that mesh, or none"
            )
        return context
    if isinstance(mesh, jax.sharding.Mesh) or not context.empty:
        return mesh
    held = getattr(x, "sharding", None)
    if not isinstance(x, jax.core.Tracer) and isinstance(held, NamedSharding) and held.mesh.abstract_mesh == mesh:
        return held.mesh  # x is on the mesh's devices already
    raise ShardingError(
        f"{what}: mesh= is an AbstractMesh {dict(mesh.shape)}, which names no devices, and none is set around the "
        "call (under jit the constraint would be honoured only if the inputs happened to lie on the mesh, and the "
        "step could run on one device); pass the concrete Mesh, or call inside `with jax.set_mesh(mesh):`"
    )


def _rebuilt(cls: type[Strategy], fields: dict[str, Any], derived: frozenset[str]) -> Strategy:
    out = cls(**fields)
    object.__setattr__(out, "_derived", derived)
    return out


def _leaves(tree: Any) -> list[tuple[tuple, Any]]:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_annotated)[0]


def _at_path(path: tuple, leaf: Any) -> Any:
    # a one-leaf tree whose key path is ``path``, so pattern rules see the leaf's real path
    tree: Any = leaf
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        tree = {name: tree}
    return tree


def spec_entry(axes: tuple[str, ...]) -> MeshAxes:
    """A ``PartitionSpec`` entry for a dimension split over the mesh axes ``axes``."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def place(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host value as a global array on ``sharding``; each process fills only the shards it holds."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx], dtype=x.dtype)
