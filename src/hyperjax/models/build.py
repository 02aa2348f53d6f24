"""Building a model from its config: a decoder, or a vision-language model when ``model.vision`` is set."""

from __future__ import annotations

from flax import nnx

from hyperjax.config import Activation, DType, Fp8Config, ModelConfig, Overlap, Recompute, choices
from hyperjax.errors import ConfigError, expect, integral
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
      ConfigError: ``cfg`` is not a :class:`ModelConfig`; a ``recompute``, ``dtype``, ``overlap`` or
        ``recompute_modules`` outside its vocabulary, modules named without selective recomputation, a seed
        that is not an integer, ``policies`` not one per layer, or an overlap a vision-language model cannot run.
    """
    expect(cfg, ModelConfig, "build_model(cfg): cfg", "pass a config's model: build_model(config.model)")
    for key, value, kind in (
        ("recompute", recompute, Recompute),
        ("dtype", dtype, DType),
        ("overlap", overlap, Overlap),
    ):
        if value not in choices(kind):
            raise ConfigError(f"{key}={value!r} is not one of {choices(kind)}")
    if recompute_modules is not None:
        if isinstance(recompute_modules, str) or not set(recompute_modules) <= set(choices(Activation)):
            raise ConfigError(
                f"recompute_modules={recompute_modules!r} must be a tuple of one or more of {choices(Activation)}"
            )
        if recompute != "selective" or not recompute_modules:
            raise ConfigError(
                f"recompute_modules={tuple(recompute_modules)} names what selective recomputation recomputes, "
                f"but recompute={recompute!r}; pass recompute='selective' or drop recompute_modules"
            )
    if not integral(seed):
        raise ConfigError(f"seed={seed!r} must be an integer")
    if policies is not None and len(policies) != cfg.layers:
        raise ConfigError(f"policies has {len(policies)} entries; give one per layer (model.layers={cfg.layers})")
    rngs = nnx.Rngs(params=int(seed))  # a NumPy integer too
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
