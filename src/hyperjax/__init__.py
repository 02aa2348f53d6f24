"""hyperjax: a JAX runtime that treats a 384-accelerator supernode as one logical computer.

The flow, one way: a :class:`Config` (read with :func:`load_config`) is resolved once into a frozen
:class:`Run` (:func:`resolve`); :func:`estimate` prices it, :func:`plan` searches strategies by pricing
resolved candidates, the offload pass places its tensors, and :func:`train` runs it on the emulated mesh.
The public API is exactly what this module re-exports.
"""

from hyperjax.config import Config, ModelConfig, Run, Stage, load_config
from hyperjax.cost import Estimate, estimate
from hyperjax.emulate import start_devices
from hyperjax.errors import ConfigError, EmulationError, HyperjaxError, MeshError, PresetError, ShardingError
from hyperjax.models import build_model
from hyperjax.mpmd import Schedule, make_schedule
from hyperjax.offload import Placement, offload_pass
from hyperjax.resolver import resolve
from hyperjax.search import Candidate, plan
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
    "list_presets",
    "load_config",
    "load_hardware",
    "make_mesh",
    "make_schedule",
    "mesh_axes_for",
    "offload_pass",
    "parse_axes",
    "plan",
    "resolve",
    "start_devices",
    "strategy_for",
    "train",
]
