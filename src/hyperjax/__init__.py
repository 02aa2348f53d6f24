"""hyperjax: a JAX runtime that treats a 384-accelerator supernode as one logical computer.

The public API is exactly what this module re-exports.
"""

from hyperjax.emulate import MAX_DEVICES_PER_PROCESS, Cluster, plan_processes, start_devices
from hyperjax.errors import ConfigError, EmulationError, HyperjaxError, MeshError, PresetError, ShardingError
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

__version__ = "0.1.0"

__all__ = [
    "MAX_DEVICES_PER_PROCESS",
    "AxisSpan",
    "Cluster",
    "ConfigError",
    "DeviceSpec",
    "EmulationError",
    "Explanation",
    "Hardware",
    "HostSpec",
    "HyperjaxError",
    "MeshError",
    "PresetError",
    "ShardingError",
    "Strategy",
    "Tier",
    "axis_spans",
    "default_axes",
    "list_presets",
    "load_hardware",
    "make_mesh",
    "mesh_axes_for",
    "parse_axes",
    "plan_processes",
    "start_devices",
    "strategy_for",
]
