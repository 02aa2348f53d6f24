"""Building a model from its config: a decoder, or a vision-language model when ``model.vision`` is set."""

from __future__ import annotations

from flax import nnx

from hyperjax.config import Activation, DType, Fp8Config, ModelConfig, Overlap, Recompute, choices
from hyperjax.errors import ConfigError
from hyperjax.models.transformer import BlockPolicy, Transformer
from hyperjax.models.vlm import VisionLanguageModel


def build_model(
    cfg: ModelConfig,
    *,
    dtype: DType = "float32",
    recompute: Recompute = "none",
    recompute_modules: tuple[Activation, ...] | None = None,
    seed: int = 0,
    policies: tuple[BlockPolicy, ...] | None = None,
    overlap: Overlap = "none",
    fp8: Fp8Config | None = None,
) -> Transformer | VisionLanguageModel:
    """Initialise a model of ``cfg`` from ``seed`` (the same parameters on any mesh).

    A :class:`Transformer`, or with ``cfg.vision`` a :class:`VisionLanguageModel`. ``policies`` (one per
    block, e.g. from an offload placement) say what a decoder's blocks keep for backward; ``None``: what
    ``recompute`` says (``selective`` recomputes ``recompute_modules``, by default the attention core).
    ``overlap`` (``parallel.overlap``): ``two-microbatch`` runs a decoder's micro-batches
    as two halves. ``fp8`` (``train.fp8``): the blocks' linear layers multiply in FP8 by that recipe.

    Raises:
      ConfigError: a ``recompute`` or ``dtype`` outside its vocabulary, or an overlap a vision-language
        model cannot run.
    """
    if recompute not in choices(Recompute):
        raise ConfigError(f"train.recompute={recompute!r} is not one of {choices(Recompute)}")
    if dtype not in choices(DType):
        raise ConfigError(f"train.dtype={dtype!r} is not one of {choices(DType)}")
    rngs = nnx.Rngs(params=seed)
    if cfg.vision is not None:
        if overlap == "two-microbatch":
            raise ConfigError(
                "parallel.overlap='two-microbatch' runs a decoder's micro-batch as two halves; a vision-language "
                "model does not split its micro-batches; set parallel.overlap: none"
            )
        return VisionLanguageModel(cfg, dtype=dtype, recompute=recompute, modules=recompute_modules, rngs=rngs, fp8=fp8)
    return Transformer(
        cfg,
        dtype=dtype,
        recompute=recompute,
        recompute_modules=recompute_modules,
        rngs=rngs,
        policies=policies,
        overlap=overlap,
        fp8=fp8,
    )
