"""Generation with a KV cache: prefill the prompt, then decode one token per step.

The cache holds every layer's keys and values, ``(batch, max_len, kv_heads, head_dim)`` each, laid out like
the activations (batch over the data axes, KV heads over the tensor axis). A step embeds its tokens at
their positions, writes their keys and values into the cache at ``pos`` and attends over the cache up to
each query's own position; the rest of the block is the training model's own code. Prefill is the same
step over the whole prompt, so the first decode step's logits are the training model's for that prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyperjax.errors import ConfigError
from hyperjax.models.layers import Attention, Constrain, no_constraint, rope, use
from hyperjax.models.taps import product
from hyperjax.models.transformer import Block, Transformer, logits, lookup


class LayerCache(NamedTuple):
    """One layer's cached keys and values, ``(batch, max_len, kv_heads, head_dim)``."""

    k: jax.Array
    v: jax.Array


def init_cache(model: Transformer, batch: int, max_len: int) -> list[LayerCache]:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens.

    Raises:
      ConfigError: a model whose attention the cache does not cover (latent attention).
    """
    cfg = model.cfg
    if cfg.attention != "mha":
        raise ConfigError(f"generation covers model.attention: mha; this model has {cfg.attention!r}")
    shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
    dt = jnp.dtype(model.dtype)
    return [LayerCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.layers)]


def _attend(attn: Attention, x: jax.Array, constrain: Constrain, cache: LayerCache, pos: jax.Array):
    """``attn`` on ``x`` (tokens at positions ``pos ..``), its keys and values written into ``cache``."""
    dt = x.dtype
    q = product("bsd,dhk->bshk", x, use(attn.q_proj, constrain).astype(dt))
    k = product("bsd,dhk->bshk", x, use(attn.k_proj, constrain).astype(dt))
    v = product("bsd,dhk->bshk", x, use(attn.v_proj, constrain).astype(dt))
    if attn.bias:
        q = q + use(attn.q_bias, constrain).astype(dt)
        k = k + use(attn.k_bias, constrain).astype(dt)
        v = v + use(attn.v_bias, constrain).astype(dt)
    t = x.shape[1]
    positions = pos + jnp.arange(t)
    if attn.rope_theta is not None:
        q, k = rope(q, positions, attn.rope_theta), rope(k, positions, attn.rope_theta)
    layout = ("batch", None, "act_kv_heads", None)
    ks = constrain(jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, pos, 0, 0)), layout)
    vs = constrain(jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, pos, 0, 0)), layout)
    b, _, h, d = q.shape
    kv = ks.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, ks).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    visible = jnp.arange(ks.shape[1])[None, :] <= positions[:, None]  # (query, key)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(vs.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, vs).reshape(b, t, h, vs.shape[-1])
    out = constrain(out, ("batch", "seq", "act_heads", None))
    y = product("bshk,hkd->bsd", out, use(attn.o_proj, constrain).astype(dt))
    if attn.bias:
        y = y + use(attn.o_bias, constrain).astype(dt)
    return y, LayerCache(ks, vs)


def _block(block: Block, x: jax.Array, constrain: Constrain, cache: LayerCache, pos: jax.Array):
    """:meth:`Block.__call__` with cached attention."""
    if block.parallel:
        h = constrain(block.norm(x, constrain), ("batch", "seq", "act_embed"))
        y, _ = block._mlp(h, constrain)
        a, cache = _attend(block.attn, h, constrain, cache, pos)
        x = x + a + y
    else:
        a, cache = _attend(block.attn, block.norm1(x, constrain), constrain, cache, pos)
        x = constrain(x + a, ("batch", "res_seq", "act_embed"))
        y, _ = block._mlp(block.norm2(x, constrain), constrain)
        x = x + y
    return constrain(x, ("batch", "res_seq", "act_embed")), cache


def step(
    model: Transformer, tokens: jax.Array, cache: list[LayerCache], pos: jax.Array, constrain: Constrain = no_constraint
) -> tuple[jax.Array, list[LayerCache]]:
    """Logits ``(batch, t, vocab)`` of ``tokens`` ``(batch, t)`` at positions ``pos .. pos + t - 1``, and the
    cache with their keys and values."""
    dt = jnp.dtype(model.dtype)
    x = lookup(use(model.embed, constrain), tokens, constrain).astype(dt)
    if model.cfg.positions == "learned":
        table = use(model.pos_embed, constrain).astype(dt)
        x = x + jax.lax.dynamic_slice_in_dim(table, pos, tokens.shape[1], axis=0)
    x = constrain(x, ("batch", "res_seq", "act_embed"))
    out = []
    for block, layer in zip(model.blocks, cache, strict=True):
        x, layer = _block(block, x, constrain, layer, pos)
        out.append(layer)
    return logits(model, model.head, x, constrain), out


class Generation(NamedTuple):
    """What :func:`generate` gives back.

    Attributes:
      tokens: the new tokens, ``(batch, max_new_tokens)``: each sequence's continuation of its own prompt.
      first_logits: the logits that chose the first new token of the shortest prompts, ``(batch, vocab)``.
      prefill_s: the prompt's pass (compiled beforehand, so compilation is not in it).
      decode_s: every later step, each a token of every sequence (compiled beforehand).
      steps: the decode steps run.
    """

    tokens: jax.Array
    first_logits: jax.Array
    prefill_s: float
    decode_s: float
    steps: int


def generate(
    model: Transformer,
    prompt: jax.Array,
    max_new_tokens: int,
    *,
    lengths: Sequence[int] | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    constrain: Constrain = no_constraint,
) -> Generation:
    """``max_new_tokens`` tokens after each prompt: greedy at ``temperature`` 0, else sampled from the softmax
    at that temperature over the ``top_k`` likeliest.

    ``prompt`` is ``(batch, width)``; row ``b`` holds a prompt of ``lengths[b]`` tokens (default: all
    ``width``), padded on the right. The batch is prefilled to the shortest prompt; a longer prompt's
    remaining tokens are fed at the steps that reach them instead of sampled ones, so every sequence sees
    exactly its own prompt and the cache never holds padding.
    """
    b, width = prompt.shape
    lengths = np.full(b, width) if lengths is None else np.asarray(lengths)
    shortest, total = int(lengths.min()), int(lengths.max()) + max_new_tokens
    graphdef, state = nnx.split(model)
    given = jnp.asarray(np.pad(np.asarray(prompt), ((0, 0), (0, total - width))), jnp.int32)

    @jax.jit
    def prefill(state, prompt):
        m = nnx.merge(graphdef, state)
        out, cache = step(m, prompt, init_cache(m, b, total), jnp.int32(0), constrain)
        return out[:, -1], cache

    @jax.jit
    def advance(state, token, cache, pos):
        m = nnx.merge(graphdef, state)
        out, cache = step(m, token[:, None], cache, pos, constrain)
        return out[:, -1], cache

    @jax.jit
    def choose(logits_: jax.Array, key: jax.Array, pos: jax.Array) -> jax.Array:
        """The token at ``pos``: the prompt's own where it has one, else picked from ``logits_``."""
        if temperature == 0:
            picked = jnp.argmax(logits_, axis=-1).astype(jnp.int32)
        else:
            scaled = logits_ / temperature
            if top_k is not None:
                floor = jax.lax.top_k(scaled, top_k)[0][..., -1:]
                scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
            picked = jax.random.categorical(key, scaled).astype(jnp.int32)
        own = jax.lax.dynamic_index_in_dim(given, pos, axis=1, keepdims=False)
        return jnp.where(pos < jnp.asarray(lengths), own, picked)

    head = prompt[:, :shortest]
    fill = prefill.lower(state, head).compile()
    start = time.perf_counter()
    first, cache = jax.block_until_ready(fill(state, head))
    prefill_s = time.perf_counter() - start
    steps = total - shortest - 1
    key = jax.random.key(seed)
    pick = choose.lower(first, key, jnp.int32(shortest)).compile()
    token = pick(first, key, jnp.int32(shortest))
    forward = advance.lower(state, token, cache, jnp.int32(shortest)).compile()
    out, current = [], first
    start = time.perf_counter()
    for pos in range(shortest, total):
        key, sub = jax.random.split(key)
        token = pick(current, sub, jnp.int32(pos))
        out.append(token)
        if pos + 1 < total:
            current, cache = forward(state, token, cache, jnp.int32(pos))
    tokens = jax.block_until_ready(jnp.stack(out, axis=1))
    decode_s = time.perf_counter() - start
    rows = np.asarray(tokens)
    mine = np.stack([rows[i, n - shortest : n - shortest + max_new_tokens] for i, n in enumerate(lengths)])
    return Generation(jnp.asarray(mine), first, prefill_s, decode_s, steps)
