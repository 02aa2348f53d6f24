"""Transformer building blocks in flax NNX whose parameters carry logical axes.

Every ``nnx.Param`` is created with ``logical_axes`` metadata naming its dimensions (``embed``, ``heads``,
``mlp``, ...); a :class:`hyperjax.Strategy` turns those names into shardings. Activations are laid out
through the ``constrain`` function a model is called with. Parameters are stored in float32 and cast to
the compute dtype where they are used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hyperjax.config import GATED, AttentionKernel, Fp8Config, MLPKind, ModelConfig, Norm, RopeScaling
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

    def __init__(
        self, d: int, *, bias: bool = True, rngs: nnx.Rngs, axis: str | None = "embed", eps: float = 1e-5
    ) -> None:
        self.scale = param(rngs, (d,), (axis,), init="ones")
        if bias:
            self.bias = param(rngs, (d,), (axis,), init="zeros")
        self.use_bias, self.eps = bias, eps

    def __call__(self, x: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * use(self.scale, constrain)
        if self.use_bias:
            y = y + use(self.bias, constrain)
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a scale (Llama)."""

    def __init__(self, d: int, *, rngs: nnx.Rngs, axis: str | None = "embed", eps: float = 1e-6) -> None:
        self.scale = param(rngs, (d,), (axis,), init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps) * use(self.scale, constrain)
        return y.astype(x.dtype)


def make_norm(
    kind: Norm, d: int, *, bias: bool, rngs: nnx.Rngs, axis: str | None = "embed", eps: float | None = None
) -> LayerNorm | RMSNorm:
    """The norm a model's ``norm`` part names (``eps``: the model's ``norm_eps``; ``None``: the norm's own)."""
    given = {} if eps is None else {"eps": eps}
    if kind == "layernorm":
        return LayerNorm(d, bias=bias, rngs=rngs, axis=axis, **given)
    return RMSNorm(d, rngs=rngs, axis=axis, **given)


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The ``dim / 2`` rotary frequencies ``theta^(-2i/dim)``, stretched as ``scaling`` says (float32, as
    Hugging Face computes them, so positions rotate the same to the bit)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if scaling is None:
        return freqs.astype(np.float32)
    if scaling.type == "linear":
        return (freqs / scaling.factor).astype(np.float32)
    if scaling.type == "yarn":
        return _yarn(freqs, dim, theta, scaling)
    old = scaling.original_max_position
    wavelength = 2 * math.pi / freqs
    low, high = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    out = np.where(wavelength > low, freqs / scaling.factor, freqs)
    out = np.where((wavelength >= high) & (wavelength <= low), blended, out)
    return out.astype(np.float32)


def _yarn(freqs: np.ndarray, dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's frequencies: kept above ``beta_fast`` rotations over the original context, divided by
    ``factor`` below ``beta_slow``, blended linearly over the dimensions between (bounds rounded outwards)."""

    def dim_at(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_at(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_at(scaling.beta_slow)), dim - 1)
    high = high + 0.001 if high == low else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    kept = 1 - ramp
    return ((freqs / scaling.factor) * (1 - kept) + freqs * kept).astype(np.float32)


def rope(
    x: jax.Array,
    positions: jax.Array,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
    *,
    interleave: bool = False,
) -> jax.Array:
    """Rotary position embedding over the last dimension of ``x`` (batch, seq, heads, head_dim): dimension
    ``i`` of the first half turns with dimension ``i + half`` (Llama's pairing), or with ``interleave``
    dimension ``2i`` with ``2i + 1`` (DeepSeek's; returned as Hugging Face does, the pairs' first members
    then their second members, which leaves every product of rotated queries and keys the same)."""
    half = x.shape[-1] // 2
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    freqs = jnp.asarray(rope_frequencies(x.shape[-1], theta, scaling))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (seq, half)
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    if scaling is not None and scaling.attention_factor != 1.0:  # YaRN scales the rotated vectors
        sin, cos = sin * scaling.attention_factor, cos * scaling.attention_factor
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def attention_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    kernel: AttentionKernel,
    scale: float | None = None,
    start: jax.Array | None = None,
) -> jax.Array:
    """``softmax(q k^T / sqrt(d)) v`` for queries ``(b, t, heads, d)`` over keys ``(b, s, kv_heads, d)`` and values
    ``(b, s, kv_heads, dv)`` (each key/value head serves ``heads / kv_heads`` query heads); ``scale``, when
    given, multiplies the scores instead of ``1 / sqrt(d)``. Causal attention lets each query see the keys up
    to its own position: the queries sit at the keys' positions (``t == s``), or, given ``start``, at
    ``start, start + 1, ..`` of keys from position 0 (a decode step over its cache).

    ``materialized`` computes the scores and probabilities as arrays (the probabilities tagged ``attn_core``
    for rematerialisation policies); ``flash`` calls :func:`jax.nn.dot_product_attention`, which XLA runs
    as a fused kernel where the backend has one (cuDNN on GPUs) and as the same arithmetic elsewhere.
    """
    t, d = q.shape[1], q.shape[3]
    if causal and start is None and t != k.shape[1]:
        raise ValueError(
            f"attention_core: {t} queries over {k.shape[1]} keys; causal attention of queries that continue the "
            "keys needs start=, the first query's position"
        )
    if kernel == "flash":
        if start is not None:
            raise ValueError(
                "attention_core: the flash kernel attends queries at the keys' positions; pass start=None, or use "
                'kernel="materialized" for queries from a start position'
            )
        dv = v.shape[-1]
        if dv != d:  # the fused kernel takes one head width: values padded to the queries' and keys'
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv)))
        return jax.nn.dot_product_attention(q, k, v, scale=scale or 1.0 / d**0.5, is_causal=causal)[..., :dv]
    scores = grouped_scores(q, k).astype(jnp.float32)
    scores = scores * scale if scale is not None else scores / jnp.sqrt(jnp.float32(d))
    if causal:
        positions = jnp.arange(t) if start is None else start + jnp.arange(t)
        visible = jnp.arange(k.shape[1])[None, None, :] <= positions[:, None, None]  # (query, group, key)
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    return grouped_values(softmax_kept(scores, v.dtype), v)


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def softmax_kept(scores: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The softmax of ``scores`` over their last axis, in ``dtype``: the attention core's probabilities, tagged
    ``attn_core``, and the one value its derivative reads.

    :func:`jax.nn.softmax`'s derivative reads a float32 output of its own, which no name tags: under a
    rematerialisation policy that keeps ``attn_core`` the backward pass re-ran the scores' product to
    rebuild it, in every block. Here the tagged probabilities are that value (in ``dtype``, as PyTorch's
    softmax backward reads its 16-bit output), so keeping them re-runs nothing."""
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


@softmax_kept.defjvp
def _softmax_kept_jvp(dtype: jnp.dtype, primals: tuple[jax.Array], tangents: tuple[jax.Array]):
    (scores,), (ds,) = primals, tangents
    probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(dtype), "attn_core")
    p = probs.astype(scores.dtype)
    return probs, (p * (ds - jnp.sum(p * ds, axis=-1, keepdims=True))).astype(dtype)


def grouped_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """The scores ``(b, kv_heads, t, group, s)`` of queries ``(b, t, heads, d)`` against keys ``(b, s, kv_heads,
    d)``, each key head met by its ``group = heads / kv_heads`` query heads.

    The axes are those the product gives (its batch axes, then the queries' free axes, then the keys'), so
    the program transposes no score matrix, forward or backward. Laid out ``(b, kv, group, t, s)``, the
    scores of a grouped-query model were transposed, and its probabilities and their gradients with them:
    on an H200, the four kernels a block that fused those transposes with the softmax's passes took 167 of
    the 325 ms a TinyLlama-shaped step spent in kernels (``benchmarks/gpu_step_profile.py``).
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    return jax.lax.dot_general(q, k, (((4,), (3,)), ((0, 2), (0, 2))))


def grouped_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """``(b, t, heads, dv)``: probabilities ``(b, kv_heads, t, group, s)`` (:func:`grouped_scores`'s layout)
    times values ``(b, s, kv_heads, dv)``."""
    b, kv, t, g, _ = probs.shape
    out = jax.lax.dot_general(probs, v, (((4,), (1,)), ((0, 1), (0, 2))))  # (b, kv, t, group, dv)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, kv * g, v.shape[-1])


class Attention(nnx.Module):
    """Causal (or, for an encoder, bidirectional) multi-head or grouped-query attention of ``cfg.heads`` heads
    of ``cfg.head_dim``: the projections are Megatron column/row splits, with biases as ``cfg.bias`` and
    ``cfg.qkv_bias`` say, queries and keys normalised per head under ``cfg.qk_norm``, and rotary positions
    under ``cfg.positions: rope``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        causal: bool = True,
        fp8: Fp8Config | None = None,
    ) -> None:
        d_model, heads, kv_heads, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.fp8 = fp8  # its projections' FP8 recipe (None: train.dtype)
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.rope_scaling, self.rope_interleave = cfg.rope_scaling, cfg.rope_interleave
        self.kernel = cfg.attention_kernel
        self.q_proj = param(rngs, (d_model, heads, hd), ("embed", "heads", "head_dim"))
        self.k_proj = param(rngs, (d_model, kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        self.v_proj = param(rngs, (d_model, kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        # GPT-2 scales the residual projections by 1/sqrt(2 * layers)
        self.o_proj = param(
            rngs, (heads, hd, d_model), ("heads", "head_dim", "embed"), scale=0.02 / (2 * cfg.layers) ** 0.5
        )
        if cfg.qkv_bias:
            self.q_bias = param(rngs, (heads, hd), ("heads", "head_dim"), init="zeros")
            self.k_bias = param(rngs, (kv_heads, hd), ("kv_heads", "head_dim"), init="zeros")
            self.v_bias = param(rngs, (kv_heads, hd), ("kv_heads", "head_dim"), init="zeros")
        if cfg.bias:
            self.o_bias = param(rngs, (d_model,), ("embed",), init="zeros")
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.norm, hd, bias=cfg.bias, rngs=rngs, axis=None, eps=cfg.norm_eps)
            self.k_norm = make_norm(cfg.norm, hd, bias=cfg.bias, rngs=rngs, axis=None, eps=cfg.norm_eps)
        self.qkv_bias, self.bias, self.qk_norm = cfg.qkv_bias, cfg.bias, cfg.qk_norm

    def project(
        self, x: jax.Array, constrain: Constrain, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values ``(batch, seq, heads, head_dim)`` of ``x`` at ``positions``: projected,
        biased, normalised per head and rotated, as the model's parts say."""
        dt, fp8 = x.dtype, {"fp8": self.fp8, "constrain": constrain}
        q = product("bsd,dhk->bshk", x, use(self.q_proj, constrain).astype(dt), **fp8)
        k = product("bsd,dhk->bshk", x, use(self.k_proj, constrain).astype(dt), **fp8)
        v = product("bsd,dhk->bshk", x, use(self.v_proj, constrain).astype(dt), **fp8)
        if self.qkv_bias:
            q, k, v = (
                q + use(self.q_bias, constrain).astype(dt),
                k + use(self.k_bias, constrain).astype(dt),
                v + use(self.v_bias, constrain).astype(dt),
            )
        if self.qk_norm:
            q, k = self.q_norm(q, constrain), self.k_norm(k, constrain)
        if self.rope_theta is not None:
            q = rope(q, positions, self.rope_theta, self.rope_scaling, interleave=self.rope_interleave)
            k = rope(k, positions, self.rope_theta, self.rope_scaling, interleave=self.rope_interleave)
        return q, k, v

    def output(self, out: jax.Array, constrain: Constrain) -> jax.Array:
        """The output projection of the heads' results ``(batch, seq, heads, head_dim)``."""
        dt = out.dtype
        y = product("bshk,hkd->bsd", out, use(self.o_proj, constrain).astype(dt), fp8=self.fp8, constrain=constrain)
        if self.bias:
            y = y + use(self.o_bias, constrain).astype(dt)
        return y

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        q, k, v = self.project(x, constrain, jnp.arange(x.shape[1]))
        # queries keep their sequence shard (context parallel); keys and values are projected on the local
        # shard (so their weight gradients stay local too) and then gathered whole
        q = constrain(checkpoint_name(q, "qkv"), ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        k = constrain(checkpoint_name(k, "qkv"), ("batch", None, "act_kv_heads", None))
        v = constrain(checkpoint_name(v, "qkv"), ("batch", None, "act_kv_heads", None))
        out = attention_core(q, k, v, causal=self.causal, kernel=self.kernel)
        out = constrain(checkpoint_name(out, "attn_out"), ("batch", "seq", "act_heads", None))
        return self.output(out, constrain)


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
