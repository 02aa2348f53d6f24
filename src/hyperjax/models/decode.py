"""Generation with a KV cache: prefill the prompt, then decode one token per step.

The cache holds every layer's keys and values, ``(batch, max_len, kv_heads, head_dim)`` each, laid out like
the activations (batch over the data axes, KV heads over the tensor axis); under latent attention, the
latent and the one rotary key, from which every head's keys and values are made at each step. A step
embeds its tokens at their positions, writes their keys and values into the cache at ``pos`` and attends
over the cache up to each query's own position; the rest of the block is the training model's own code.
Prefill is the same step over the whole prompt, so the first decode step's logits are the training model's
for that prefix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyperjax.config import ModelConfig
from hyperjax.models.layers import Attention, Constrain, attention_core, no_constraint, use
from hyperjax.models.mla import LatentAttention
from hyperjax.models.transformer import Block, Transformer, logits, lookup


class LayerCache(NamedTuple):
    """One layer's cache: keys and values ``(batch, max_len, kv_heads, head_dim)``; under latent attention
    the latent ``(batch, max_len, 1, kv_lora_rank)`` and the rotary key ``(batch, max_len, 1, rope_head_dim)``."""

    k: jax.Array
    v: jax.Array


def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one layer's cached keys and values (:class:`LayerCache`; ``ModelConfig.cached``)."""
    (k_heads, k_width), (v_heads, v_width) = cfg.cached
    return (batch, max_len, k_heads, k_width), (batch, max_len, v_heads, v_width)


CACHE_LAYOUTS: dict[str, tuple[str | None, ...]] = {
    "mha": ("batch", None, "act_kv_heads", None),
    "mla": ("batch", None, None, None),
}
"""The logical axes of a layer's cached arrays, by ``model.attention``: the batch over the data axes and the KV
heads over the tensor axis; under latent attention every tensor device keeps the whole latent and rotary key."""


def cache_bytes(
    cfg: ModelConfig, dtype: Any, batch: int, max_len: int, ways: Callable[[str | None], int] | None = None
) -> int:
    """Bytes of :func:`init_cache`'s cache, every layer's, for ``batch`` sequences of up to ``max_len`` tokens of
    ``dtype``; with ``ways`` (the devices a logical axis of :data:`CACHE_LAYOUTS` is split over), what one device
    holds of it: each dimension divided by its axis's ways, rounded up."""
    split = lambda n, axis: -(-n // ways(axis)) if ways is not None else n
    layout = CACHE_LAYOUTS[cfg.attention]
    held = sum(math.prod(map(split, shape, layout)) for shape in cache_shapes(cfg, batch, max_len))
    return cfg.layers * held * jnp.dtype(dtype).itemsize


def init_cache(model: Transformer, batch: int, max_len: int) -> list[LayerCache]:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens."""
    dt = jnp.dtype(model.dtype)
    k, v = cache_shapes(model.cfg, batch, max_len)
    return [LayerCache(jnp.zeros(k, dt), jnp.zeros(v, dt)) for _ in range(model.cfg.layers)]


def _attend(attn: Attention | LatentAttention, x: jax.Array, constrain: Constrain, cache: LayerCache, pos: jax.Array):
    """``attn`` on ``x`` (tokens at positions ``pos ..``), what it caches written into ``cache``."""
    t = x.shape[1]
    positions = pos + jnp.arange(t)
    write = lambda c, new, layout: constrain(
        jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (0, pos, 0, 0)), layout
    )
    if isinstance(attn, LatentAttention):  # the latent and the rotary key are cached, keys and values made
        q, latent, k_rope = attn.compress(x, constrain, positions)
        layout = CACHE_LAYOUTS["mla"]
        cache = LayerCache(write(cache.k, latent[:, :, None], layout), write(cache.v, k_rope, layout))
        ks, vs = attn.expand(cache.k[:, :, 0], cache.v, constrain)
        ks = constrain(ks, ("batch", None, "act_heads", None))
        vs = constrain(vs, ("batch", None, "act_heads", None))
    else:
        q, k, v = attn.project(x, constrain, positions)
        layout = CACHE_LAYOUTS["mha"]
        cache = LayerCache(write(cache.k, k, layout), write(cache.v, v, layout))
        ks, vs = cache
    scale = attn.score_scale if isinstance(attn, LatentAttention) else None
    out = attention_core(q, ks, vs, causal=True, kernel="materialized", scale=scale, start=pos)
    out = constrain(out, ("batch", "seq", "act_heads", None))
    return attn.output(out, constrain), cache


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


def sample_token(logits_: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """A token per row of ``logits_`` ``(batch, vocab)``: the likeliest at ``temperature`` 0, else drawn from the
    softmax at ``temperature`` over the ``top_k`` likeliest (all when ``None``)."""
    if temperature == 0:
        return jnp.argmax(logits_, axis=-1).astype(jnp.int32)
    scaled = logits_ / temperature
    if top_k is not None:
        floor = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
    return jax.random.categorical(key, scaled).astype(jnp.int32)


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
        picked = sample_token(logits_, key, temperature, top_k)
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
