"""Decoder-only transformers: ``gpt`` (nanoGPT-style) and ``llama`` (RMSNorm, RoPE, SwiGLU, GQA).

One class serves both families; the family picks the norm, the MLP, the position scheme, biases and
whether the output projection is tied to the embedding. Blocks are a list (not a scanned stack), so a
pipeline can hand different blocks to different stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hyperjax.errors import ConfigError
from hyperjax.models.config import ModelConfig
from hyperjax.models.layers import MLP, Attention, Constrain, LayerNorm, RMSNorm, no_constraint, param, use

RECOMPUTE = ("none", "selective", "full")
_POLICIES = {
    # selective (Korthikanti et al.): keep the linear layers' outputs, recompute the attention core
    "selective": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, causal: bool = True) -> None:
        gpt = cfg.family == "gpt"
        norm = LayerNorm if gpt else RMSNorm
        self.norm1 = norm(cfg.d_model, rngs=rngs)
        self.attn = Attention(
            cfg.d_model,
            cfg.heads,
            cfg.n_kv_heads,
            bias=gpt,
            use_rope=not gpt,
            layers=cfg.layers,
            rngs=rngs,
            causal=causal,
        )
        self.norm2 = norm(cfg.d_model, rngs=rngs)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, gated=not gpt, bias=gpt, layers=cfg.layers, rngs=rngs)

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        x = x + self.attn(self.norm1(x, constrain), constrain)
        x = constrain(x, ("batch", "res_seq", "act_embed"))
        x = x + self.mlp(self.norm2(x, constrain), constrain)
        return constrain(checkpoint_name(x, "block_out"), ("batch", "res_seq", "act_embed"))


class Transformer(nnx.Module):
    """A decoder-only language model returning float32 logits.

    Args:
      cfg: the model's shape and family.
      dtype: compute dtype (``float32`` or ``bfloat16``); parameters stay float32.
      recompute: activation recomputation per block: ``none``, ``selective`` or ``full``.
      rngs: parameter initialisation randomness.
    """

    def __init__(self, cfg: ModelConfig, *, dtype: str = "float32", recompute: str = "none", rngs: nnx.Rngs) -> None:
        if recompute not in RECOMPUTE:
            raise ConfigError(f"train.recompute={recompute!r} is not one of {RECOMPUTE}")
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.dtype={dtype!r} is not one of ('float32', 'bfloat16')")
        self.cfg, self.dtype, self.recompute = cfg, dtype, recompute
        self.embed = param(rngs, (cfg.vocab, cfg.d_model), ("vocab", "embed"))
        if cfg.family == "gpt":
            self.pos_embed = param(rngs, (cfg.seq_len, cfg.d_model), (None, "embed"), scale=0.01)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.final_norm = (LayerNorm if cfg.family == "gpt" else RMSNorm)(cfg.d_model, rngs=rngs)
        if cfg.family != "gpt":
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """Logits of shape ``(batch, seq, vocab)`` for integer ``tokens`` of shape ``(batch, seq)``."""
        x = self.embed_tokens(tokens, constrain)
        for block in self.blocks:
            x = self.run_block(block, x, constrain)
        return self.logits(x, constrain)

    def embed_tokens(self, tokens: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """The residual stream at the first block: token (and, for GPT, position) embeddings."""
        return embed_tokens(self, tokens, constrain)

    def logits(self, x: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """Float32 logits from the residual stream after the last block."""
        head = self.embed if self.cfg.family == "gpt" else self.lm_head
        return logits(self, head, x, constrain)

    def run_block(self, block: Block, x: jax.Array, constrain: Constrain) -> jax.Array:
        """One block, under this model's recomputation policy."""
        if self.recompute == "none":
            return block(x, constrain)
        return nnx.remat(lambda b, h: b(h, constrain), policy=_POLICIES[self.recompute])(block, x)


def build_model(cfg: ModelConfig, *, dtype: str = "float32", recompute: str = "none", seed: int = 0) -> nnx.Module:
    """Initialise a model of ``cfg`` from ``seed`` (the same parameters on any mesh).

    A :class:`Transformer`, or with ``cfg.vision`` a :class:`hyperjax.models.vlm.VisionLanguageModel`.
    """
    rngs = nnx.Rngs(params=seed)
    if cfg.vision is not None:
        from hyperjax.models.vlm import VisionLanguageModel

        return VisionLanguageModel(cfg, dtype=dtype, recompute=recompute, rngs=rngs)
    return Transformer(cfg, dtype=dtype, recompute=recompute, rngs=rngs)


def count_params(model: nnx.Module) -> int:
    """Number of parameters (elements of every ``nnx.Param``)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def embed_tokens(m: nnx.Module, tokens: jax.Array, constrain: Constrain) -> jax.Array:
    """Embed ``tokens`` with the ``embed`` (and ``pos_embed``) parameters of ``m`` (a model or a pipeline chunk).

    The table is gathered whole before the lookup, like every weight (see ``layers.use``); otherwise XLA
    partitions the lookup by regathering its output.
    """
    dt = jnp.dtype(m.dtype)
    x = jnp.take(use(m.embed, constrain), tokens, axis=0).astype(dt)
    if m.cfg.family == "gpt":
        x = x + use(m.pos_embed, constrain)[: tokens.shape[1]].astype(dt)
    return constrain(x, ("batch", "res_seq", "act_embed"))


def logits(m: nnx.Module, head: nnx.Param, x: jax.Array, constrain: Constrain) -> jax.Array:
    """The final norm of ``m`` and the output projection ``head`` (the embedding, transposed, when tied)."""
    dt = jnp.dtype(m.dtype)
    x = m.final_norm(x, constrain)
    w = use(head, constrain)
    out = (x @ (w.T if head.logical_axes[0] == "vocab" else w).astype(dt)).astype(jnp.float32)
    return constrain(out, ("batch", "seq", "act_vocab"))
