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
import contextvars
import dataclasses
from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from hyperjax.config import Fp8Config
from hyperjax.models.fp8 import product as fp8_product


@dataclasses.dataclass
class _Split:
    offsets: list[jax.Array] | None  # None: record the output shapes only
    inputs: list[jax.Array] = dataclasses.field(default_factory=list)
    shapes: list[jax.ShapeDtypeStruct] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Weights:
    inputs: list[jax.Array]
    outputs: list[jax.Array] = dataclasses.field(default_factory=list)


_ACTIVE: contextvars.ContextVar[tuple[_Split | _Weights, ...]] = contextvars.ContextVar("taps", default=())


def product(spec: str, x: jax.Array, w: jax.Array, *, fp8: Fp8Config | None = None, constrain: Any = None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for activation ``x`` and weight ``w``, split-backward aware.

    With ``fp8`` the product multiplies FP8 operands (:func:`hyperjax.models.fp8.product`); ``constrain``
    (the model's) reduces token-wide amaxes over the replicas a training step holds apart.
    """
    if fp8 is None:
        mul = jnp.einsum
    else:
        mul = partial(fp8_product, fp8=fp8, reduce=getattr(constrain, "replica_max", None) or _same)
    active = _ACTIVE.get()
    if not active:
        return mul(spec, x, w)
    state = active[-1]
    if isinstance(state, _Weights):
        i = len(state.outputs)
        if i >= len(state.inputs) or state.inputs[i].shape != x.shape:
            raise RuntimeError(f"weight product {i} does not match the recorded forward ({spec}, input {x.shape})")
        y = mul(spec, state.inputs[i], w)
        state.outputs.append(y)
        return y
    if state.offsets is None:
        y = mul(spec, x, w)
        state.shapes.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
        return y
    i = len(state.inputs)
    y = mul(spec, x, jax.lax.stop_gradient(w))
    if i >= len(state.offsets) or state.offsets[i].shape != y.shape:
        raise RuntimeError(f"weight product {i} does not match the traced shapes ({spec}, output {y.shape})")
    state.inputs.append(x)
    return y + state.offsets[i]


def _same(x: jax.Array) -> jax.Array:
    return x


@contextlib.contextmanager
def _entered(state: _Split | _Weights) -> Iterator[None]:
    token = _ACTIVE.set((*_ACTIVE.get(), state))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def split(offsets: list[jax.Array] | None) -> Iterator[_Split]:
    """Products inside add ``offsets`` (in call order) and record their inputs; ``None``: record shapes.

    Raises:
      RuntimeError: the products inside did not use every offset (the model's code path changed).
    """
    state = _Split(offsets)
    with _entered(state):
        yield state
    if offsets is not None and len(state.inputs) != len(offsets):
        raise RuntimeError(f"{len(offsets)} weight products were traced but {len(state.inputs)} ran")


@contextlib.contextmanager
def weights_only(inputs: list[jax.Array]) -> Iterator[_Weights]:
    """Products inside are recomputed from ``inputs`` (in call order) and collected as ``outputs``.

    Raises:
      RuntimeError: the products inside did not use every recorded input.
    """
    state = _Weights(list(inputs))
    with _entered(state):
        yield state
    if len(state.outputs) != len(state.inputs):
        raise RuntimeError(f"{len(state.inputs)} weight products were recorded but {len(state.outputs)} ran")


def output_shapes(fn: Any, *args: Any) -> list[jax.ShapeDtypeStruct]:
    """The output shape and dtype of every product ``fn(*args)`` makes, in call order."""
    with split(None) as state:
        jax.eval_shape(fn, *args)
    return state.shapes
