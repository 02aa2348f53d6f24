"""Decoder-only transformers: ``gpt`` (nanoGPT-style) and ``llama`` (RMSNorm, RoPE, SwiGLU, GQA).

One class serves both families; the family picks the norm, the MLP, the position scheme, biases and
whether the output projection is tied to the embedding. Blocks are a list (not a scanned stack), so a
pipeline can hand different blocks to different stages.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hyperjax.errors import ConfigError
from hyperjax.models.config import ModelConfig
from hyperjax.models.layers import MLP, Attention, Constrain, LayerNorm, RMSNorm, no_constraint, param, use
from hyperjax.models.taps import product
from hyperjax.offload.placement import from_recompute

RECOMPUTE = ("none", "selective", "full")
# what a block keeps for backward, by checkpoint name: on the device, on the host (pinned_host) or
# neither (recomputed); ``None``: no rematerialisation at all. See hyperjax.offload for the names.
BlockPolicy = tuple[tuple[str, ...], tuple[str, ...]] | None


def block_policies(placement: Any, layers: int) -> tuple[BlockPolicy, ...]:
    """Each block's policy under ``placement`` (a :class:`hyperjax.offload.Placement`)."""
    out: list[BlockPolicy] = []
    for i in range(layers):
        where = placement.block(i)
        saved = tuple(a for a, o in where.items() if o == "device")
        offloaded = tuple(a for a, o in where.items() if o == "host")
        out.append(None if len(saved) == len(where) else (saved, offloaded))
    return tuple(out)


def _remat(policy: BlockPolicy) -> Any:
    saved, offloaded = policy
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


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
        x = x + self.attn(checkpoint_name(self.norm1(x, constrain), "norms"), constrain)
        x = checkpoint_name(constrain(x, ("batch", "res_seq", "act_embed")), "norms")
        x = x + self.mlp(checkpoint_name(self.norm2(x, constrain), "norms"), constrain)
        return constrain(checkpoint_name(x, "block_out"), ("batch", "res_seq", "act_embed"))


class Transformer(nnx.Module):
    """A decoder-only language model returning float32 logits.

    Args:
      cfg: the model's shape and family.
      dtype: compute dtype (``float32`` or ``bfloat16``); parameters stay float32.
      recompute: activation recomputation per block: ``none``, ``selective`` or ``full``.
      rngs: parameter initialisation randomness.
      placement: where each block's activations live (a :class:`hyperjax.offload.Placement`); ``None``:
        what ``recompute`` says.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: str = "float32",
        recompute: str = "none",
        rngs: nnx.Rngs,
        placement: Any = None,
    ) -> None:
        if recompute not in RECOMPUTE:
            raise ConfigError(f"train.recompute={recompute!r} is not one of {RECOMPUTE}")
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.dtype={dtype!r} is not one of ('float32', 'bfloat16')")
        self.cfg, self.dtype, self.recompute = cfg, dtype, recompute
        self.policies = block_policies(placement or from_recompute(recompute, cfg.layers), cfg.layers)
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
        for i, block in enumerate(self.blocks):
            x = self.run_block(block, x, constrain, layer=i)
        return self.logits(x, constrain)

    def embed_tokens(self, tokens: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """The residual stream at the first block: token (and, for GPT, position) embeddings."""
        return embed_tokens(self, tokens, constrain)

    def logits(self, x: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """Float32 logits from the residual stream after the last block."""
        head = self.embed if self.cfg.family == "gpt" else self.lm_head
        return logits(self, head, x, constrain)

    def run_block(self, block: Block, x: jax.Array, constrain: Constrain, *, layer: int = 0) -> jax.Array:
        """Block ``layer``, keeping its activations where the model's placement says.

        Modules that borrow this method (pipeline chunks, the vision encoder) have no ``policies`` and
        follow their ``recompute``.
        """
        policies = getattr(self, "policies", None)
        policy = policies[layer] if policies is not None else block_policies(from_recompute(self.recompute, 1), 1)[0]
        if policy is None:
            return block(x, constrain)
        return nnx.remat(lambda b, h: b(h, constrain), policy=_remat(policy))(block, x)


def build_model(
    cfg: ModelConfig, *, dtype: str = "float32", recompute: str = "none", seed: int = 0, placement: Any = None
) -> nnx.Module:
    """Initialise a model of ``cfg`` from ``seed`` (the same parameters on any mesh).

    A :class:`Transformer`, or with ``cfg.vision`` a :class:`hyperjax.models.vlm.VisionLanguageModel`.
    ``placement`` (a :class:`hyperjax.offload.Placement`) says where a transformer's activations live.
    """
    rngs = nnx.Rngs(params=seed)
    if cfg.vision is not None:
        from hyperjax.models.vlm import VisionLanguageModel

        return VisionLanguageModel(cfg, dtype=dtype, recompute=recompute, rngs=rngs)
    return Transformer(cfg, dtype=dtype, recompute=recompute, rngs=rngs, placement=placement)


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
    spec = "...d,vd->...v" if head.logical_axes[0] == "vocab" else "...d,dv->...v"
    out = product(spec, x, w.astype(dt)).astype(jnp.float32)
    return constrain(out, ("batch", "seq", "act_vocab"))
