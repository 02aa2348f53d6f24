"""hyperjax: a JAX runtime that treats a 384-accelerator supernode as one logical computer.

The flow, one way: a :class:`Config` (read with :func:`load_config`) is resolved once into a frozen
:class:`Run` (:func:`resolve`); :func:`estimate` prices it, :func:`plan` searches strategies by pricing
resolved candidates, the offload pass places its tensors, and :func:`train` runs it on the emulated mesh.
A config with an ``rl:`` section resolves into an :class:`RLRun` of two phases (:func:`resolve_rl`), priced
by :func:`estimate_rl`, searched by :func:`plan_rl` and run by :func:`train_rl`.
The public API is exactly what this module re-exports.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each name is, for type checkers and editors
    from hyperjax.config import Config, ModelConfig, RLRun, Run, Stage, load_config
    from hyperjax.cost import Estimate, RLEstimate, estimate, estimate_rl
    from hyperjax.emulate import start_devices
    from hyperjax.errors import ConfigError, EmulationError, HyperjaxError, MeshError, PresetError, ShardingError
    from hyperjax.models import build_model
    from hyperjax.mpmd import Schedule, make_schedule
    from hyperjax.offload import Placement, offload_pass
    from hyperjax.resolver import resolve, resolve_rl
    from hyperjax.rl import RLResult, train_rl
    from hyperjax.search import Candidate, plan, plan_rl
    from hyperjax.shard import Explanation, Strategy, mesh_axes_for, strategy_for
    from hyperjax.topology import (
        AxisSpan,
        DeviceSpec,
        Hardware,
        HostSpec,
        Tier,
        axis_spans,
        default_axes,
        list_presets,
        load_hardware,
        make_mesh,
        parse_axes,
    )
    from hyperjax.train import RunResult, train

_EXPORTS = {
    "AxisSpan": "hyperjax.topology",
    "Candidate": "hyperjax.search",
    "Config": "hyperjax.config",
    "ConfigError": "hyperjax.errors",
    "DeviceSpec": "hyperjax.topology",
    "EmulationError": "hyperjax.errors",
    "Estimate": "hyperjax.cost",
    "Explanation": "hyperjax.shard",
    "Hardware": "hyperjax.topology",
    "HostSpec": "hyperjax.topology",
    "HyperjaxError": "hyperjax.errors",
    "MeshError": "hyperjax.errors",
    "ModelConfig": "hyperjax.config",
    "Placement": "hyperjax.offload",
    "PresetError": "hyperjax.errors",
    "RLEstimate": "hyperjax.cost",
    "RLResult": "hyperjax.rl",
    "RLRun": "hyperjax.config",
    "Run": "hyperjax.config",
    "RunResult": "hyperjax.train",
    "Schedule": "hyperjax.mpmd",
    "ShardingError": "hyperjax.errors",
    "Stage": "hyperjax.config",
    "Strategy": "hyperjax.shard",
    "Tier": "hyperjax.topology",
    "axis_spans": "hyperjax.topology",
    "build_model": "hyperjax.models",
    "default_axes": "hyperjax.topology",
    "estimate": "hyperjax.cost",
    "estimate_rl": "hyperjax.cost",
    "list_presets": "hyperjax.topology",
    "load_config": "hyperjax.config",
    "load_hardware": "hyperjax.topology",
    "make_mesh": "hyperjax.topology",
    "make_schedule": "hyperjax.mpmd",
    "mesh_axes_for": "hyperjax.shard",
    "offload_pass": "hyperjax.offload",
    "parse_axes": "hyperjax.topology",
    "plan": "hyperjax.search",
    "plan_rl": "hyperjax.search",
    "resolve": "hyperjax.resolver",
    "resolve_rl": "hyperjax.resolver",
    "start_devices": "hyperjax.emulate",
    "strategy_for": "hyperjax.shard",
    "train": "hyperjax.train",
    "train_rl": "hyperjax.rl",
}
"""Where each public name lives. A name is imported on first use, so a command loads only the rooms it
needs: an emulated process of ``hyperjax selftest`` starts without the cost model or the models."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyperjax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """This package: importing a subpackage binds it as an attribute here, and the subpackage
    ``hyperjax.train`` would then hide the function ``hyperjax.train`` (an eager ``__init__`` rebinds the
    name after its import; a lazy one must refuse the binding)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _EXPORTS:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "AxisSpan",
    "Candidate",
    "Config",
    "ConfigError",
    "DeviceSpec",
    "EmulationError",
    "Estimate",
    "Explanation",
    "Hardware",
    "HostSpec",
    "HyperjaxError",
    "MeshError",
    "ModelConfig",
    "Placement",
    "PresetError",
    "RLEstimate",
    "RLResult",
    "RLRun",
    "Run",
    "RunResult",
    "Schedule",
    "ShardingError",
    "Stage",
    "Strategy",
    "Tier",
    "axis_spans",
    "build_model",
    "default_axes",
    "estimate",
    "estimate_rl",
    "list_presets",
    "load_config",
    "load_hardware",
    "make_mesh",
    "make_schedule",
    "mesh_axes_for",
    "offload_pass",
    "parse_axes",
    "plan",
    "plan_rl",
    "resolve",
    "resolve_rl",
    "start_devices",
    "strategy_for",
    "train",
    "train_rl",
]
