"""A model cut into pipeline chunks that share its variables, so a pipeline starts from its parameters.

A decoder-only model of ``L`` layers is cut into ``pipeline x virtual_stages`` chunks of consecutive
layers, as many as the resolved run's stages hold; the first chunk embeds, the last computes the logits.
A vision-language model on MPMD submeshes is two chunks: the encoder, and the language model reading the
image tokens with the text as a feed.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from hyperjax.config import Run
from hyperjax.models import Transformer, VisionLanguageModel
from hyperjax.models.layers import Constrain
from hyperjax.models.moe import RouterStats
from hyperjax.models.transformer import embed_tokens, logits, run_blocks
from hyperjax.models.vlm import LanguageChunk


class Chunk(nnx.Module):
    """Consecutive blocks of a :class:`Transformer`, with the embedding if first and the head if last.

    It shares the model's variables (its state is a slice of the model's). A tied head is the embedding
    table: the last chunk holds its own copy, which the runtime keeps in step with the first chunk's.
    """

    def __init__(self, model: Transformer, layers: range, *, first: bool, last: bool) -> None:
        self.cfg, self.dtype, self.recompute, self.overlap = model.cfg, model.dtype, model.recompute, model.overlap
        self.first, self.last = first, last
        self.policies = tuple(model.policies[i] for i in layers)
        if first:
            self.embed = model.embed
            if model.cfg.positions == "learned":
                self.pos_embed = model.pos_embed
        self.blocks = nnx.List([model.blocks[i] for i in layers])
        if last:
            self.final_norm = model.final_norm
            self.head = model.head

    @property
    def tied(self) -> bool:
        """Whether this chunk's head is a copy of the first chunk's embedding table."""
        return self.last and not self.first and self.cfg.tie_embeddings

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        """Hidden states (or, for the last chunk, logits); the first chunk's ``x`` is the tokens."""
        return self.forward(x, constrain)[0]

    def forward(self, x: jax.Array, constrain: Constrain) -> tuple[jax.Array, RouterStats | None]:
        """:meth:`__call__` and the router stats of the chunk's MoE layers."""
        if self.first:
            x = embed_tokens(self, x, constrain)
        x, stats = run_blocks(self.blocks, self.policies, x, constrain, halves=self.overlap == "two-microbatch")
        return (logits(self, self.head, x, constrain) if self.last else x), stats


def model_chunks(model: Transformer | VisionLanguageModel, run: Run) -> tuple[list[nnx.Module], str]:
    """The chunks of ``model`` for ``run``'s stages, in model order, and the batch entry the first reads."""
    if isinstance(model, VisionLanguageModel):  # the encoder on one submesh, the language model on the other
        return [model.encoder, LanguageChunk(model.language_model)], "images"
    counts = run.chunk_layers()
    bounds = np.cumsum([0, *counts])
    n = len(counts)
    return [Chunk(model, range(bounds[c], bounds[c + 1]), first=c == 0, last=c == n - 1) for c in range(n)], "inputs"
