"""A model described by its parts, counted once: its tensors, its products, its FLOPs and its activations.

Everything else reads these counts: the estimate prices the products and streams the activations, the
pipeline balancer in :func:`hyperjax.resolve` weighs layers by their FLOPs, the resolver checks every
tensor's sharding before anything compiles, and the inventories compare them with compiled programs.
The tensors listed here are exactly the NNX models' parameters (path, shape, logical axes); a test holds
the two equal for every architecture.

Conventions (Megatron's, so published runs compare directly): FLOPs count attention scores over the full
``s x s`` square; activation bytes follow Korthikanti et al. (2022), ``34 s b h + 5 a s^2 b`` per layer
for GPT in 16-bit, generalised to the parts (grouped keys and values, head width, gated MLPs, parallel
blocks) and split by name into the groups the models tag with ``checkpoint_name``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Literal

from hyperjax.config import ModelConfig, VisionConfig

TENSOR_SPLIT = ("heads", "kv_heads", "mlp", "vocab")
"""Logical axes of parameters that tensor parallelism splits."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: its key path in the model's state, shape and logical axes."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def tensor_split(self) -> bool:
        """Whether tensor parallelism splits it (under the standard rules)."""
        return any(a in TENSOR_SPLIT for a in self.axes)


@dataclasses.dataclass(frozen=True)
class Product:
    """A matrix product of every token with a weight: ``(tokens, k) x (k, n)``.

    ``split`` is the dimension tensor parallelism divides: ``n`` for a column split (the output's
    features), ``k`` for a row split (the contraction, whose partial sums are then reduced).
    """

    name: str
    n: int
    k: int
    split: Literal["n", "k"]


def norm_tensors(m: ModelConfig, d: int, prefix: str) -> list[Tensor]:
    """A norm's scale, and a LayerNorm's shift when the model has biases."""
    out = [Tensor(f"{prefix}/scale", (d,), ("embed",))]
    if m.norm == "layernorm" and m.bias:
        out.append(Tensor(f"{prefix}/bias", (d,), ("embed",)))
    return out


def block_tensors(m: ModelConfig, prefix: str = "") -> list[Tensor]:
    """The parameters of one block, as :class:`hyperjax.models.layers` creates them."""
    h, a, kv, hd, f = m.d_model, m.heads, m.kv_heads, m.head_dim, m.d_ff
    p = f"{prefix}/" if prefix else ""
    out = norm_tensors(m, h, f"{p}norm1" if m.block == "sequential" else f"{p}norm")
    out += [
        Tensor(f"{p}attn/q_proj", (h, a, hd), ("embed", "heads", "head_dim")),
        Tensor(f"{p}attn/k_proj", (h, kv, hd), ("embed", "kv_heads", "head_dim")),
        Tensor(f"{p}attn/v_proj", (h, kv, hd), ("embed", "kv_heads", "head_dim")),
        Tensor(f"{p}attn/o_proj", (a, hd, h), ("heads", "head_dim", "embed")),
    ]
    if m.bias:
        out += [
            Tensor(f"{p}attn/q_bias", (a, hd), ("heads", "head_dim")),
            Tensor(f"{p}attn/k_bias", (kv, hd), ("kv_heads", "head_dim")),
            Tensor(f"{p}attn/v_bias", (kv, hd), ("kv_heads", "head_dim")),
            Tensor(f"{p}attn/o_bias", (h,), ("embed",)),
        ]
    if m.block == "sequential":
        out += norm_tensors(m, h, f"{p}norm2")
    out.append(Tensor(f"{p}mlp/w_in", (h, f), ("embed", "mlp")))
    if m.gated:
        out.append(Tensor(f"{p}mlp/w_gate", (h, f), ("embed", "mlp")))
    out.append(Tensor(f"{p}mlp/w_out", (f, h), ("mlp", "embed")))
    if m.bias:
        out.append(Tensor(f"{p}mlp/b_in", (f,), ("mlp",)))
        if m.gated:
            out.append(Tensor(f"{p}mlp/b_gate", (f,), ("mlp",)))
        out.append(Tensor(f"{p}mlp/b_out", (h,), ("embed",)))
    return out


def decoder_tensors(m: ModelConfig, prefix: str = "", layers: range | None = None) -> list[Tensor]:
    """Every parameter of a decoder (the embedding, ``layers`` blocks, the final norm and a separate head)."""
    p = f"{prefix}/" if prefix else ""
    out = [Tensor(f"{p}embed", (m.vocab, m.d_model), ("vocab", "embed"))]
    if m.positions == "learned":
        out.append(Tensor(f"{p}pos_embed", (m.seq_len, m.d_model), (None, "embed")))
    for i in range(m.layers) if layers is None else layers:
        out += block_tensors(m, f"{p}blocks/{i}")
    out += norm_tensors(m, m.d_model, f"{p}final_norm")
    if not m.tie_embeddings:
        out.append(Tensor(f"{p}lm_head", (m.d_model, m.vocab), ("embed", "vocab")))
    return out


def encoder_tensors(v: VisionConfig, d_out: int, prefix: str = "encoder") -> list[Tensor]:
    """Every parameter of a ViT encoder projecting to ``d_out``."""
    enc = v.as_model()
    p = f"{prefix}/" if prefix else ""
    out = [
        Tensor(f"{p}patch_embed", (v.patch_dim, v.d_model), (None, "embed")),
        Tensor(f"{p}pos_embed", (v.patches, v.d_model), (None, "embed")),
    ]
    for i in range(v.layers):
        out += block_tensors(enc, f"{p}blocks/{i}")
    out += norm_tensors(enc, v.d_model, f"{p}final_norm")
    out.append(Tensor(f"{p}project", (v.d_model, d_out), (None, "embed")))
    return out


def model_tensors(m: ModelConfig) -> list[Tensor]:
    """Every parameter of the model :func:`hyperjax.build_model` builds for ``m``."""
    if m.vision is None:
        return decoder_tensors(m)
    return encoder_tensors(m.vision, m.d_model) + decoder_tensors(m, "language_model")


def count_params(m: ModelConfig) -> int:
    """Parameters of the model (a tied embedding once)."""
    return sum(t.size for t in model_tensors(m))


def block_products(m: ModelConfig) -> tuple[Product, ...]:
    """The weight products of one block, per token. Query, key and value are one product (one GEMM on
    the concatenated weights), as are a gated MLP's input and gate."""
    h, a, kv, hd, f = m.d_model, m.heads, m.kv_heads, m.head_dim, m.d_ff
    return (
        Product("qkv", (a + 2 * kv) * hd, h, "n"),
        Product("attn_out", h, a * hd, "k"),
        Product("mlp_in", f * (2 if m.gated else 1), h, "n"),
        Product("mlp_out", h, f, "k"),
    )


def matrix_params(m: ModelConfig) -> int:
    """Parameters in one block's weight matrices (what the products multiply by)."""
    return sum(p.n * p.k for p in block_products(m))


def attention_flops_per_token(m: ModelConfig, seq: int | None = None) -> float:
    """Forward FLOPs of the attention core (scores and values over the full square) per token."""
    return 4.0 * (m.seq_len if seq is None else seq) * m.heads * m.head_dim


def block_flops_per_token(m: ModelConfig, seq: int | None = None) -> float:
    """Training FLOPs (forward and backward, no recomputation) of one block per token of a ``seq``-long input."""
    return 6.0 * matrix_params(m) + 3 * attention_flops_per_token(m, seq)


def embed_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs charged to the embedding lookup per token (used to balance pipeline stages)."""
    return 6.0 * m.d_model


def head_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs of the output projection (with the loss) per token."""
    return 6.0 * m.d_model * m.vocab


def module_flops(m: ModelConfig) -> dict[str, float]:
    """Training FLOPs per sequence of each module: the ``decoder`` alone, or a vision-language model's
    ``encoder`` (over its patches, with the patch embedding and the projection) and ``language_model``
    (over image and text tokens, the head over the text)."""
    s = m.seq_len
    if m.vision is None:
        return {"decoder": s * m.layers * block_flops_per_token(m) + s * head_flops_per_token(m)}
    v = m.vision
    encoder = v.patches * (
        v.layers * block_flops_per_token(v.as_model()) + 6.0 * v.patch_dim * v.d_model + 6.0 * v.d_model * m.d_model
    )
    tokens = s + v.patches
    language = tokens * m.layers * block_flops_per_token(m, tokens) + s * head_flops_per_token(m)
    return {"encoder": encoder, "language_model": language}


def model_flops_per_sequence(m: ModelConfig) -> float:
    """Forward and backward FLOPs of one sequence, recomputation excluded (Korthikanti eq. 7 for GPT)."""
    return sum(module_flops(m).values())


def activation_units(m: ModelConfig) -> dict[str, float]:
    """Bytes per token of one layer's stored activations in 16-bit, by the names the models tag.

    For GPT (``heads x head_dim = d_model``, ``d_ff = 4 d_model``, sequential blocks) these are
    Korthikanti's ``34 h`` split as block input 2, norms 8 (the norms' inputs and outputs, the mid-block
    residual and dropout masks), Q/K/V 6, the output projection's input 2 and the MLP's hidden 16; the
    attention core's ``5 a s`` is per token too. A gated MLP keeps three hidden tensors, a parallel block
    has one norm and no mid-block residual.
    """
    h, f = m.d_model, m.d_ff
    return {
        "block_in": 2.0 * h,
        "norms": (8.0 if m.block == "sequential" else 4.0) * h,
        "qkv": 2.0 * (m.heads + 2 * m.kv_heads) * m.head_dim,
        "attn_out": 2.0 * m.heads * m.head_dim,
        "mlp_hidden": (6.0 if m.gated else 4.0) * f,
        "attn_core": 5.0 * m.heads * m.seq_len,
    }


def tensors_by_axes(tensors: list[Tensor]) -> Iterator[tuple[tuple[str | None, ...], tuple[int, ...], str]]:
    """``(axes, shape, path)`` of the first tensor of each distinct (axes, shape): enough to check shardings."""
    seen: set[tuple] = set()
    for t in tensors:
        key = (t.axes, t.shape)
        if key not in seen:
            seen.add(key)
            yield t.axes, t.shape, t.path
