"""A strategy bound to a mesh, as the ``constrain`` function models are called with.

Inside ``jit`` a model lays out its activations by logical axes: ``constrain(x, ("batch", "seq",
"act_embed"))``. A :class:`Constrainer` answers that call from a :class:`Strategy` on one mesh. It also
serves code that leaves SPMD for explicit collectives (the mixture-of-experts exchange under
``jax.shard_map``), which reads the mesh axes of logical axes from it.

Some mesh axes may already be *manual*: the training step computes each data-parallel replica's
gradients by itself under ``jax.shard_map`` over those axes (see :mod:`hyperjax.shard.replicas`), so
inside, each device holds only its replica's rows. The constrainer then leaves those axes out of every
layout it asks for, and offers the few cross-replica sums a model needs to stay exact (the router's
expert counts of a mixture of experts), which are no-ops when no axis is manual.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax.shard.strategy import Strategy, entry_axes, spec_entry

LogicalAxes = Sequence[str | tuple[str, ...] | None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constrainer:
    """:meth:`Strategy.constrain` on one mesh, with ``manual`` mesh axes split outside.

    Attributes:
      strategy: the strategy.
      mesh: the mesh.
      manual: mesh axes the caller has made manual (each device sees one replica along them), outermost
        first; empty for an ordinary SPMD program.
    """

    strategy: Strategy
    mesh: jax.sharding.Mesh
    manual: tuple[str, ...] = ()

    def __call__(self, x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
        if not self.manual:
            return self.strategy.constrain(x, logical_axes, mesh=self.mesh)
        # inside shard_map the context mesh has the manual axes marked so; lay out over the others
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(jax.sharding.get_abstract_mesh(), self.spec(logical_axes))
        )

    def mesh_axes(self, logical: str) -> tuple[str, ...]:
        """The mesh axes ``logical`` is sharded over (those of size 1 left out), manual ones included."""
        return tuple(a for a in self.strategy.mesh_axes(logical) if self.mesh.shape[a] > 1)

    def spec(self, logical_axes: LogicalAxes) -> P:
        """The ``PartitionSpec`` of these logical axes over the axes that are not manual."""
        return without(self.strategy.spec(logical_axes), self.manual)

    def region_mesh(self) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
        """The mesh a nested ``shard_map`` takes: this one, or inside the manual axes' region the context's
        (which marks them manual); call it while tracing."""
        return jax.sharding.get_abstract_mesh() if self.manual else self.mesh

    @property
    def auto_axes(self) -> frozenset[str]:
        """The mesh axes that are not manual (what a nested ``shard_map`` may take over)."""
        return frozenset(a for a in self.mesh.axis_names if a not in self.manual)

    @property
    def replicas(self) -> int:
        """Replicas along the manual axes (1 when none is manual)."""
        return math.prod(self.mesh.shape[a] for a in self.manual)

    def replica_sum(self, x: jax.Array) -> jax.Array:
        """``x`` summed over the replicas (no gradient flows through the sum)."""
        x = jax.lax.stop_gradient(x)
        return jax.lax.psum(x, self.manual) if self.manual else x

    def replica_max(self, x: jax.Array) -> jax.Array:
        """``x``'s maximum over the replicas (an FP8 scale's amax over the whole batch)."""
        return jax.lax.pmax(x, self.manual) if self.manual else x

    def replica_gather(self, x: jax.Array) -> jax.Array:
        """Every replica's ``x``, stacked in replica order on a new leading axis (no gradient)."""
        x = jax.lax.stop_gradient(x)
        return jax.lax.all_gather(x, self.manual) if self.manual else x[None]

    def replica_index(self) -> jax.Array:
        """This replica's index along the manual axes (outermost first), 0 when none is manual."""
        return jax.lax.axis_index(self.manual) if self.manual else jnp.int32(0)


def without(spec: P, axes: Sequence[str]) -> P:
    """``spec`` with the mesh axes ``axes`` left out of every dimension."""
    if not axes:
        return spec
    return P(*(spec_entry(tuple(a for a in entry_axes(entry) if a not in axes)) for entry in spec))
