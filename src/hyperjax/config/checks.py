"""Validation helpers shared by the config dataclasses: each names the key, the value and what it must be."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

from hyperjax.errors import ConfigError


class Filled:
    """A frozen config section that fills the fields of :attr:`FILLED` left ``None`` from its other values.

    :meth:`replace` fills them again from the new values; ``dataclasses.replace`` passes the filled values on
    as if given. The section calls :meth:`note_open` in ``__post_init__`` before filling anything. So two equal
    sections, one given a value the other filled, may replace differently: what was given is kept."""

    FILLED: ClassVar[frozenset[str]] = frozenset()
    _open: frozenset[str] = frozenset()  # of FILLED, those left None (set by note_open)

    def note_open(self) -> None:
        """Remember which of :attr:`FILLED` were left ``None`` (to be filled)."""
        object.__setattr__(self, "_open", frozenset(n for n in self.FILLED if getattr(self, n) is None))

    def replace(self, **changes: Any) -> Self:
        """This section with ``changes``, the fields it was not given filled again from the new values (a field
        set to ``None`` is filled too)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self._open}
        return type(self)(**{**given, **changes})


def positive(obj: Any, section: str, keys: Sequence[str], *, optional: bool = False) -> None:
    """Each of ``keys`` of ``obj`` is a positive integer (or, ``optional``, ``None``)."""
    for key in keys:
        value = getattr(obj, key)
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{section}.{key}={value!r} must be a positive integer{' or null' if optional else ''}")


LAYER_LIMIT = 10_000
"""The most blocks a model (or its vision encoder) may have: each is counted, placed and priced one by one,
which at this depth takes seconds (the deepest transformers trained have about a thousand)."""


def at_most_layers(layers: int, key: str) -> None:
    """``layers`` (the value of config key ``key``) is at most :data:`LAYER_LIMIT`."""
    if layers > LAYER_LIMIT:
        raise ConfigError(
            f"{key}={layers:,} is more than the {LAYER_LIMIT:,} blocks hyperjax counts, places and prices one by "
            f"one (at {LAYER_LIMIT:,} that takes seconds); give {key} of at most {LAYER_LIMIT:,}"
        )


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


def check_fields(obj: Any, section: str) -> None:
    """Every field of dataclass ``obj`` holds a value of its annotated type, as a config built in Python
    may not (YAML is checked as it is read): a bool for a bool, an integer (not a bool) for an int, a finite
    number for a float, a word of its vocabulary (:func:`vocabularies`), a section for a section. A list
    given for a tuple is kept as a tuple.

    Raises:
      ConfigError: naming ``section.key`` (the key alone for the top level, ``section=""``), the value, the
        type expected and the type given.
    """
    vocabularies(obj, section)
    for name, hint in field_hints(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, list) and _tuple_hint(hint):
            value = tuple(value)
            object.__setattr__(obj, name, value)
        key = f"{section}.{name}" if section else name
        if not _matches(value, hint):
            raise ConfigError(
                f"{key}={value!r} has the wrong type: expected {type_name(hint)}, got {type(value).__name__}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")


def type_name(hint: Any) -> str:
    """A type hint as a config's reader would write it (``int | None``)."""
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


@functools.cache
def field_hints(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(field, type hint)`` of each field of dataclass ``cls``, in order (read once per class)."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def hint_options(hint: Any) -> tuple[Any, ...]:
    """The types a hint allows: a union's members, else the hint itself."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return typing.get_args(hint) if union else (hint,)


def _tuple_hint(hint: Any) -> bool:
    return any(typing.get_origin(o) is tuple for o in hint_options(hint))


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (the forms config sections use)."""
    if hint is Any:
        return True
    options = hint_options(hint)
    if len(options) > 1:
        return any(_matches(value, o) for o in options)
    origin = typing.get_origin(hint)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        item = str if typing.get_origin(item) is typing.Literal else item  # words: checked by the section
        return isinstance(value, tuple) and all(_matches(x, item) for x in value)
    if origin in (Mapping, dict):
        return isinstance(value, Mapping)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    return True


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
