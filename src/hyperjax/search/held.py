"""The settings a search is held to (``plan --where``, ``hyperjax.plan(where=)``): which strategies have them,
and the config's modifiers no such strategy can honour."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyperjax.config import Config
from hyperjax.config.parallel import FEATURES, MODIFIERS, idle_modifiers, modifier_value, set_modifiers
from hyperjax.errors import ConfigError, HyperjaxError, written
from hyperjax.resolver.checks import idle_settings, set_settings
from hyperjax.search.strategies import laid_out, micro_batches


def holds(cfg: Config, combo: dict[str, Any], where: Mapping[str, Any]) -> bool:
    """Whether ``combo`` has the settings of ``where``. A strategy without a key (a dense model's expert
    degree, an MPMD split's whole-run degrees) passes it; the micro-batch's rows and count are compared as
    the step runs them (one stage of every row at once runs one micro-batch of all its rows)."""
    if "parallel.data" in combo:  # a whole-run strategy: its micro-batches as the step runs them
        rows, count = micro_batches(cfg, combo)
        combo = {**combo, "train.micro_batch": rows, "train.microbatches": count}
    return all(combo.get(key, value) == value for key, value in where.items())


def check_held_modifiers(cfg: Config, combinations: list[dict[str, Any]], where: Mapping[str, Any]) -> None:
    """The config's modifiers (``parallel.fsdp_reshard``, ``tp_overlap``, ..., a mixture of experts'
    ``dispatcher``, ``train.fp8.all_gather``) act in some strategy ``where`` leaves: one that every such
    strategy turns off would be reset in each candidate unsaid, and is named instead.

    Raises:
      ConfigError: naming the modifier, the held keys and the fix.
    """
    kept = [f"parallel.{k}" for k in set_modifiers(cfg.parallel)] + list(set_settings(cfg))
    laid_any = False  # a held layout the config refuses altogether is named by the search, not here
    for c in combinations if kept else ():
        try:
            laid = laid_out(cfg, c)
        except HyperjaxError:  # a strategy its config refuses runs nothing: not one that has the feature
            continue
        laid_any = True
        p, subs = laid.parallel, laid.mpmd.submeshes
        idle = {f"parallel.{k}" for k in idle_modifiers(p, subs)} | set(idle_settings(laid))
        if not (kept := [k for k in kept if k in idle]):
            return
    if laid_any and kept:
        key, held = kept[0], ", ".join(f"{k}={written(v)}" for k, v in where.items())
        field = key.removeprefix("parallel.")
        feature = FEATURES[MODIFIERS[field]] if field in MODIFIERS else IDLE_FEATURES[key]
        value = modifier_value(getattr(cfg.parallel, field)) if field in MODIFIERS else written(set_settings(cfg)[key])
        raise ConfigError(
            f"{key}={value} says how {feature} runs, but no strategy the search tries with {held} has "
            f"it; remove {key}, or hold a layout that has it"
        )


IDLE_FEATURES = {
    "parallel.dispatcher": "a mixture of experts' token exchange",
    "parallel.dispatcher_sms": "a mixture of experts' token exchange",
    "train.fp8.all_gather": "FSDP",
}
"""What each key of :data:`~hyperjax.resolver.checks.IDLE_DEFAULTS` modifies, as an error names it."""
