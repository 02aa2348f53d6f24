"""Resolution: a :class:`hyperjax.Config` turned, once, into the :class:`hyperjax.Run` it describes."""

from hyperjax.resolver.checks import check_attention_impl, check_dispatcher_sms, check_preset
from hyperjax.resolver.elastic import elastic_overrides
from hyperjax.resolver.resolve import DEFAULT_DEVICES, check_zero, device_count, resolve
from hyperjax.resolver.rl import (
    check_learner_split,
    check_rollout_modifiers,
    check_rollout_split,
    learner_config,
    phase_config,
    resolve_rl,
)
from hyperjax.resolver.stages import MODULES, balance_layers

__all__ = [
    "DEFAULT_DEVICES",
    "MODULES",
    "balance_layers",
    "check_attention_impl",
    "check_dispatcher_sms",
    "check_learner_split",
    "check_preset",
    "check_rollout_modifiers",
    "check_rollout_split",
    "check_zero",
    "device_count",
    "elastic_overrides",
    "learner_config",
    "phase_config",
    "resolve",
    "resolve_rl",
]
