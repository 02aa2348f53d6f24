"""Errors raised for user input.

Every mistake a user can make in a configuration, a command line or a call into the public API raises a
subclass of :class:`HyperjaxError`. Its message names the offending value, the sizes involved and the fix;
the command-line interface prints it without a traceback and exits with status 2.
"""

from __future__ import annotations

import numbers
import re
from typing import Any


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


def expect(
    value: object, kind: type | tuple[type, ...], what: str, fix: str, error: type[HyperjaxError] = ConfigError
) -> None:
    """Refuse a public function's argument of the wrong kind, saying what it got and what to pass.

    Raises:
      error: ``value`` is not an instance of ``kind``.
    """
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        given = "None" if value is None else article(type(value).__name__)
        raise error(f"{what} is {given}, not {article(names)}; {fix}")


def article(noun: str) -> str:
    """``noun`` after "a" or "an" (an initialism as it is spoken: an RLRun; a plural type: a bytes object)."""
    noun = f"{noun} object" if noun == "bytes" else noun
    spelled = noun[:2].isupper() and noun[:1] in "AEFHILMNORSX"
    return f"{'an' if spelled or noun[:1] in 'aeiouAEIOU' else 'a'} {noun}"


def written(value: Any) -> str:
    """A config value in a message, as YAML and ``--set`` write it: ``true``, ``null``, ``4``, ``'1f1b'``."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def positive_int(value: Any, what: str, error: type[HyperjaxError] = ConfigError) -> int:
    """``value``, a count, as an ``int``: a positive integer (a NumPy one too; not ``True``).

    Raises:
      error: naming ``what`` and the value.
    """
    if not integral(value) or value < 1:
        raise error(f"{what}={value!r} must be a positive integer")
    return int(value)


def integral(value: object) -> bool:
    """Whether ``value`` is an integer (a Python or NumPy one), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def rekeyed(message: str, section: str, place: str) -> str:
    """``message`` with the keys it names under ``section`` (``parallel.tensor``) named where they really are,
    under ``place`` (``rl.learner.parallel.``: its trailing dot included)."""
    return re.sub(rf"(?<![\w.\-]){re.escape(section)}\.", lambda _: place, message)
