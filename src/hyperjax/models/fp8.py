"""FP8 products: the linear layers of a block multiply in 8-bit floating point (``train.fp8``).

A recipe says how each operand of a product is scaled before it is cast to FP8 (E4M3 forward; E5M2 or E4M3
for gradients, by ``format``):

- ``tensorwise``: one scale per tensor from its current amax (Transformer Engine's current scaling,
  torchao's tensorwise). The backward reuses the forward's FP8 operands.
- ``rowwise`` (torchao): one scale per row of each operand, over the axes the product contracts; the
  backward products contract other axes, so their operands are quantised again from high precision.
- ``blockwise`` (DeepSeek-V3): activations and gradients in 1 x ``block`` tiles along their last contracted
  (for a gradient: its last) axis, weights in ``block`` x ``block`` blocks. The weight-gradient product
  keeps each token's tiles (DeepSeek's kernels re-tile along tokens, 128 x 1, which depends on how the
  tokens reach a device; per-token tiles keep every layout's numbers the same).
- ``delayed`` (Transformer Engine's delayed scaling: scales from an amax history across steps) is priced
  by the cost model; the emulated runtime does not carry the history and refuses it.

How the emulation computes. An operand is divided by its scale, clipped to the format's range, cast to FP8
and multiplied back by the scale in float32 (:func:`quantize`, :func:`dequantize`); the product then runs in
float32 on those values and is cast to the compute dtype. That is what an FP8 GEMM with float32
accumulation computes, and the form XLA's GPU compiler rewrites into an FP8 GEMM for per-tensor scales.

Every scale is global: an amax is taken over the whole logical tensor (row, or tile), reduced over every
device that holds part of it (by XLA's partitioner in SPMD code, by ``pmax`` over the replicas a training
step holds apart and inside the experts' ``shard_map``), so a sharded run quantises every operand to the
same bits as one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hyperjax.config import Fp8Config

Reduce = Callable[[jax.Array], jax.Array]
"""Reduces an amax over the devices that hold other parts of its tensor (the identity where none does)."""

WHOLE, EACH = 0, 1
"""Per-axis scale granularity: reduce over the whole axis, or one scale per element of it; an int > 1 is a
tile width along the axis (the last tile may be partial)."""


def _same(x: jax.Array) -> jax.Array:
    return x


def forward_dtype(fp8: Fp8Config) -> jnp.dtype:
    """The FP8 format of forward operands: E4M3."""
    return jnp.dtype(jnp.float8_e4m3fn)


def gradient_dtype(fp8: Fp8Config) -> jnp.dtype:
    """The FP8 format of gradients: E5M2 (``hybrid``) or E4M3."""
    return jnp.dtype(jnp.float8_e5m2 if fp8.format == "hybrid" else jnp.float8_e4m3fn)


class Quantized(NamedTuple):
    """An operand in FP8: values ``q`` (an FP8 dtype) and float32 ``scale`` broadcastable to them."""

    q: jax.Array
    scale: jax.Array


def _tiles(x: jax.Array, axis: int, width: int) -> jax.Array:
    """``x`` with ``axis`` split into ``(ceil(n / width), width)`` (zero-padded: zeros never raise an amax)."""
    n = x.shape[axis]
    tiles = -(-n // width)
    if tiles * width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, tiles * width - n)
        x = jnp.pad(x, pad)
    return x.reshape(*x.shape[:axis], tiles, width, *x.shape[axis + 1 :])


def amax(x: jax.Array, grain: Sequence[int]) -> jax.Array:
    """The absolute maximum of ``x`` per scale: one axis of the result per axis of ``x``, of size 1
    (``WHOLE``), ``n`` (``EACH``) or the number of tiles (a width)."""
    a = jnp.abs(x.astype(jnp.float32))
    for axis in reversed(range(x.ndim)):  # from the last axis, so splitting one leaves the earlier indices
        g = grain[axis]
        if g == WHOLE:
            a = jnp.max(a, axis=axis, keepdims=True)
        elif g != EACH:
            a = jnp.max(_tiles(a, axis, g), axis=axis + 1)
    return a


def _expand(scale: jax.Array, grain: Sequence[int], shape: Sequence[int]) -> jax.Array:
    """``scale`` (one entry per tile) repeated over each tile, cut to ``shape``."""
    for axis, g in enumerate(grain):
        if g not in (WHOLE, EACH):
            scale = jnp.repeat(scale, g, axis=axis)
            scale = jax.lax.slice_in_dim(scale, 0, shape[axis], axis=axis)
    return scale


def quantize(x: jax.Array, grain: Sequence[int], dtype: jnp.dtype, reduce: Reduce = _same) -> Quantized:
    """``x`` in FP8 ``dtype`` with one float32 scale per ``grain`` cell: ``amax / max(dtype)`` (1 for an
    all-zero cell), the amax reduced by ``reduce`` over the devices holding the rest of the cell."""
    top = float(jnp.finfo(dtype).max)
    peak = reduce(amax(x, grain))
    scale = jnp.where(peak > 0, peak / top, jnp.float32(1.0))
    # one scale for the tensor stays a scalar: XLA's GPU compiler turns a product of FP8 values times scalar
    # scales into an FP8 GEMM, and a broadcast array of scales into a float32 one
    full = scale.reshape(()) if all(g == WHOLE for g in grain) else _expand(scale, grain, x.shape)
    q = jnp.clip(x.astype(jnp.float32) / full, -top, top).astype(dtype)
    return Quantized(q, full)


def dequantize(x: Quantized) -> jax.Array:
    """Float32 values of ``x``."""
    return x.q.astype(jnp.float32) * x.scale


def qdq(x: jax.Array, grain: Sequence[int], dtype: jnp.dtype, reduce: Reduce = _same) -> jax.Array:
    """``x`` as FP8 represents it, in float32 (:func:`quantize` then :func:`dequantize`)."""
    return dequantize(quantize(x, grain, dtype, reduce))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """An einsum ``x, w -> y`` of an activation and a weight, by axis letters."""

    x: str
    w: str
    y: str

    @classmethod
    def parse(cls, spec: str) -> _Spec:
        inputs, y = spec.replace(" ", "").split("->")
        x, w = inputs.split(",")
        if "." in spec:
            raise ValueError(f"FP8 products take explicit axes, not {spec!r}")
        return cls(x, w, y)

    @property
    def contracted(self) -> str:
        return "".join(a for a in self.x if a in self.w and a not in self.y)

    def grain(self, operand: str, reduced: str, fp8: Fp8Config, *, role: str) -> tuple[int, ...]:
        """The scale granularity of ``operand`` (axis letters) in a product contracting ``reduced``."""
        if fp8.recipe in ("tensorwise", "delayed"):
            return (WHOLE,) * len(operand)
        if fp8.recipe == "rowwise":
            return tuple(WHOLE if a in reduced else EACH for a in operand)
        # blockwise: a weight's last contracted and last free axes in blocks, an activation's or gradient's
        # last contracted (``reduced``) axis in tiles; every other axis one scale per element
        tiled = [a for a in operand if a in reduced][-1:]
        if role == "weight":
            tiled += [a for a in operand if a not in reduced][-1:]
        return tuple(fp8.block if a in tiled else EACH for a in operand)


def _einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _mul(spec: str, a: Quantized, b: Quantized) -> jax.Array:
    """``einsum(spec)`` of two FP8 operands, float32 out. With one scale each, the FP8 values multiply as they
    are and the product is scaled after (the form XLA's GPU compiler runs as an FP8 GEMM; measured on an H200,
    a product of float32 values dequantized from FP8 inside the same program ran as a float32 GEMM);
    finer scales vary along the contracted axes, so those operands are dequantized first."""
    if a.scale.ndim == 0 and b.scale.ndim == 0:
        return _einsum(spec, a.q, b.q) * (a.scale * b.scale)
    return _einsum(spec, dequantize(a), dequantize(b))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 4))
def _product(spec: str, fp8: Fp8Config, x: jax.Array, w: jax.Array, reduce: Reduce) -> jax.Array:
    return _product_fwd(spec, fp8, x, w, reduce)[0]


def _operands(spec: str, fp8: Fp8Config, x: jax.Array, w: jax.Array, reduce: Reduce) -> tuple[Quantized, Quantized]:
    """The forward's operands in FP8."""
    s = _Spec.parse(spec)
    c, f8 = s.contracted, forward_dtype(fp8)
    token_wide = fp8.recipe in ("tensorwise", "delayed")  # an activation's scale spans the replicas' tokens
    xq = quantize(x, s.grain(s.x, c, fp8, role="act"), f8, reduce if token_wide else _same)
    return xq, quantize(w, s.grain(s.w, c, fp8, role="weight"), f8)


def _product_fwd(spec: str, fp8: Fp8Config, x: jax.Array, w: jax.Array, reduce: Reduce):
    xq, wq = _operands(spec, fp8, x, w, reduce)
    y = _mul(spec, xq, wq).astype(x.dtype)
    # the backward's operands: the forward's FP8 operands, except where rowwise scales along other axes
    return y, ((x, w) if fp8.recipe == "rowwise" else (xq, wq))


def _product_bwd(spec: str, fp8: Fp8Config, reduce: Reduce, res, g: jax.Array):
    x, w = res
    s = _Spec.parse(spec)
    f8, g8 = forward_dtype(fp8), gradient_dtype(fp8)
    free_w = "".join(a for a in s.w if a not in s.x)  # what dgrad contracts
    free_x = "".join(a for a in s.x if a not in s.w)  # what wgrad contracts: the tokens
    if fp8.recipe == "rowwise":
        g_dx = quantize(g, s.grain(s.y, free_w, fp8, role="grad"), g8)
        w_dx = quantize(w, s.grain(s.w, free_w, fp8, role="weight"), f8)
        g_dw = quantize(g, s.grain(s.y, free_x, fp8, role="grad"), g8, reduce)
        x_dw = quantize(x, s.grain(s.x, free_x, fp8, role="act"), f8, reduce)
    else:
        tokens = fp8.recipe != "blockwise"
        g_dx = g_dw = quantize(g, s.grain(s.y, free_w, fp8, role="grad"), g8, reduce if tokens else _same)
        w_dx, x_dw = w, x
    dx = _mul(f"{s.y},{s.w}->{s.x}", g_dx, w_dx)
    dw = _mul(f"{s.x},{s.y}->{s.w}", x_dw, g_dw)
    return dx.astype(g.dtype), dw.astype(g.dtype)  # the product's operands were in its output's dtype


_product.defvjp(_product_fwd, _product_bwd)


def product(spec: str, x: jax.Array, w: jax.Array, *, fp8: Fp8Config, reduce: Reduce = _same) -> jax.Array:
    """``einsum(spec, x, w)`` of activation ``x`` and weight ``w`` with FP8 operands, forward and backward.

    Args:
      spec: an einsum of two operands with explicit axes, e.g. ``"bsd,dhk->bshk"``.
      x: the activation (its free axes are the tokens).
      w: the weight.
      fp8: the recipe and formats.
      reduce: reduces an amax that spans tokens over the replicas held apart (the training step's
        per-replica gradients), so their scales are the whole batch's.

    Returns:
      The product in ``x``'s dtype.
    """
    if _RECORDING.get() is not None:
        _RECORDING.get().append(tuple(dequantize(o) for o in _operands(spec, fp8, x, w, reduce)))
    return _product(spec, fp8, x, w, reduce)


@dataclasses.dataclass(frozen=True)
class GroupAxes:
    """The mesh axes a grouped product's operands are spread over inside the experts' ``shard_map``.

    Attributes:
      every: all mesh axes (a whole-tensor amax is reduced over them).
      inner: the axes splitting the contracted width (an expert's hidden width over ``tensor``), for the
        second product; empty for the first.
      columns: the axes splitting the output columns (the hidden width, for the first product).
      experts: the axes splitting the experts (no two of whose devices hold the same expert).
    """

    every: tuple[str, ...] = ()
    inner: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()


def _pmax(axes: Sequence[str]) -> Reduce:
    axes = tuple(axes)
    return (lambda a: jax.lax.pmax(a, axes)) if axes else _same


def _ragged(a: jax.Array, b: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)


def _segment_amax(x: jax.Array, group: jax.Array, groups: int, reduce: Reduce) -> jax.Array:
    """Per group (rows of one expert) and column, the amax of ``x`` ``(rows, n)`` over the group's rows,
    broadcast back to every row (rows of no group get their own values' amax: zeros)."""
    peak = jax.ops.segment_max(jnp.abs(x.astype(jnp.float32)), group, num_segments=groups + 1)
    peak = reduce(jnp.maximum(peak, 0.0))
    return peak[group]


def _by_group(x: jax.Array, group: jax.Array, groups: int, dtype: jnp.dtype, reduce: Reduce) -> jax.Array:
    """``x`` ``(rows, n)`` through FP8 with one scale per group and column (a grouped weight gradient's
    operands contract each expert's rows)."""
    top = float(jnp.finfo(dtype).max)
    peak = _segment_amax(x, group, groups, reduce)
    scale = jnp.where(peak > 0, peak / top, jnp.float32(1.0))
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype).astype(jnp.float32) * scale


@partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _grouped(fp8: Fp8Config, x: jax.Array, w: jax.Array, sizes: jax.Array, group: jax.Array, axes: GroupAxes):
    return _grouped_fwd(fp8, x, w, sizes, group, axes)[0]


def _grouped_grains(fp8: Fp8Config) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Scale granularity of the rows ``(r, k)``, the weights ``(e, k, n)`` and the output's gradient ``(r, n)``."""
    if fp8.recipe in ("tensorwise", "delayed"):
        return (WHOLE, WHOLE), (EACH, WHOLE, WHOLE), (WHOLE, WHOLE)  # a scale per expert's weight
    if fp8.recipe == "rowwise":
        return (EACH, WHOLE), (EACH, WHOLE, EACH), (EACH, WHOLE)
    b = fp8.block
    return (EACH, b), (EACH, b, b), (EACH, b)


def _grouped_reduces(fp8: Fp8Config, axes: GroupAxes) -> tuple[Reduce, Reduce, Reduce]:
    """How the amaxes of the rows, the weights and the output's gradient are reduced: over every axis for a
    whole tensor (a weight: over the axes splitting it), over the axes splitting a row or a column for
    rowwise scales; blockwise tiles lie inside one device's shard."""
    if fp8.recipe in ("tensorwise", "delayed"):
        return _pmax(axes.every), _pmax(axes.inner + axes.columns), _pmax(axes.every)
    if fp8.recipe == "rowwise":
        return _pmax(axes.inner), _pmax(axes.inner), _pmax(axes.columns)
    return _same, _same, _same


def _grouped_operands(fp8: Fp8Config, x, w, axes: GroupAxes) -> tuple[jax.Array, jax.Array]:
    """The forward's operands of a grouped product as FP8 holds them."""
    rows, weights, _ = _grouped_grains(fp8)
    of_rows, of_weights, _ = _grouped_reduces(fp8, axes)
    f8 = forward_dtype(fp8)
    return qdq(x, rows, f8, of_rows), qdq(w, weights, f8, of_weights)


def _grouped_fwd(fp8: Fp8Config, x, w, sizes, group, axes: GroupAxes):
    xq, wq = _grouped_operands(fp8, x, w, axes)
    y = _ragged(xq, wq, sizes).astype(x.dtype)
    return y, ((x, w) if fp8.recipe == "rowwise" else (xq, wq), sizes, group)


def _grouped_bwd(fp8: Fp8Config, axes: GroupAxes, res, g):
    (x, w), sizes, group = res
    _, _, grads = _grouped_grains(fp8)
    _, _, of_grads = _grouped_reduces(fp8, axes)
    f8, g8 = forward_dtype(fp8), gradient_dtype(fp8)
    g_dx = qdq(g, grads, g8, of_grads)
    if fp8.recipe == "rowwise":
        w_dx = qdq(w, (EACH, EACH, WHOLE), f8, _pmax(axes.columns))  # scaled over what dgrad contracts
        # the weight gradient contracts each expert's rows, spread over every axis that holds the expert
        rows_of = _pmax(tuple(a for a in axes.every if a not in axes.experts + axes.columns + axes.inner))
        g_dw = _by_group(g, group, w.shape[0], g8, rows_of)
        x_dw = _by_group(x, group, w.shape[0], f8, rows_of)
    else:
        g_dw, w_dx, x_dw = g_dx, w, x
    dx = jax.vjp(lambda a: _ragged(a, w_dx, sizes), x.astype(jnp.float32))[1](g_dx)[0]
    dw = jax.vjp(lambda b: _ragged(x_dw, b, sizes), w.astype(jnp.float32))[1](g_dw)[0]
    return dx.astype(g.dtype), dw.astype(g.dtype), None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_product(
    x: jax.Array, w: jax.Array, sizes: jax.Array, group: jax.Array, fp8: Fp8Config, axes: GroupAxes
) -> jax.Array:
    """``ragged_dot(x, w, sizes)`` (rows grouped by expert, one weight per expert) with FP8 operands.

    Args:
      x: ``(rows, k)``, sorted by expert; rows past the groups are padding.
      w: ``(experts, k, n)``.
      sizes: rows per expert.
      group: each row's expert (``experts`` for padding rows).
      fp8: the recipe and formats.
      axes: where the operands are spread (inside the experts' ``shard_map``).
    """
    if _RECORDING.get() is not None:
        _RECORDING.get().append(_grouped_operands(fp8, x, w, axes))
    return _grouped(fp8, x, w, sizes, group, axes)


_RECORDING: contextvars.ContextVar[list[tuple[jax.Array, jax.Array]] | None] = contextvars.ContextVar(
    "fp8_recording", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[jax.Array, jax.Array]]]:
    """Collects every FP8 product's forward operands, as FP8 represents them, in call order (for tests that
    hold them equal across layouts)."""
    found: list[tuple[jax.Array, jax.Array]] = []
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)
