"""Weight products that a split backward can take apart (zero-bubble pipelines).

A zero-bubble schedule splits a chunk's backward into the input gradient (``B``) and the weight
gradient (``W``). Plain autodiff cannot do the split cheaply: a weight's gradient needs the gradient at
its product's output, and that is the end of the activation-gradient chain, so ``W`` taken on its own
re-runs the chain. Here, every product of an activation with a weight goes through :func:`product`.
Outside the two contexts below it is ``jnp.einsum``. Inside them:

- :func:`split` (the forward that a split backward differentiates): the weight enters under
  ``stop_gradient``, and a zero *offset* is added to the output. The cotangent of that offset is the
  output's gradient, so ``B`` yields the input gradient, every product's output gradient, and the
  gradients of the parameters used elsewhere (norms, biases, the embedding lookup), and no weight
  GEMMs. The product's input is recorded, for ``W``.
- :func:`weights_only` (``W``): each product is recomputed from its recorded input. The
  differentiated outputs are those products alone, so ``W`` is the weight GEMMs and nothing else. The
  rest of the forward is traced but feeds no output, and XLA drops it.

Products are matched by call order, which the same model code repeats exactly. A product this module
does not see keeps its ordinary gradient in ``B``, so the split stays exact either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class _Split:
    offsets: list[jax.Array] | None  # None: record the output shapes only
    inputs: list[jax.Array] = dataclasses.field(default_factory=list)
    shapes: list[jax.ShapeDtypeStruct] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Weights:
    inputs: list[jax.Array]
    outputs: list[jax.Array] = dataclasses.field(default_factory=list)


_ACTIVE: list[_Split | _Weights] = []


def product(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for activation ``x`` and weight ``w``, split-backward aware."""
    if not _ACTIVE:
        return jnp.einsum(spec, x, w)
    state = _ACTIVE[-1]
    if isinstance(state, _Weights):
        y = jnp.einsum(spec, state.inputs[len(state.outputs)], w)
        state.outputs.append(y)
        return y
    if state.offsets is None:
        y = jnp.einsum(spec, x, w)
        state.shapes.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
        return y
    offset = state.offsets[len(state.inputs)]
    state.inputs.append(x)
    return jnp.einsum(spec, x, jax.lax.stop_gradient(w)) + offset


@contextlib.contextmanager
def split(offsets: list[jax.Array] | None) -> Iterator[_Split]:
    """Products inside add ``offsets`` (in call order) and record their inputs; ``None``: record shapes."""
    state = _Split(offsets)
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def weights_only(inputs: list[jax.Array]) -> Iterator[_Weights]:
    """Products inside are recomputed from ``inputs`` (in call order) and collected as ``outputs``."""
    state = _Weights(list(inputs))
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()


def output_shapes(fn: Any, *args: Any) -> list[jax.ShapeDtypeStruct]:
    """The output shape and dtype of every product ``fn(*args)`` makes, in call order."""
    with split(None) as state:
        jax.eval_shape(fn, *args)
    return state.shapes
