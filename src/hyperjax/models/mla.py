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
        self.theta, self.scaling, self.kernel = cfg.rope_theta, cfg.rope_scaling, cfg.attention_kernel
        self.interleave = cfg.rope_interleave
        boost = cfg.rope_scaling.latent_score_scale if cfg.rope_scaling is not None else 1.0
        self.score_scale = boost / (hd + rd) ** 0.5  # what multiplies the scores (DeepSeek-V3's YaRN squares mscale)
        self.compressed = cfg.q_lora_rank is not None
        if self.compressed:
            q = cfg.q_lora_rank
            self.q_down = param(rngs, (h, q), ("embed", None))
            self.q_norm = make_norm(cfg.norm, q, bias=cfg.bias, rngs=rngs, axis=None, eps=cfg.norm_eps)
            self.q_up = param(rngs, (q, a, hd + rd), (None, "heads", "head_dim"))
        else:
            self.q_proj = param(rngs, (h, a, hd + rd), ("embed", "heads", "head_dim"))
        self.kv_down = param(rngs, (h, c + rd), ("embed", None))
        self.kv_norm = make_norm(cfg.norm, c, bias=cfg.bias, rngs=rngs, axis=None, eps=cfg.norm_eps)
        self.k_up = param(rngs, (c, a, hd), (None, "heads", "head_dim"))
        self.v_up = param(rngs, (c, a, hd), (None, "heads", "head_dim"))
        self.o_proj = param(rngs, (a, hd, h), ("heads", "head_dim", "embed"), scale=0.02 / (2 * cfg.layers) ** 0.5)

    def compress(
        self, x: jax.Array, constrain: Constrain, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The rotated queries ``(batch, seq, heads, head_dim + rope_head_dim)``, the normalised latent
        ``(batch, seq, kv_lora_rank)`` and the one rotary key ``(batch, seq, 1, rope_head_dim)`` of ``x`` at
        ``positions``: all a KV cache of latent attention holds are the latent and the rotary key."""
        dt, fp8 = x.dtype, {"fp8": self.fp8, "constrain": constrain}
        if self.compressed:
            # the down-projections' outputs are what a block keeps (``qkv``): the norms and the rotary key
            # are rebuilt from them element-wise, where keeping the normalised latents re-ran both products
            down = checkpoint_name(product("bsd,dr->bsr", x, use(self.q_down, constrain).astype(dt), **fp8), "qkv")
            latent = self.q_norm(down, constrain)
            q = product("bsr,rhk->bshk", latent, use(self.q_up, constrain).astype(dt), **fp8)
        else:
            q = product("bsd,dhk->bshk", x, use(self.q_proj, constrain).astype(dt), **fp8)
        kv = checkpoint_name(product("bsd,dr->bsr", x, use(self.kv_down, constrain).astype(dt), **fp8), "qkv")
        latent = self.kv_norm(kv[..., : self.rank], constrain)
        turn = lambda t: rope(t, positions, self.theta, self.scaling, interleave=self.interleave)
        k_rope = turn(kv[..., None, self.rank :])  # one rotary key for every head
        q = jnp.concatenate([q[..., : self.head_dim], turn(q[..., self.head_dim :])], -1)
        return q, latent, k_rope

    def expand(self, latent: jax.Array, k_rope: jax.Array, constrain: Constrain) -> tuple[jax.Array, jax.Array]:
        """Every head's keys ``(.., heads, head_dim + rope_head_dim)`` and values ``(.., heads, head_dim)``
        from the latent and the rotary key."""
        dt, fp8 = latent.dtype, {"fp8": self.fp8, "constrain": constrain}
        k = product("bsr,rhk->bshk", latent, use(self.k_up, constrain).astype(dt), **fp8)
        v = product("bsr,rhk->bshk", latent, use(self.v_up, constrain).astype(dt), **fp8)
        k = jnp.concatenate([k, jnp.broadcast_to(k_rope, (*k.shape[:3], self.rope_dim))], -1)
        return k, v

    def output(self, out: jax.Array, constrain: Constrain) -> jax.Array:
        """The output projection of the heads' results ``(batch, seq, heads, head_dim)``."""
        w = use(self.o_proj, constrain).astype(out.dtype)
        return product("bshk,hkd->bsd", out, w, fp8=self.fp8, constrain=constrain)

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        q, latent, k_rope = self.compress(x, constrain, jnp.arange(x.shape[1]))
        k, v = self.expand(latent, k_rope, constrain)
        # as in multi-head attention: queries keep their sequence shard, keys and values are gathered whole
        q = constrain(checkpoint_name(q, "qkv"), ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_heads", None))
        v = constrain(v, ("batch", "seq", "act_heads", None))
        k = constrain(checkpoint_name(k, "qkv"), ("batch", None, "act_heads", None))
        v = constrain(checkpoint_name(v, "qkv"), ("batch", None, "act_heads", None))
        out = attention_core(q, k, v, causal=True, kernel=self.kernel, scale=self.score_scale)
        out = constrain(checkpoint_name(out, "attn_out"), ("batch", "seq", "act_heads", None))
        return self.output(out, constrain)
