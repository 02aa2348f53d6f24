"""Validation helpers shared by the config dataclasses: each names the key, the value and what it must be."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Sequence
from typing import Any

from hyperjax.errors import ConfigError


def positive(obj: Any, section: str, keys: Sequence[str], *, optional: bool = False) -> None:
    """Each of ``keys`` of ``obj`` is a positive integer (or, ``optional``, ``None``)."""
    for key in keys:
        value = getattr(obj, key)
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{section}.{key}={value!r} must be a positive integer{' or null' if optional else ''}")


def literal_options(hint: Any) -> tuple[Any, ...] | None:
    """The words of a ``Literal`` hint (also inside ``X | None``); ``None`` when the hint is not one."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    for option in typing.get_args(hint):
        if typing.get_origin(option) is typing.Literal:
            return typing.get_args(option)
    return None


def vocabularies(obj: Any, section: str) -> None:
    """Every ``Literal``-typed field of dataclass ``obj`` holds one of its words (or ``None`` where allowed).

    Raises:
      ConfigError: naming ``section.key``, the word, the choices and the closest one.
    """
    for name, words, optional in _vocabulary_fields(type(obj)):
        value = getattr(obj, name)
        if value in words or (value is None and optional):
            continue
        close = difflib.get_close_matches(str(value), [str(w) for w in words], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{section}.{name}={value!r} is not one of {words}{hint}")


@functools.cache
def _vocabulary_fields(cls: type) -> tuple[tuple[str, tuple[Any, ...], bool], ...]:
    """``(field, words, may be None)`` of each ``Literal``-typed field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        words = literal_options(hints[f.name])
        if words is not None:
            out.append((f.name, words, type(None) in typing.get_args(hints[f.name])))
    return tuple(out)
