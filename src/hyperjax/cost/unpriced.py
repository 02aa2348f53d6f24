"""What the cost model does not price: the config's ``shard`` overrides that change a placement.

The estimate places every tensor by the standard sharding rules (:func:`hyperjax.shard.strategy_for`), whose
per-device sizes, products and collectives it counts. A ``shard:`` override that moves a logical axis the
run's model names onto or off a mesh axis of more than one device changes what a device holds and does,
which the estimate does not follow; ``predict`` and ``plan`` name each such override rather than leave it
unsaid.
"""

from __future__ import annotations

import functools
from typing import Any

from hyperjax.config import ModelConfig, Run, Stage
from hyperjax.cost.counts import decoder_tensors, encoder_tensors
from hyperjax.shard import LOGICAL_AXES, strategy_for
from hyperjax.shard.strategy import entry_axes

ALWAYS = ("batch", "seq", "res_seq", "act_embed")
"""Logical axes of the activations every module has."""


def unpriced_overrides(*runs: Run) -> tuple[str, ...]:
    """The config's ``shard`` overrides, as ``shard.<axis>=<mesh axes>``, that in some stage of ``runs`` move a
    logical axis the stage's modules name onto or off a mesh axis of more than one device. An override that
    changes nothing there (a rule restated, a mesh axis of one device, an axis the model does not name, such as
    ``kv_heads`` under latent attention) is not listed."""
    moved: dict[str, str] = {}
    for run in (r for r in runs if r.config.shard):
        standard = strategy_for(
            sequence_parallel=run.sequence_parallel,
            zero_stage=run.zero_stage,
            expert_tensor=run.expert_tensor_split,
            fsdp_context=run.config.parallel.fsdp_context,
        ).rules
        for stage in run.stages:
            named = _named(run.config.model, stage.modules)
            for k, v in run.config.shard.items():
                if k in named and _live(stage, v) != _live(stage, standard.get(k)):
                    moved[k] = "null" if v is None else v if isinstance(v, str) else f"[{', '.join(entry_axes(v))}]"
    return tuple(f"shard.{k}={moved[k]}" for k in sorted(moved))


@functools.lru_cache(maxsize=64)
def _named(m: ModelConfig, modules: tuple[str, ...]) -> frozenset[str]:
    """The logical axes the tensors and activations of ``modules`` name: each parameter's, and the
    activations' (``act_heads`` beside ``heads``, ...); remembered, as a plan asks for the same few."""
    tensors = encoder_tensors(m.vision, m.d_model) if "encoder" in modules and m.vision is not None else []
    if "decoder" in modules or "language_model" in modules:
        tensors += decoder_tensors(m)
    params = {a for t in tensors for a in t.axes if a is not None}
    return frozenset(params | set(ALWAYS) | {f"act_{a}" for a in params if f"act_{a}" in LOGICAL_AXES})


def _live(stage: Stage, target: Any) -> set[str]:
    """The mesh axes of ``target`` (a rule's mesh axis, a tuple of them, or ``None``) that span more than one
    device in ``stage``."""
    return {a for a in entry_axes(target) if stage.axes.get(a, 1) > 1}
