"""A stage's chunks as parts: each a stack of equal blocks of one module, and where each chunk starts.

A stage holds chunks; a chunk is one or more *parts*, each a stack of equal blocks of one module with, at
the ends of the model, the embedding and the output layer: a decoder chunk is one part, or two when it
holds both dense blocks and mixture-of-experts blocks (equal within each kind); a vision-language model's
encoder and language model are parts of their own (one chunk on MPMD submeshes, both in one chunk when the
model runs as one SPMD program).
"""

from __future__ import annotations

import dataclasses
import functools

from hyperjax.config import ModelConfig, Run, Stage
from hyperjax.cost.counts import Tensor, decoder_tensors, encoder_tensors


def part_models(
    m: ModelConfig, stage: Stage, chunk_index: int, first: int = 0
) -> list[tuple[str, ModelConfig, int, bool]]:
    """``(module, block model, layers, moe)`` of each part of chunk ``stage.chunks[chunk_index]``, whose
    first block is block ``first`` of the model: the block model's ``seq_len`` is the tokens a sequence
    has there (a language model also sees the image tokens); a chunk holding dense and mixture-of-experts
    blocks has a part of each kind, dense first; a chunk of no blocks (the embedding or the output layer alone)
    one part of none."""
    out = []
    if "encoder" in stage.modules:
        out.append(("encoder", m.vision.as_model(m.d_model), m.vision.layers, False))
    if "language_model" in stage.modules:
        lm = dataclasses.replace(m, vision=None, seq_len=m.seq_len + m.vision.patches)
        out += [("language_model", lm, n, moe) for n, moe in _kinds(m, 0, m.layers)]
    if "decoder" in stage.modules:
        blocks = stage.layers[chunk_index]
        out += [("decoder", m, n, moe) for n, moe in _kinds(m, first, blocks)] or [("decoder", m, 0, False)]
    return out


def _kinds(m: ModelConfig, first: int, layers: int) -> list[tuple[int, bool]]:
    """``(blocks, moe)`` of blocks ``first .. first + layers - 1``: the dense ones, then the MoE ones."""
    moe = sum(m.is_moe(i) for i in range(first, first + layers))
    return [(n, kind) for n, kind in ((layers - moe, False), (moe, True)) if n]


def chunk_starts(run: Run) -> dict[int, int]:
    """The first block of every chunk, by chunk (chunk ``c`` lives on stage ``c mod stages``)."""
    counts = {c: n for s in run.stages for c, n in zip(s.chunks, s.layers, strict=True)}
    starts, at = {}, 0
    for c in sorted(counts):
        starts[c] = at
        at += counts[c]
    return starts


@functools.lru_cache(maxsize=1024)
def outside_tensors(module: str, block: ModelConfig, model: ModelConfig) -> tuple[Tensor, ...]:
    """A module's parameters outside its blocks (embeddings, final norm, head; an encoder's patch embedding
    and projection)."""
    if module == "encoder":
        tensors = encoder_tensors(model.vision, model.d_model, "")
    else:
        tensors = decoder_tensors(block, "", range(0))
    return tuple(t for t in tensors if "/blocks/" not in f"/{t.path}")
