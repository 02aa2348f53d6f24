"""Errors raised for user input.

Every mistake a user can make in a configuration, a command line or a call into the public API raises a
subclass of :class:`HyperjaxError`. Its message names the offending value, the sizes involved and the fix;
the command-line interface prints it without a traceback and exits with status 2.
"""

from __future__ import annotations


class HyperjaxError(ValueError):
    """A mistake in user input: a configuration key, a preset, a command-line flag or an API argument."""


class PresetError(HyperjaxError):
    """A hardware preset that cannot be found or whose contents are invalid."""


class MeshError(HyperjaxError):
    """Mesh axes that do not fit the devices or the hardware."""


class EmulationError(HyperjaxError):
    """An emulated-device request that cannot run on this machine (device and process counts)."""


class ShardingError(HyperjaxError):
    """A strategy that cannot shard a tensor: no rule, indivisible sizes, or a mesh axis used twice."""


class ConfigError(HyperjaxError):
    """A configuration key with a wrong name, type or value."""
