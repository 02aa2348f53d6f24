"""The model's description: its shape and its parts, one frozen dataclass with a comment per field.

An architecture is described by its parts (norm, MLP kind, positions, block layout, biases, tied
embeddings, head width), which the NNX models and the cost model both read. ``family`` is a preset that
fills the parts not given: ``gpt`` is nanoGPT's GPT-2 (LayerNorm, GELU, learned positions, biases, tied
embeddings), ``llama`` is Llama's (RMSNorm, SwiGLU, rotary positions, no biases, a separate head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from hyperjax.config.checks import Filled, at_most_layers, check_fields, positive
from hyperjax.config.model_parts import MoEConfig, RopeScaling
from hyperjax.config.types import (
    GATED,
    AttentionKernel,
    AttentionKind,
    BlockLayout,
    Family,
    MLPKind,
    Norm,
    Positions,
)
from hyperjax.errors import ConfigError

FAMILY_PARTS: Mapping[str, Mapping[str, Any]] = {
    "gpt": {
        "norm": "layernorm",
        "mlp": "gelu",
        "positions": "learned",
        "tie_embeddings": True,
        "bias": True,
        "norm_eps": 1e-5,
    },
    "llama": {
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "positions": "rope",
        "tie_embeddings": False,
        "bias": False,
        "norm_eps": 1e-6,
    },
}
"""What each family preset fills in (a part given in the config wins)."""

ROPE_THETA = 10000.0
"""``model.rope_theta`` left null under rotary positions: the base of the RoFormer paper, GPT-NeoX and Llama 1-2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """A ViT image encoder whose patch tokens prefix the language model's input (``model.vision:``)."""

    layers: int = 2  # encoder blocks (bidirectional attention, LayerNorm, GELU MLP)
    d_model: int = 128  # encoder width
    heads: int = 4  # encoder attention heads
    d_ff: int = 512  # encoder MLP hidden width
    image_size: int = 16  # square images of image_size x image_size pixels
    patch: int = 4  # square patches of patch x patch pixels, one token each
    channels: int = 3  # colour channels

    def __post_init__(self) -> None:
        check_fields(self, "model.vision")
        positive(self, "model.vision", ("layers", "d_model", "heads", "d_ff", "image_size", "patch", "channels"))
        at_most_layers(self.layers, "model.vision.layers")
        if self.d_model % self.heads:
            raise ConfigError(
                f"model.vision.d_model={self.d_model} is not divisible by model.vision.heads={self.heads}"
            )
        if self.image_size % self.patch:
            raise ConfigError(
                f"model.vision.image_size={self.image_size} is not a multiple of model.vision.patch={self.patch}"
            )

    @property
    def patches(self) -> int:
        """Patch tokens per image."""
        return (self.image_size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        """Pixels times channels of one patch."""
        return self.patch * self.patch * self.channels

    def as_model(self, d_out: int = 1) -> ModelConfig:
        """The encoder's blocks as a GPT-style model config over the patch tokens (``vocab``: ``d_out``)."""
        return ModelConfig(
            family="gpt",
            layers=self.layers,
            d_model=self.d_model,
            heads=self.heads,
            d_ff=self.d_ff,
            vocab=d_out,
            seq_len=self.patches,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(Filled):
    """A decoder-only transformer (the ``model:`` section of a config): its shape and its parts.

    Parts left ``null`` are filled by the ``family`` preset when the config is read (:data:`FAMILY_PARTS`),
    so every field of a constructed ``ModelConfig`` is explicit. To change a model, use :meth:`replace`:
    ``dataclasses.replace`` passes the filled values on as if given, so ``dataclasses.replace(m, heads=16)``
    keeps the ``kv_heads`` and ``head_dim`` derived from the old ``heads``.
    """

    FILLED: ClassVar[frozenset[str]] = frozenset(
        {*(k for parts in FAMILY_PARTS.values() for k in parts), "qkv_bias", "head_dim", "kv_heads", "rope_theta"}
    )  # the family's parts and what follows from the other fields

    family: Family = "gpt"  # preset for the parts below: gpt (GPT-2 style) or llama
    layers: int = 4  # transformer blocks
    d_model: int = 256  # residual stream width
    heads: int = 8  # query heads
    kv_heads: int | None = None  # key/value heads (grouped-query attention); null: as many as heads
    head_dim: int | None = None  # width of one head (attention's inner width is heads x head_dim); null: d_model/heads
    d_ff: int = 1024  # MLP hidden width
    vocab: int = 256  # vocabulary size (256 for byte-level text)
    seq_len: int = 128  # tokens per sequence (text tokens; a vision model's patch tokens come in front)
    norm: Norm | None = None  # layernorm (scale and, with bias, shift) or rmsnorm (scale); null: the family's
    mlp: MLPKind | None = None  # gelu, relu, or the gated swiglu, geglu (three matrices); null: the family's
    positions: Positions | None = None  # learned (a table of seq_len rows) or rope; null: the family's
    rope_theta: float | None = None  # rotary base frequency (positions: rope); null: 10000
    tie_embeddings: bool | None = None  # the output projection is the embedding table; null: the family's
    bias: bool | None = None  # biases on every projection and LayerNorm shifts; null: the family's
    qkv_bias: bool | None = None  # biases on the query, key and value projections; null: as bias (Qwen2: true)
    qk_norm: bool = False  # queries and keys each normalised per head (model.norm over head_dim) before rotary (Qwen3)
    norm_eps: float | None = None  # the norms' epsilon; null: the family's (gpt 1e-5, llama 1e-6)
    rope_scaling: RopeScaling | None = None  # rotary frequencies stretched for long contexts (Llama 3.1)
    rope_interleave: bool = False  # rotary pairs are neighbours (2i, 2i+1) as in DeepSeek, not halves (i, i+d/2)
    block: BlockLayout = "sequential"  # sequential (pre-norm attention then MLP) or parallel (GPT-J / PaLM)
    attention: AttentionKind = "mha"  # mha (multi-head / grouped-query) or mla (DeepSeek's latent attention)
    attention_kernel: AttentionKernel = "materialized"  # materialized (scores kept) or flash (one fused kernel)
    attention_impl: str | None = None  # flash: the fused kernel priced (a name in the preset's attention_kernels)
    kv_lora_rank: int | None = None  # mla: width of the compressed keys and values (DeepSeek-V3: 512)
    q_lora_rank: int | None = None  # mla: width of the compressed queries; null: queries not compressed
    rope_head_dim: int | None = None  # mla: rotary dimensions per head, apart from head_dim (DeepSeek-V3: 64)
    moe: MoEConfig | None = None  # mixture-of-experts MLPs; null: dense
    vision: VisionConfig | None = None  # an image encoder in front of the language model (positions: rope)

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.attention_impl is not None and self.attention_kernel != "flash":
            raise ConfigError(
                f"model.attention_impl={self.attention_impl!r} names a fused attention kernel, but "
                f"model.attention_kernel={self.attention_kernel!r} keeps its scores; set model.attention_kernel: flash "
                "or remove model.attention_impl"
            )
        positive(self, "model", ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len"))
        at_most_layers(self.layers, "model.layers")
        positive(self, "model", ("kv_heads", "head_dim"), optional=True)
        self.note_open()
        for key, value in FAMILY_PARTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # the preset fills what the config leaves open
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        if not self.norm_eps > 0:
            raise ConfigError(
                f"model.norm_eps={self.norm_eps} must be > 0 (RMSNorm and LayerNorm add it to the variance)"
            )
        if self.rope_interleave and self.positions != "rope":
            raise ConfigError(
                f"model.rope_interleave pairs rotary dimensions, but model.positions={self.positions!r}; set "
                "model.positions: rope or model.rope_interleave: false"
            )
        if self.rope_scaling is not None and self.positions != "rope":
            raise ConfigError(
                f"model.rope_scaling stretches rotary positions, but model.positions={self.positions!r}; "
                "set model.positions: rope or remove model.rope_scaling"
            )
        if self.head_dim is None:
            if self.d_model % self.heads:
                raise ConfigError(
                    f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}; choose heads "
                    "that divide d_model, or give model.head_dim"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.heads)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads} "
                "(each key/value head serves a group of query heads), or be null for multi-head attention"
            )
        if self.positions != "rope" and self.rope_theta is not None:
            raise ConfigError(
                f"model.rope_theta={self.rope_theta} is the rotary base frequency, but model.positions="
                f"{self.positions!r}; remove model.rope_theta (or set it to null), or set model.positions: rope"
            )
        if self.positions == "rope" and self.rope_theta is None:
            object.__setattr__(self, "rope_theta", ROPE_THETA)
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0")
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"model.positions=rope rotates pairs of a head's dimensions, but model.head_dim={self.head_dim} "
                "is odd; use an even head_dim"
            )
        if self.vision is not None and self.positions != "rope":
            raise ConfigError(
                f"model.vision needs model.positions: rope (rotary positions cover the image tokens; "
                f"model.family: llama sets it); got {self.positions!r}"
            )
        self._check_latent_attention()
        if self.moe is not None and self.moe.first_dense >= self.layers:
            raise ConfigError(
                f"model.moe.first_dense={self.moe.first_dense} leaves no MoE layer among model.layers={self.layers}; "
                "lower first_dense, or set model.moe: null for a dense model"
            )
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:  # computed once: the cost model keys its caches by model
        return self._hash

    def _check_latent_attention(self) -> None:
        mla = {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank, "rope_head_dim": self.rope_head_dim}
        positive(self, "model", tuple(mla), optional=True)
        if self.attention == "mha":
            given = [k for k, v in mla.items() if v is not None]
            if given:
                raise ConfigError(f"model.{given[0]} is given but model.attention=mha; set model.attention: mla")
            return
        for key in ("kv_lora_rank", "rope_head_dim"):
            if mla[key] is None:
                raise ConfigError(
                    f"model.attention=mla needs model.{key} (DeepSeek-V3: kv_lora_rank 512, rope_head_dim 64)"
                )
        if self.rope_head_dim % 2 or self.positions != "rope":
            raise ConfigError(
                f"model.attention=mla rotates model.rope_head_dim={self.rope_head_dim} dimensions per head: it must be "
                f"even and model.positions must be rope (got {self.positions!r})"
            )
        if self.bias or self.qkv_bias or self.qk_norm:
            raise ConfigError(
                "model.attention=mla has no biases and no per-head query/key norms (as in DeepSeek-V2/V3); set "
                "model.bias, model.qkv_bias and model.qk_norm to false"
            )
        if self.kv_heads != self.heads:
            raise ConfigError(
                f"model.attention=mla gives every query head its own keys and values from the latent; "
                f"model.kv_heads={self.kv_heads} must be null or model.heads={self.heads}"
            )

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture-of-experts MLP."""
        m = self.moe
        return m is not None and layer >= m.first_dense and (layer - m.first_dense) % m.every == 0

    @property
    def moe_layers(self) -> int:
        """Blocks with a mixture-of-experts MLP."""
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.kv_heads

    @property
    def cached(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """What one layer caches per token of a sequence when generating, as (heads, width) per array: keys and
        values, ``kv_heads`` of ``head_dim`` each; under latent attention the latent (one of ``kv_lora_rank``)
        and the rotary key (one of ``rope_head_dim``), from which every head's keys and values are made."""
        if self.attention == "mla":
            return (1, self.kv_lora_rank), (1, self.rope_head_dim)
        return (self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)

    @property
    def attn_width(self) -> int:
        """Attention's inner width: query heads x head width."""
        return self.heads * self.head_dim

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (three matrices)."""
        return self.mlp in GATED
