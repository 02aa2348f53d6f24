"""Transformer models in flax NNX whose parameters carry logical axes: ``gpt`` and ``llama``."""

from hyperjax.models.config import FAMILIES, ModelConfig
from hyperjax.models.layers import no_constraint
from hyperjax.models.transformer import RECOMPUTE, Transformer, build_model, count_params

__all__ = ["FAMILIES", "RECOMPUTE", "ModelConfig", "Transformer", "build_model", "count_params", "no_constraint"]
