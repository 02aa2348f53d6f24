"""A decoder-only transformer described by its parts, nanoGPT-style: one readable file.

The model config's parts choose every piece: the norm (LayerNorm or RMSNorm), the MLP (GELU, ReLU or the
gated SwiGLU and GeGLU), positions (a learned table or rotary), the block layout (sequential, or
parallel attention and MLP on one norm as in GPT-J and PaLM), biases, the head width and whether the
output projection is the embedding table. Blocks are a list (not a scanned stack), so a pipeline can hand
different blocks to different stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from hyperjax.config import ACTIVATIONS, Activation, DType, Fp8Config, ModelConfig, Overlap, Recompute, recomputed
from hyperjax.models.layers import MLP, Attention, Constrain, make_norm, no_constraint, param, use
from hyperjax.models.mla import LatentAttention
from hyperjax.models.moe import MoE, RouterStats, combine_halves, merge_stats
from hyperjax.models.taps import product
from hyperjax.shard.strategy import entry_axes

BlockPolicy = tuple[tuple[str, ...], tuple[str, ...]] | None
"""What a block keeps for backward, by checkpoint name: ``(on the device, on the host (pinned_host))``;
the names in neither are recomputed, but for the block's input (``block_in``), which stays on the device
unless offloaded. ``None``: no rematerialisation at all."""


def recompute_policy(recompute: Recompute, modules: tuple[Activation, ...] | None = None) -> BlockPolicy:
    """The policy ``train.recompute`` means: keep everything, all but the activations ``modules`` names
    (the attention core when ``None``), or nothing."""
    if recompute == "none":
        return None
    gone = recomputed(recompute, modules)
    return (tuple(a for a in ACTIVATIONS if a not in gone), ())


def _remat(policy: tuple[tuple[str, ...], tuple[str, ...]]) -> jax.checkpoint_policies:
    saved, offloaded = policy
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


def run_block(
    block: Block, x: jax.Array, constrain: Constrain, policy: BlockPolicy
) -> tuple[jax.Array, RouterStats | None]:
    """``block(x)`` and its router stats, keeping its activations where ``policy`` says."""
    if policy is None:
        return block(x, constrain)
    return nnx.remat(lambda b, h: b(h, constrain), policy=_remat(policy))(block, x)


def run_blocks(
    blocks: list[Block],
    policies: tuple[BlockPolicy, ...],
    x: jax.Array,
    constrain: Constrain,
    *,
    halves: bool = False,
) -> tuple[jax.Array, RouterStats | None]:
    """The blocks in order, and the router stats of their MoE layers (``None`` when all are dense).

    With ``halves`` (``parallel.overlap: two-microbatch``) the micro-batch runs as two halves, every
    block on one half and then on the other: the halves share no data inside a block, so one half's
    all-to-all can run while the other half computes (XLA's scheduler places the asynchronous exchanges;
    the cost model prices the lanes of :mod:`hyperjax.mpmd.lanes`). Each device's rows split alternately
    (the batch axis stays where it is), and the halves are put back in order after the last block: the
    logits, and so the losses, are the whole micro-batch's.
    """
    if halves:
        return _run_halves(blocks, policies, x, constrain)
    stats = []
    for block, policy in zip(blocks, policies, strict=True):
        x, routed = run_block(block, x, constrain, policy)
        stats.append(routed)
    return x, merge_stats(stats)


def _run_halves(
    blocks: list[Block], policies: tuple[BlockPolicy, ...], x: jax.Array, constrain: Constrain
) -> tuple[jax.Array, RouterStats | None]:
    layout = ("batch", "res_seq", "act_embed")
    b = x.shape[0]
    pairs = x.reshape(b // 2, 2, *x.shape[1:])  # each device's consecutive rows, two by two
    one, two = constrain(pairs[:, 0], layout), constrain(pairs[:, 1], layout)
    stats = []
    for block, policy in zip(blocks, policies, strict=True):
        one, first = run_block(block, one, constrain, policy)
        two, second = run_block(block, two, constrain, policy)
        stats.append(combine_halves(first, second, block.mlp.moe.experts) if block.sparse else None)
    x = jnp.stack([one, two], axis=1).reshape(b, *x.shape[1:])
    return constrain(x, layout), merge_stats(stats)


class Block(nnx.Module):
    """A pre-norm block: sequential ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``, or parallel
    ``x + attn(norm(x)) + mlp(norm(x))``. Block ``layer`` of a mixture-of-experts model has an MoE MLP
    where ``cfg.is_moe(layer)``; attention is latent under ``attention: mla``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        causal: bool = True,
        layer: int = 0,
        fp8: Fp8Config | None = None,
    ) -> None:
        self.parallel = cfg.block == "parallel"
        if self.parallel:
            self.norm = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, rngs=rngs, eps=cfg.norm_eps)
        else:
            self.norm1 = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, rngs=rngs, eps=cfg.norm_eps)
        if cfg.attention == "mla":
            self.attn = LatentAttention(cfg, rngs=rngs, fp8=fp8)
        else:
            self.attn = Attention(cfg, rngs=rngs, causal=causal, fp8=fp8)
        if not self.parallel:
            self.norm2 = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, rngs=rngs, eps=cfg.norm_eps)
        self.sparse = cfg.is_moe(layer)
        if self.sparse:
            self.mlp = MoE(cfg, rngs=rngs, fp8=fp8)
        else:
            self.mlp = MLP(cfg.d_model, cfg.d_ff, kind=cfg.mlp, bias=cfg.bias, layers=cfg.layers, rngs=rngs, fp8=fp8)

    def _mlp(self, h: jax.Array, constrain: Constrain) -> tuple[jax.Array, RouterStats | None]:
        return self.mlp(h, constrain) if self.sparse else (self.mlp(h, constrain), None)

    def __call__(self, x: jax.Array, constrain: Constrain) -> tuple[jax.Array, RouterStats | None]:
        # the input, named so that a rematerialisation policy can send it to the host: the backward then
        # reads that copy, and nothing on the device holds the input between the passes
        x = checkpoint_name(x, "block_in")
        if self.parallel:
            # one normalised input for both branches, gathered once over a sequence-parallel axis
            h = constrain(checkpoint_name(self.norm(x, constrain), "norms"), ("batch", "seq", "act_embed"))
            y, stats = self._mlp(h, constrain)
            x = x + self.attn(h, constrain) + y
        else:
            x = x + self.attn(checkpoint_name(self.norm1(x, constrain), "norms"), constrain)
            x = checkpoint_name(constrain(x, ("batch", "res_seq", "act_embed")), "norms")
            y, stats = self._mlp(checkpoint_name(self.norm2(x, constrain), "norms"), constrain)
            x = x + y
        return constrain(checkpoint_name(x, "block_out"), ("batch", "res_seq", "act_embed")), stats


class Transformer(nnx.Module):
    """A decoder-only language model returning float32 logits.

    Args:
      cfg: the model's shape and parts.
      dtype: compute dtype (``float32`` or ``bfloat16``); parameters stay float32.
      recompute: activation recomputation per block: ``none``, ``selective`` or ``full``.
      recompute_modules: the activations ``selective`` recomputes (``train.recompute_modules``).
      rngs: parameter initialisation randomness.
      policies: what each block keeps for backward (:data:`BlockPolicy`, one per layer, e.g. from an
        offload placement); ``None``: what ``recompute`` says.
      overlap: ``two-microbatch`` runs each micro-batch as two halves (:func:`run_blocks`).
      fp8: the blocks' linear layers (and with ``output_layer`` the head) multiply in FP8 by this recipe;
        ``None``: in ``dtype``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: DType = "float32",
        recompute: Recompute = "none",
        recompute_modules: tuple[Activation, ...] | None = None,
        rngs: nnx.Rngs,
        policies: tuple[BlockPolicy, ...] | None = None,
        overlap: Overlap = "none",
        fp8: Fp8Config | None = None,
    ) -> None:
        self.cfg, self.dtype, self.recompute, self.overlap = cfg, dtype, recompute, overlap
        self.head_fp8 = fp8 if fp8 is not None and fp8.output_layer else None
        self.policies = (
            policies if policies is not None else (recompute_policy(recompute, recompute_modules),) * cfg.layers
        )
        self.embed = param(rngs, (cfg.vocab, cfg.d_model), ("vocab", "embed"))
        if cfg.positions == "learned":
            self.pos_embed = param(rngs, (cfg.seq_len, cfg.d_model), (None, "embed"), scale=0.01)
        self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=i, fp8=fp8) for i in range(cfg.layers)])
        self.final_norm = make_norm(cfg.norm, cfg.d_model, bias=cfg.bias, rngs=rngs, eps=cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"))

    @property
    def head(self) -> nnx.Param:
        """The output projection: the embedding table when tied."""
        return self.embed if self.cfg.tie_embeddings else self.lm_head

    def __call__(self, tokens: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """Logits of shape ``(batch, seq, vocab)`` for integer ``tokens`` of shape ``(batch, seq)``."""
        return self.forward(tokens, constrain)[0]

    def forward(self, tokens: jax.Array, constrain: Constrain = no_constraint) -> tuple[jax.Array, RouterStats | None]:
        """The logits and the router stats of the MoE layers (``None`` for a dense model)."""
        x = embed_tokens(self, tokens, constrain)
        x, stats = run_blocks(self.blocks, self.policies, x, constrain, halves=self.overlap == "two-microbatch")
        return logits(self, self.head, x, constrain), stats


def embed_tokens(m: nnx.Module, tokens: jax.Array, constrain: Constrain) -> jax.Array:
    """Embed ``tokens`` with the ``embed`` (and learned ``pos_embed``) parameters of ``m`` (a model or a
    pipeline chunk), by :func:`lookup`."""
    dt = jnp.dtype(m.dtype)
    x = lookup(use(m.embed, constrain), tokens, constrain).astype(dt)
    if m.cfg.positions == "learned":
        x = x + use(m.pos_embed, constrain)[: tokens.shape[1]].astype(dt)
    return constrain(x, ("batch", "res_seq", "act_embed"))


def lookup(table: jax.Array, tokens: jax.Array, constrain: Constrain) -> jax.Array:
    """Rows ``tokens`` of ``table`` (laid out for use: the vocabulary split over the tensor axis).

    Megatron's vocabulary-parallel embedding, written out under ``shard_map``: each device looks its own
    tokens up in its slice of the vocabulary (zeros for tokens outside it), and the slices' rows are
    summed over the tensor axis; in the backward pass each device adds its tokens' gradients into its
    slice, and the table's gradient is summed over the devices that hold other tokens. Left to XLA, a
    lookup inside the training step's per-replica ``shard_map`` regathers its output gradient instead.
    """
    if getattr(constrain, "mesh", None) is None:
        return jnp.take(table, tokens, axis=0)
    table_spec, ids = constrain.spec(("act_vocab", "act_embed")), constrain.spec(("batch", "seq"))
    out = constrain.spec(("batch", "res_seq", "act_embed"))
    vocab = entry_axes(table_spec[0])
    scatter = tuple(a for a in vocab if a in entry_axes(out[1]))  # sequence parallelism: each keeps its share

    def body(rows: jax.Array, ids: jax.Array) -> jax.Array:
        n = rows.shape[0]
        local = ids - jax.lax.axis_index(vocab) * n if vocab else ids
        held = (local >= 0) & (local < n)
        found = jnp.where(held[..., None], jnp.take(rows, jnp.clip(local, 0, n - 1), axis=0), 0)
        if scatter:
            return jax.lax.psum_scatter(found, vocab, scatter_dimension=1, tiled=True)
        return jax.lax.psum(found, vocab) if vocab else found

    split = jax.shard_map(
        body, mesh=constrain.region_mesh(), in_specs=(table_spec, ids), out_specs=out, axis_names=constrain.auto_axes
    )
    return split(table, tokens)


def logits(m: nnx.Module, head: nnx.Param, x: jax.Array, constrain: Constrain) -> jax.Array:
    """The final norm of ``m`` and the output projection ``head`` (the embedding, transposed, when tied)."""
    dt = jnp.dtype(m.dtype)
    x = m.final_norm(x, constrain)
    w = use(head, constrain)
    spec = "bsd,vd->bsv" if head.logical_axes[0] == "vocab" else "bsd,dv->bsv"
    out = product(spec, x, w.astype(dt), fp8=getattr(m, "head_fp8", None), constrain=constrain)
    out = out.astype(jnp.float32)
    return constrain(out, ("batch", "seq", "act_vocab"))


def count_params(model: nnx.Module) -> int:
    """Number of parameters (elements of every ``nnx.Param``)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
