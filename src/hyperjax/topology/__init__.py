"""The machine: hardware presets and meshes shaped like its interconnect."""

from hyperjax.topology.hardware import (
    DeviceSpec,
    Hardware,
    HostSpec,
    Tier,
    list_presets,
    load_hardware,
)
from hyperjax.topology.mesh import AxisSpan, axis_spans, check_axes, default_axes, make_mesh, parse_axes

__all__ = [
    "AxisSpan",
    "DeviceSpec",
    "Hardware",
    "HostSpec",
    "Tier",
    "axis_spans",
    "check_axes",
    "default_axes",
    "list_presets",
    "load_hardware",
    "make_mesh",
    "parse_axes",
]
