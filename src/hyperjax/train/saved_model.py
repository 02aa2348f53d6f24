"""The model a checkpoint was written for, recorded beside its arrays and checked when it is read.

Tensor shapes alone do not tell two models apart: a GELU MLP and a ReLU one, LayerNorm and RMSNorm, rotary
pairs interleaved or in halves, two norm epsilons hold the same arrays and compute different functions. A
checkpoint's record (its ``meta``) therefore keeps the model's architecture, :func:`model_record`, and a run
that reads the checkpoint (``train --resume``, ``generate``, ``export-hf``, ``rl.init_checkpoint``) refuses
another one, naming the first key that differs (:func:`check_model`). A checkpoint written before the record
existed is read as before.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hyperjax.config import ModelConfig
from hyperjax.errors import ConfigError

RUN_SETTINGS = frozenset(
    {
        "family",  # a preset that fills the parts, which are compared themselves
        "seq_len",  # how long the run's sequences are (learned positions' table shape says the rest)
        "rope_theta",  # context extension: a larger base for long-context training from these weights,
        "rope_scaling",  # or YaRN at inference (Qwen3's model card)
        "attention_kernel",  # how attention is computed, not what
        "attention_impl",
        "moe.capacity_factor",  # how many tokens an expert takes in this run
        "moe.load_imbalance",  # the cost model's
        "moe.balance",  # how training balances the router (a routing bias is a tensor of its own)
        "moe.aux_loss_weight",
        "moe.bias_update_rate",
    }
)
"""``model.*`` keys (without ``model.``) a checkpoint's reader may set as it likes: they belong to a run, not to
the function the weights compute."""


def model_record(m: ModelConfig) -> dict[str, Any]:
    """``m``'s architecture as JSON data: every key of ``model:`` but :data:`RUN_SETTINGS`, sections nested."""
    return _without(json.loads(json.dumps(dataclasses.asdict(m))), "")


def check_model(meta: dict[str, Any], m: ModelConfig, where: str) -> None:
    """The checkpoint whose record is ``meta`` (``where``, as errors name it) holds model ``m``.

    Raises:
      ConfigError: the first recorded key whose value ``m`` does not share, both values and the fix.
    """
    saved = meta.get("model")
    if not isinstance(saved, dict):
        return  # written before checkpoints recorded their model: the shapes were checked
    differs = _first_difference(saved, model_record(m), "")
    if differs is not None:
        key, *values = differs
        was, now = (v if isinstance(v, str) else json.dumps(v) for v in values)  # as YAML and --set write them
        raise ConfigError(
            f"{where} was written for a model with model.{key}={was}, but this config has model.{key}={now} (a "
            f"checkpoint is read only into the model it holds); set model.{key}: {was} (--set model.{key}={was}), or "
            "give a checkpoint of this model"
        )


def _without(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``d`` without :data:`RUN_SETTINGS`, at any depth (``prefix``: the keys' section)."""
    out = {}
    for k, v in d.items():
        if f"{prefix}{k}" not in RUN_SETTINGS:
            out[k] = _without(v, f"{prefix}{k}.") if isinstance(v, dict) else v
    return out


def _first_difference(saved: dict[str, Any], mine: dict[str, Any], prefix: str) -> tuple[str, Any, Any] | None:
    """The first key (sorted, sections entered where both have one) both records hold with different values,
    and both values; keys one record lacks (written by another version) are not compared."""
    for k in sorted(set(saved) & set(mine)):
        was, now = saved[k], mine[k]
        if isinstance(was, dict) and isinstance(now, dict):
            found = _first_difference(was, now, f"{prefix}{k}.")
            if found is not None:
                return found
        elif was != now:
            return f"{prefix}{k}", was, now
    return None
