"""The model's description: its shape and its parts, one frozen dataclass with a comment per field.

An architecture is described by its parts (norm, MLP kind, positions, block layout, biases, tied
embeddings, head width), which the NNX models and the cost model both read. ``family`` is a preset that
fills the parts not given: ``gpt`` is nanoGPT's GPT-2 (LayerNorm, GELU, learned positions, biases, tied
embeddings), ``llama`` is Llama's (RMSNorm, SwiGLU, rotary positions, no biases, a separate head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hyperjax.config.checks import positive, vocabularies
from hyperjax.config.types import GATED, BlockLayout, Family, MLPKind, Norm, Positions
from hyperjax.errors import ConfigError

FAMILY_PARTS: Mapping[str, Mapping[str, Any]] = {
    "gpt": {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "tie_embeddings": True, "bias": True},
    "llama": {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "tie_embeddings": False, "bias": False},
}
"""What each family preset fills in (a part given in the config wins)."""


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
        positive(self, "model.vision", ("layers", "d_model", "heads", "d_ff", "image_size", "patch", "channels"))
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
class ModelConfig:
    """A decoder-only transformer (the ``model:`` section of a config): its shape and its parts.

    Parts left ``null`` are filled by the ``family`` preset when the config is read (:data:`FAMILY_PARTS`),
    so every field of a constructed ``ModelConfig`` is explicit.
    """

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
    rope_theta: float = 10000.0  # rotary base frequency (positions: rope)
    tie_embeddings: bool | None = None  # the output projection is the embedding table; null: the family's
    bias: bool | None = None  # biases on every projection and LayerNorm shifts; null: the family's
    block: BlockLayout = "sequential"  # sequential (pre-norm attention then MLP) or parallel (GPT-J / PaLM)
    vision: VisionConfig | None = None  # an image encoder in front of the language model (positions: rope)

    def __post_init__(self) -> None:
        vocabularies(self, "model")
        positive(self, "model", ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len"))
        positive(self, "model", ("kv_heads", "head_dim"), optional=True)
        for key, value in FAMILY_PARTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # the preset fills what the config leaves open
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
        if not self.rope_theta > 0:
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
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:  # computed once: the cost model keys its caches by model
        return self._hash

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.kv_heads

    @property
    def attn_width(self) -> int:
        """Attention's inner width: query heads x head width."""
        return self.heads * self.head_dim

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (three matrices)."""
        return self.mlp in GATED
