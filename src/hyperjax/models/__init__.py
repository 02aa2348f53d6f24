"""Transformer models in flax NNX whose parameters carry logical axes, described by their parts."""

from hyperjax.models.build import build_model
from hyperjax.models.decode import Generation, generate
from hyperjax.models.layers import no_constraint
from hyperjax.models.transformer import BlockPolicy, Transformer, count_params, recompute_policy
from hyperjax.models.vlm import VisionLanguageModel

__all__ = [
    "BlockPolicy",
    "Generation",
    "Transformer",
    "VisionLanguageModel",
    "build_model",
    "count_params",
    "generate",
    "no_constraint",
    "recompute_policy",
]
