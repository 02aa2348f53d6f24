"""The model configuration: one frozen dataclass for both families, a comment per field."""

from __future__ import annotations

import dataclasses

from hyperjax.errors import ConfigError

FAMILIES = ("gpt", "llama")


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
    seq_len: int = 128  # tokens per sequence

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
    def n_kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.heads if self.kv_heads is None else self.kv_heads
