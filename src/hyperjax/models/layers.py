"""Transformer building blocks in flax NNX whose parameters carry logical axes.

Every ``nnx.Param`` is created with ``logical_axes`` metadata naming its dimensions (``embed``, ``heads``,
``mlp``, ...); a :class:`hyperjax.Strategy` turns those names into shardings. Activations are laid out
through the ``constrain`` function a model is called with. Parameters are stored in float32 and cast to
the compute dtype where they are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hyperjax.config import GATED, AttentionKernel, Fp8Config, MLPKind, Norm
from hyperjax.models.taps import product

Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


def no_constraint(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """The ``constrain`` of a single-device run: leaves ``x`` where it is."""
    return x


def param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    axes: tuple[str | None, ...],
    *,
    scale: float | None = None,
    init: str = "normal",
) -> nnx.Param:
    """A float32 parameter with logical axes: ``normal`` (std ``scale``, default 0.02), ``ones`` or ``zeros``."""
    if init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = (0.02 if scale is None else scale) * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=axes)


# the activation-side name of each parameter dimension: what a weight is laid out as where it is used
_IN_USE = {
    "embed": "act_embed",
    "heads": "act_heads",
    "kv_heads": "act_kv_heads",
    "mlp": "act_mlp",
    "vocab": "act_vocab",
}


def use(p: nnx.Param, constrain: Constrain) -> jax.Array:
    """The value of ``p`` laid out for use: gathered over the axes that only store it (FSDP, ZeRO-3).

    Each weight is gathered whole before its op, as FSDP prescribes. Left to itself, XLA sometimes keeps
    a weight sharded and reshards the (much larger) activations around it instead.
    """
    return constrain(p[...], tuple(_IN_USE.get(a) for a in p.logical_axes))


class LayerNorm(nnx.Module):
    """LayerNorm with a scale and, with ``bias``, a shift (over a dimension of logical axis ``axis``)."""

    def __init__(self, d: int, *, bias: bool = True, rngs: nnx.Rngs, axis: str | None = "embed") -> None:
        self.scale = param(rngs, (d,), (axis,), init="ones")
        if bias:
            self.bias = param(rngs, (d,), (axis,), init="zeros")
        self.use_bias = bias

    def __call__(self, x: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * use(self.scale, constrain)
        if self.use_bias:
            y = y + use(self.bias, constrain)
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a scale (Llama)."""

    def __init__(self, d: int, *, rngs: nnx.Rngs, axis: str | None = "embed") -> None:
        self.scale = param(rngs, (d,), (axis,), init="ones")

    def __call__(self, x: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + 1e-6) * use(self.scale, constrain)
        return y.astype(x.dtype)


def make_norm(kind: Norm, d: int, *, bias: bool, rngs: nnx.Rngs, axis: str | None = "embed") -> LayerNorm | RMSNorm:
    """The norm a model's ``norm`` part names."""
    return LayerNorm(d, bias=bias, rngs=rngs, axis=axis) if kind == "layernorm" else RMSNorm(d, rngs=rngs, axis=axis)


def rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding over the last dimension of ``x`` (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (seq, half)
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, kernel: AttentionKernel) -> jax.Array:
    """``softmax(q k^T / sqrt(d)) v`` for queries ``(b, s, heads, d)`` over keys ``(b, s, kv_heads, d)`` and values
    ``(b, s, kv_heads, dv)`` (each key/value head serves ``heads / kv_heads`` query heads).

    ``materialized`` computes the scores and probabilities as arrays (the probabilities tagged ``attn_core``
    for rematerialisation policies); ``flash`` calls :func:`jax.nn.dot_product_attention`, which XLA runs
    as a fused kernel where the backend has one (cuDNN on GPUs) and as the same arithmetic elsewhere.
    """
    b, s, h, d = q.shape
    if kernel == "flash":
        dv = v.shape[-1]
        if dv != d:  # the fused kernel takes one head width: values padded to the queries' and keys'
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv)))
        return jax.nn.dot_product_attention(q, k, v, scale=1.0 / d**0.5, is_causal=causal)[..., :dv]
    kv = k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    if causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(v.dtype), "attn_core")
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, h, v.shape[-1])


class Attention(nnx.Module):
    """Causal (or, for an encoder, bidirectional) multi-head or grouped-query attention of ``heads`` heads of
    ``head_dim``; the projections are Megatron column/row splits, rotary positions when ``rope_theta`` is set."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        rope_theta: float | None,
        layers: int,
        rngs: nnx.Rngs,
        causal: bool = True,
        kernel: AttentionKernel = "materialized",
        fp8: Fp8Config | None = None,
    ) -> None:
        hd = head_dim
        self.fp8 = fp8  # its projections' FP8 recipe (None: train.dtype)
        self.heads, self.kv_heads, self.rope_theta, self.causal = heads, kv_heads, rope_theta, causal
        self.kernel = kernel
        self.q_proj = param(rngs, (d_model, heads, hd), ("embed", "heads", "head_dim"))
        self.k_proj = param(rngs, (d_model, kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        self.v_proj = param(rngs, (d_model, kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        # GPT-2 scales the residual projections by 1/sqrt(2 * layers)
        self.o_proj = param(
            rngs, (heads, hd, d_model), ("heads", "head_dim", "embed"), scale=0.02 / (2 * layers) ** 0.5
        )
        if bias:
            self.q_bias = param(rngs, (heads, hd), ("heads", "head_dim"), init="zeros")
            self.k_bias = param(rngs, (kv_heads, hd), ("kv_heads", "head_dim"), init="zeros")
            self.v_bias = param(rngs, (kv_heads, hd), ("kv_heads", "head_dim"), init="zeros")
            self.o_bias = param(rngs, (d_model,), ("embed",), init="zeros")
        self.bias = bias

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        dt, fp8 = x.dtype, {"fp8": self.fp8, "constrain": constrain}
        q = product("bsd,dhk->bshk", x, use(self.q_proj, constrain).astype(dt), **fp8)
        k = product("bsd,dhk->bshk", x, use(self.k_proj, constrain).astype(dt), **fp8)
        v = product("bsd,dhk->bshk", x, use(self.v_proj, constrain).astype(dt), **fp8)
        if self.bias:
            q, k, v = (
                q + use(self.q_bias, constrain).astype(dt),
                k + use(self.k_bias, constrain).astype(dt),
                v + use(self.v_bias, constrain).astype(dt),
            )
        if self.rope_theta is not None:
            positions = jnp.arange(x.shape[1])
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        # queries keep their sequence shard (context parallel); keys and values are projected on the local
        # shard (so their weight gradients stay local too) and then gathered whole
        q = constrain(checkpoint_name(q, "qkv"), ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        k = constrain(checkpoint_name(k, "qkv"), ("batch", None, "act_kv_heads", None))
        v = constrain(checkpoint_name(v, "qkv"), ("batch", None, "act_kv_heads", None))
        out = attention_core(q, k, v, causal=self.causal, kernel=self.kernel)
        out = constrain(checkpoint_name(out, "attn_out"), ("batch", "seq", "act_heads", None))
        y = product("bshk,hkd->bsd", out, use(self.o_proj, constrain).astype(dt), **fp8)
        if self.bias:
            y = y + use(self.o_bias, constrain).astype(dt)
        return y


def activate(kind: MLPKind, h: jax.Array, gate: jax.Array | None) -> jax.Array:
    """The MLP's nonlinearity on the up-projection ``h``: ``act(gate) * h`` for the gated kinds."""
    if kind in GATED:
        act = jax.nn.silu if kind == "swiglu" else partial(jax.nn.gelu, approximate=True)
        return act(checkpoint_name(gate, "mlp_hidden")) * h
    return jax.nn.relu(h) if kind == "relu" else jax.nn.gelu(h, approximate=True)


class MLP(nnx.Module):
    """The MLP of a block: ``gelu`` or ``relu`` (input and output matrices), or the gated ``swiglu`` and
    ``geglu`` (an input, a gate and an output matrix). The input projections are column-split, the output
    row-split."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        kind: MLPKind,
        bias: bool,
        layers: int,
        rngs: nnx.Rngs,
        fp8: Fp8Config | None = None,
    ) -> None:
        self.kind, self.gated, self.bias, self.fp8 = kind, kind in GATED, bias, fp8
        self.w_in = param(rngs, (d_model, d_ff), ("embed", "mlp"))
        if self.gated:
            self.w_gate = param(rngs, (d_model, d_ff), ("embed", "mlp"))
        self.w_out = param(rngs, (d_ff, d_model), ("mlp", "embed"), scale=0.02 / (2 * layers) ** 0.5)
        if bias:
            self.b_in = param(rngs, (d_ff,), ("mlp",), init="zeros")
            if self.gated:
                self.b_gate = param(rngs, (d_ff,), ("mlp",), init="zeros")
            self.b_out = param(rngs, (d_model,), ("embed",), init="zeros")

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        dt, fp8 = x.dtype, {"fp8": self.fp8, "constrain": constrain}
        h = product("bsd,df->bsf", x, use(self.w_in, constrain).astype(dt), **fp8)
        if self.bias:
            h = h + use(self.b_in, constrain).astype(dt)
        h = checkpoint_name(h, "mlp_hidden")  # the up-projection's output; the gate's is tagged in activate
        gate = None
        if self.gated:
            gate = product("bsd,df->bsf", x, use(self.w_gate, constrain).astype(dt), **fp8)
            if self.bias:
                gate = gate + use(self.b_gate, constrain).astype(dt)
        h = constrain(checkpoint_name(activate(self.kind, h, gate), "mlp_act"), ("batch", "seq", "act_mlp"))
        y = product("bsf,fd->bsd", h, use(self.w_out, constrain).astype(dt), **fp8)
        if self.bias:
            y = y + use(self.b_out, constrain).astype(dt)
        return y


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Each token's next-token cross-entropy, ``logsumexp(logits) - logits[target]`` (what optax's
    ``softmax_cross_entropy_with_integer_labels`` computes, to the bit).

    The target's logit is picked by a masked sum over the vocabulary rather than a gather: XLA's SPMD
    partitioner aborts on a gather along a sharded vocabulary inside a ``shard_map`` over the data axes
    (the training step's per-replica gradients), and a sum of one value and zeros is exact in any order.
    """
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked
