"""Predicted step time of a vision-language model: one SPMD program over all devices vs MPMD submeshes.

Each module is priced by :func:`hyperjax.cost.estimate` as a transformer of its own shape: the encoder
as a bidirectional ViT over its patch tokens (its projection to the language model's width priced as
an output layer), the language model over ``[image tokens; text]``.

- **SPMD**: one strategy for the whole model on all devices. Every candidate the planner enumerates
  (without pipeline stages, which would cut through both modules) is priced for both modules, and the
  step is the sum; it must fit with both modules' memory together.
- **MPMD**: the encoder on ``n`` devices and the language model on the rest, each with its own best
  strategy, running as a two-stage pipeline of ``m`` micro-batches: ``m * max(a, b) + min(a, b)`` for
  per-micro-batch stage times ``a`` and ``b`` (fill and drain), plus the hand-over of image tokens.
  ``n`` is searched over whole nodes of the preset's first tier.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyperjax.cost.collectives import collective_time
from hyperjax.cost.estimate import Estimate, estimate
from hyperjax.cost.planner import apply, strategies
from hyperjax.errors import ConfigError, HyperjaxError
from hyperjax.topology import Hardware, axis_spans
from hyperjax.train.config import Config


def module_configs(cfg: Config) -> dict[str, Config]:
    """The encoder and the language model of ``cfg`` as configs of their own (same batch and dtype)."""
    m, v = cfg.model, cfg.model.vision
    if v is None:
        raise ConfigError("the SPMD vs MPMD comparison needs model.vision")
    encoder = v.as_model(m.d_model)  # the projection to the language model's width, priced as an output layer
    language = dataclasses.replace(m, vision=None, seq_len=m.seq_len + v.patches)
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline=1, virtual_stages=1))
    return {
        "encoder": dataclasses.replace(plain, model=encoder),
        "language_model": dataclasses.replace(plain, model=language),
    }


def _fits_first(cfg: Config, hw: Hardware, overrides: dict[str, Any]) -> tuple[dict[str, Any], Estimate] | None:
    for recompute in ("none", "selective", "full"):
        o = {**overrides, "train.recompute": recompute}
        est = estimate(apply(cfg, o), hw)
        if est.fits:
            return o, est
    return None


def best_module(cfg: Config, hw: Hardware, devices: int) -> tuple[dict[str, Any], Estimate] | None:
    """The fastest strategy without pipeline stages for one module on ``devices`` devices (None: none fits)."""
    best = None
    for combination in strategies(cfg, devices):
        if combination.get("parallel.pipeline", 1) != 1:
            continue
        try:
            found = _fits_first(cfg, hw, combination)
        except HyperjaxError:
            continue
        if found and (best is None or found[1].step_time_s < best[1].step_time_s):
            best = found
    return best


def spmd(cfg: Config, hw: Hardware, devices: int) -> dict[str, Any]:
    """The best single strategy for both modules on all devices."""
    mods = module_configs(cfg)
    best: dict[str, Any] | None = None
    for combination in strategies(mods["language_model"], devices):
        if combination.get("parallel.pipeline", 1) != 1:
            continue
        for recompute in ("none", "selective", "full"):
            o = {**combination, "train.recompute": recompute}
            try:
                ests = {k: estimate(apply(c, o), hw) for k, c in mods.items()}
            except HyperjaxError:
                break
            peak = sum(e.memory_per_device_gib["peak"] for e in ests.values())
            if peak * 2**30 > hw.device.hbm_bytes:
                continue
            step = sum(e.step_time_s for e in ests.values())
            if best is None or step < best["step_time_s"]:
                best = {
                    "step_time_s": step,
                    "strategy": o,
                    "module_step_s": {k: e.step_time_s for k, e in ests.items()},
                    "peak_gib": peak,
                }
            break
    if best is None:
        raise ConfigError(f"no single strategy fits both modules on {devices} devices")
    return best


def mpmd(cfg: Config, hw: Hardware, devices: int, *, microbatches: int = 8) -> dict[str, Any]:
    """The best encoder / language-model split, each submesh with its own best strategy."""
    mods = module_configs(cfg)
    node = hw.tiers[0].group_size or 1
    m = cfg.model
    boundary = cfg.train.global_batch / microbatches * m.vision.patches * m.d_model * 2  # image tokens, bf16
    best: dict[str, Any] | None = None
    cache: dict[tuple[str, int], Any] = {}
    for n in range(node, devices // 2 + 1, node):
        found = {}
        for name, size in (("encoder", n), ("language_model", devices - n)):
            if (name, size) not in cache:
                cache[(name, size)] = best_module(mods[name], hw, size)
            found[name] = cache[(name, size)]
        if None in found.values():
            continue
        a = found["encoder"][1].step_time_s / microbatches
        b = found["language_model"][1].step_time_s / microbatches
        span = axis_spans(hw, {"pipeline": 2, "rest": devices // 2})["pipeline"]
        hand_over = 2 * collective_time("send", boundary, span, hw)  # activations forward, gradients back
        step = microbatches * max(a, b) + min(a, b) + microbatches * hand_over
        if best is None or step < best["step_time_s"]:
            best = {
                "step_time_s": step,
                "devices": {"encoder": n, "language_model": devices - n},
                "strategies": {k: v[0] for k, v in found.items()},
                "module_step_s": {k: v[1].step_time_s for k, v in found.items()},
                "microbatches": microbatches,
            }
    if best is None:
        raise ConfigError(f"no split of {devices} devices fits both modules")
    return best
