"""Transformer models in flax NNX whose parameters carry logical axes, described by their parts."""

from hyperjax.models.build import build_model
from hyperjax.models.layers import no_constraint
from hyperjax.models.transformer import BlockPolicy, Transformer, count_params, recompute_policy
from hyperjax.models.vlm import VisionLanguageModel

__all__ = [
    "BlockPolicy",
    "Transformer",
    "VisionLanguageModel",
    "build_model",
    "count_params",
    "no_constraint",
    "recompute_policy",
]
