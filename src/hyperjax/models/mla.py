"""Multi-head latent attention (DeepSeek-V2 and V3): keys and values from one compressed latent per token.

Each token's keys and values come from a latent of ``kv_lora_rank`` dimensions (normalised), expanded per
head; the queries likewise from a latent of ``q_lora_rank`` (or directly). Rotary positions live in
``rope_head_dim`` extra dimensions per head, the keys' shared by all heads, so the latent and one small
rotary key are all a KV cache needs. Scores run over ``head_dim + rope_head_dim``, values over
``head_dim``. Heads are split over the tensor axis like any attention; the down-projections are applied
whole on every tensor-parallel rank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hyperjax.config import Fp8Config, ModelConfig
from hyperjax.models.layers import Constrain, attention_core, make_norm, param, rope, use
from hyperjax.models.taps import product


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention of ``cfg.heads`` heads (``cfg.attention: mla``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, fp8: Fp8Config | None = None) -> None:
        self.fp8 = fp8  # its projections' FP8 recipe (None: train.dtype)
        h, a, hd, rd, c = cfg.d_model, cfg.heads, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
        self.heads, self.head_dim, self.rope_dim, self.rank = a, hd, rd, c
        self.theta, self.kernel = cfg.rope_theta, cfg.attention_kernel
        self.compressed = cfg.q_lora_rank is not None
        if self.compressed:
            q = cfg.q_lora_rank
            self.q_down = param(rngs, (h, q), ("embed", None))
            self.q_norm = make_norm(cfg.norm, q, bias=cfg.bias, rngs=rngs, axis=None)
            self.q_up = param(rngs, (q, a, hd + rd), (None, "heads", "head_dim"))
        else:
            self.q_proj = param(rngs, (h, a, hd + rd), ("embed", "heads", "head_dim"))
        self.kv_down = param(rngs, (h, c + rd), ("embed", None))
        self.kv_norm = make_norm(cfg.norm, c, bias=cfg.bias, rngs=rngs, axis=None)
        self.k_up = param(rngs, (c, a, hd), (None, "heads", "head_dim"))
        self.v_up = param(rngs, (c, a, hd), (None, "heads", "head_dim"))
        self.o_proj = param(rngs, (a, hd, h), ("heads", "head_dim", "embed"), scale=0.02 / (2 * cfg.layers) ** 0.5)

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        dt, fp8 = x.dtype, {"fp8": self.fp8, "constrain": constrain}
        positions = jnp.arange(x.shape[1])
        if self.compressed:
            latent = self.q_norm(product("bsd,dr->bsr", x, use(self.q_down, constrain).astype(dt), **fp8), constrain)
            q = product("bsr,rhk->bshk", checkpoint_name(latent, "qkv"), use(self.q_up, constrain).astype(dt), **fp8)
        else:
            q = product("bsd,dhk->bshk", x, use(self.q_proj, constrain).astype(dt), **fp8)
        kv = product("bsd,dr->bsr", x, use(self.kv_down, constrain).astype(dt), **fp8)
        latent = checkpoint_name(self.kv_norm(kv[..., : self.rank], constrain), "qkv")
        k_rope = rope(kv[..., None, self.rank :], positions, self.theta)  # one rotary key for every head
        k = product("bsr,rhk->bshk", latent, use(self.k_up, constrain).astype(dt), **fp8)
        v = product("bsr,rhk->bshk", latent, use(self.v_up, constrain).astype(dt), **fp8)
        q = jnp.concatenate([q[..., : self.head_dim], rope(q[..., self.head_dim :], positions, self.theta)], -1)
        k = jnp.concatenate([k, jnp.broadcast_to(k_rope, (*k.shape[:3], self.rope_dim))], -1)
        # as in multi-head attention: queries keep their sequence shard, keys and values are gathered whole
        q = constrain(checkpoint_name(q, "qkv"), ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_heads", None))
        v = constrain(v, ("batch", "seq", "act_heads", None))
        k = constrain(checkpoint_name(k, "qkv"), ("batch", None, "act_heads", None))
        v = constrain(checkpoint_name(v, "qkv"), ("batch", None, "act_heads", None))
        out = attention_core(q, k, v, causal=True, kernel=self.kernel)
        out = constrain(checkpoint_name(out, "attn_out"), ("batch", "seq", "act_heads", None))
        return product("bshk,hkd->bsd", out, use(self.o_proj, constrain).astype(dt), **fp8)
