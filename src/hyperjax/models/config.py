"""The model configuration: one frozen dataclass for both families, a comment per field."""

from __future__ import annotations

import dataclasses

from hyperjax.errors import ConfigError

FAMILIES = ("gpt", "llama")


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
        for key in ("layers", "d_model", "heads", "d_ff", "image_size", "patch", "channels"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.vision.{key}={value!r} must be a positive integer")
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
    """Shape of a decoder-only transformer (the ``model:`` section of a config)."""

    family: str = (
        "gpt"  # gpt: learned positions, LayerNorm, GELU MLP, tied embeddings; llama: RoPE, RMSNorm, SwiGLU, GQA
    )
    layers: int = 4  # transformer blocks
    d_model: int = 256  # residual stream width
    heads: int = 8  # query heads; d_model must divide by it
    kv_heads: int | None = None  # key/value heads (grouped-query attention); None: as many as heads
    d_ff: int = 1024  # MLP hidden width
    vocab: int = 256  # vocabulary size (256 for byte-level text)
    seq_len: int = 128  # tokens per sequence (text tokens; a vision model's patch tokens come in front)
    vision: VisionConfig | None = None  # an image encoder in front of the language model (llama family)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is not one of {FAMILIES}")
        for key in ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key}={value!r} must be a positive integer")
        if self.d_model % self.heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}; "
                "choose heads that divide d_model"
            )
        if self.vision is not None and self.family != "llama":
            raise ConfigError(
                f"model.vision needs model.family: llama (rotary positions cover the image tokens); got {self.family!r}"
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ConfigError(
                f"model.kv_heads={self.kv_heads} must be a positive divisor of model.heads={self.heads} "
                "(or null for multi-head attention)"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.heads

    @property
    def block_matrix_params(self) -> int:
        """Parameters in one block's attention and MLP matrices (what tensor parallelism splits)."""
        attn = (
            self.d_model * (self.heads + 2 * self.n_kv_heads) * self.head_dim
            + self.heads * self.head_dim * self.d_model
        )
        return attn + self.d_model * self.d_ff * (3 if self.family == "llama" else 2)

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.heads if self.kv_heads is None else self.kv_heads
