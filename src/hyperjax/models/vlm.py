"""A small vision-language model: a ViT encoder whose patch tokens prefix a llama-family decoder.

The encoder cuts each image into patches, embeds them, runs bidirectional blocks and projects to the
language model's width; the decoder reads ``[image tokens; text tokens]`` causally and predicts the
text. The two halves are separate modules (``encoder``, ``language_model``), so HyperMPMD can place
them on different submeshes with their own strategies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyperjax.config import Activation, DType, Fp8Config, ModelConfig, Recompute, VisionConfig
from hyperjax.models.layers import Constrain, LayerNorm, no_constraint, param, use
from hyperjax.models.moe import RouterStats
from hyperjax.models.taps import product
from hyperjax.models.transformer import Block, Transformer, embed_tokens, logits, recompute_policy, run_blocks


def patchify(images: jax.Array, patch: int) -> jax.Array:
    """``(batch, H, W, C)`` images to ``(batch, patches, patch * patch * C)`` rows, row-major over patches."""
    b, h, w, c = images.shape
    x = images.reshape(b, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


class VisionEncoder(nnx.Module):
    """ViT: patch embedding, learned positions, bidirectional pre-norm blocks, projection to ``d_out``."""

    def __init__(
        self,
        v: VisionConfig,
        d_out: int,
        *,
        dtype: DType,
        recompute: Recompute,
        modules: tuple[Activation, ...] | None = None,
        rngs: nnx.Rngs,
        fp8: Fp8Config | None = None,
    ) -> None:
        self.vision, self.dtype, self.recompute = v, dtype, recompute
        self.policy = recompute_policy(recompute, modules)
        self.cfg = v.as_model()
        self.patch_embed = param(rngs, (v.patch_dim, v.d_model), (None, "embed"))
        self.pos_embed = param(rngs, (v.patches, v.d_model), (None, "embed"), scale=0.01)
        self.blocks = nnx.List([Block(self.cfg, rngs=rngs, causal=False, fp8=fp8) for _ in range(v.layers)])
        self.final_norm = LayerNorm(v.d_model, rngs=rngs)
        self.project = param(rngs, (v.d_model, d_out), (None, "embed"))

    def __call__(self, images: jax.Array, constrain: Constrain = no_constraint) -> jax.Array:
        """Image tokens ``(batch, patches, d_out)`` for float images ``(batch, H, W, C)``."""
        dt = jnp.dtype(self.dtype)
        patches = patchify(images.astype(dt), self.vision.patch)
        x = product("...p,pd->...d", patches, use(self.patch_embed, constrain).astype(dt))
        x = constrain(x + use(self.pos_embed, constrain).astype(dt), ("batch", "res_seq", "act_embed"))
        x, _ = run_blocks(self.blocks, (self.policy,) * len(self.blocks), x, constrain)
        x = product("...e,ed->...d", self.final_norm(x, constrain), use(self.project, constrain).astype(dt))
        return constrain(x, ("batch", "res_seq", "act_embed"))

    def forward(self, images: jax.Array, constrain: Constrain = no_constraint) -> tuple[jax.Array, None]:
        """The image tokens, and no router stats (the encoder is dense)."""
        return self(images, constrain), None


def decode(
    lm: Transformer, prefix: jax.Array, tokens: jax.Array, constrain: Constrain
) -> tuple[jax.Array, RouterStats | None]:
    """Logits of the text positions when ``prefix`` (image tokens) comes before ``tokens``, and the router
    stats of the language model's MoE layers."""
    x = embed_tokens(lm, tokens, constrain)
    x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
    x = constrain(x, ("batch", "res_seq", "act_embed"))
    x, stats = run_blocks(lm.blocks, lm.policies, x, constrain)
    return logits(lm, lm.head, x[:, prefix.shape[1] :], constrain), stats


class VisionLanguageModel(nnx.Module):
    """``encoder`` (ViT) then ``language_model`` (rotary positions) over ``[image tokens; text]``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: DType = "float32",
        recompute: Recompute = "none",
        modules: tuple[Activation, ...] | None = None,
        rngs: nnx.Rngs,
        fp8: Fp8Config | None = None,
    ) -> None:
        self.cfg = cfg
        self.encoder = VisionEncoder(
            cfg.vision, cfg.d_model, dtype=dtype, recompute=recompute, modules=modules, rngs=rngs, fp8=fp8
        )
        self.language_model = Transformer(
            cfg, dtype=dtype, recompute=recompute, recompute_modules=modules, rngs=rngs, fp8=fp8
        )

    def __call__(self, tokens: jax.Array, constrain: Constrain = no_constraint, *, images: jax.Array) -> jax.Array:
        """Float32 logits ``(batch, seq, vocab)`` of the text ``tokens`` after the ``images``."""
        return self.forward(tokens, constrain, images=images)[0]

    def forward(
        self, tokens: jax.Array, constrain: Constrain = no_constraint, *, images: jax.Array
    ) -> tuple[jax.Array, RouterStats | None]:
        """The logits and the language model's router stats."""
        return decode(self.language_model, self.encoder(images, constrain), tokens, constrain)


class LanguageChunk(nnx.Module):
    """The language model as a pipeline chunk: its input is the image tokens, the text comes as a feed."""

    feeds = ("inputs",)

    def __init__(self, lm: Transformer) -> None:
        self.lm, self.cfg = lm, lm.cfg
        self.recompute = lm.recompute  # whether its blocks are rematerialised (a split backward asks)

    def __call__(self, prefix: jax.Array, constrain: Constrain, *, inputs: jax.Array) -> jax.Array:
        return self.forward(prefix, constrain, inputs=inputs)[0]

    def forward(
        self, prefix: jax.Array, constrain: Constrain, *, inputs: jax.Array
    ) -> tuple[jax.Array, RouterStats | None]:
        """The logits and the router stats."""
        return decode(self.lm, prefix, inputs, constrain)
