"""Reading a run config: YAML parsed once, at the entry point, into the frozen :class:`Config`.

``--set key=value`` overrides any key by its dotted name (``--set parallel.tensor=4``); values are read
as YAML (``true``, ``null``, ``3e-4``). Unknown keys (with a did-you-mean), wrong types, words outside a
vocabulary and out-of-range values are :class:`hyperjax.ConfigError` s that name the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from hyperjax.config import hf
from hyperjax.config.checks import field_hints, hint_options, literal_options, type_name
from hyperjax.config.hf_fields import in_file
from hyperjax.config.model_parts import MoEConfig
from hyperjax.config.sections import Config
from hyperjax.errors import ConfigError, article, rekeyed
from hyperjax.files import parse_yaml, read_yaml


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config and apply ``key=value`` overrides.

    Args:
      path: the YAML file (``None``: all defaults), or a Hugging Face ``config.json`` (or its folder), whose
        model it describes (:mod:`hyperjax.config.hf`) with every other section at its defaults.
      overrides: ``--set`` items such as ``"parallel.tensor=4"``.

    Raises:
      ConfigError: a missing, empty or malformed file, an unknown key, a wrong type, or an invalid value.
    """
    if path is not None and not isinstance(path, str | Path):
        raise ConfigError(
            f"load_config(path): path {path!r} is {article(type(path).__name__)}; give a file's path or None"
        )
    listed = isinstance(overrides, Iterable) and not isinstance(overrides, str)
    items = () if overrides is None else tuple(overrides) if listed else None  # an iterator is read once
    if items is None or not all(isinstance(item, str) for item in items):
        raise ConfigError(
            f"load_config(overrides={overrides!r}): give a list of 'key=value' strings, e.g. ['parallel.tensor=4']"
        )
    raw: dict[str, Any] = {}
    given: dict[str, Any] | None = None  # a Hugging Face config.json's fields
    if path is not None and hf.is_hf_config(path):  # a Hugging Face config.json: its model, the rest defaults
        given = hf.read_hf_config(path)
        raw = hf.run_section(given, str(path))
    elif path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a folder with no config.json in it" if path.is_dir() else "does not exist"
            raise ConfigError(
                f"config file {str(path)!r} {what}; pass the path of a YAML file, such as configs/quickstart.yaml"
            )
        raw = read_yaml(path, what="config file", error=ConfigError)
        if raw is None:
            raise ConfigError(
                f"config file {str(path)!r} is empty; give it at least one section (model:, train:, parallel:), "
                "or copy configs/quickstart.yaml"
            )
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, got {type(raw).__name__}")
    for item in items:
        refuse_new_part(raw, item)
        apply_override(raw, item)
    config = build(Config, raw, "") if given is None else build_imported(raw, given, str(hf.config_file(path)), items)
    if "global_batch" in (raw.get("train") or {}):  # given, even as the default: an rl: config's must agree
        config.check_rl_batch()
    return config


def build_imported(raw: dict[str, Any], given: dict[str, Any], where: str, sets: Sequence[str]) -> Config:
    """The config of ``raw``, read from the Hugging Face ``config.json`` fields ``given`` (at ``where``) with
    ``--set`` items ``sets``: a size refused is named by the file's field too (:func:`in_file`)."""
    try:
        return build(Config, raw, "")
    except ConfigError as e:
        raise in_file(e, given, where, sets) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override to the raw mapping in place.

    Raises:
      ConfigError: the item is not ``key=value`` or the value is not valid YAML.
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r} is not KEY=VALUE; e.g. --set parallel.tensor=4")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as e:
        why = f" ({e.problem})" if getattr(e, "problem", None) else ""
        raise ConfigError(f"--set {item!r}: value {text!r} is not valid YAML{why}") from None
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def refuse_new_part(raw: dict[str, Any], item: str) -> None:
    """A dotted ``--set`` key inside ``model.moe`` of a model without experts, other than ``experts``: it
    would build an 8-expert section (the default count) that nothing asked for.

    Raises:
      ConfigError: naming the key, the count it would take and the forms that mean it.
    """
    parts = item.partition("=")[0].strip().split(".")
    if len(parts) < 3 or parts[:2] != ["model", "moe"] or parts[2] == "experts":
        return
    if parts[2] not in {f.name for f in dataclasses.fields(MoEConfig)}:
        return  # an unknown key: building the section names it, with a did-you-mean
    model = raw.get("model")
    if isinstance(model, dict) and model.get("moe") is not None:
        return
    key, value = parts[2], item.partition("=")[2].strip()
    raise ConfigError(
        f"--set {item!r}: this model has no experts (no model.moe section), so the key would make it a mixture "
        f"of {MoEConfig().experts} experts (the default count) with every other model.moe key at its default; "
        f"give the count first (--set model.moe.experts=N) or the section whole "
        f"(--set 'model.moe={{experts: N, {key}: {value}}}'), else drop the key"
    )


_UNSET = object()


def check_key(key: str, what: str, value: Any = _UNSET) -> Any:
    """``key`` is a dotted config key (``parallel.tensor``, ``rl.learner.parallel.tensor``); given a ``value``,
    that value as the config would hold it (a NumPy scalar as Python's), its type checked as a config file's is.

    Raises:
      ConfigError: naming ``what`` (the argument it came in), with a did-you-mean; or the value's type.
    """
    if not isinstance(key, str):
        raise ConfigError(f"{what}: key {key!r} is not a dotted config key such as 'parallel.tensor'")
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = dict(field_hints(cls))
        if part not in hints:
            close = difflib.get_close_matches(part, sorted(hints), n=1)
            head = ".".join([*parts[:i], close[0]]) if close else ""
            raise ConfigError(f"{what}: unknown config key {key}" + (f"; did you mean {head}?" if close else ""))
        nested = [o for o in hint_options(hints[part]) if dataclasses.is_dataclass(o)]
        if i + 1 < len(parts) and not nested:
            raise ConfigError(f"{what}: {'.'.join(parts[: i + 1])} is a value, not a section; {key} does not exist")
        if i + 1 == len(parts) and nested:
            raise ConfigError(
                f"{what}: {key} is a section; give one of its keys, e.g. {key}.{dataclasses.fields(nested[0])[0].name}"
            )
        cls = nested[0] if nested else None
    if value is _UNSET:
        return None
    python = lambda x: x.item() if isinstance(x, np.generic) else x  # a NumPy scalar as Python's
    held = [python(x) for x in value] if isinstance(value, list | tuple) else python(value)
    try:
        return _coerce(held, hints[parts[-1]], key)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


def build(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a raw mapping, checking every key and type.

    Raises:
      ConfigError: unknown keys, wrong types, or what the dataclass's own validation rejects.
    """
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else "."
            raise ConfigError(f"unknown config key {prefix}{key}{hint} Known keys here: {', '.join(fields)}")
        hint_type = hints[key]
        options = typing.get_args(hint_type) if isinstance(hint_type, types.UnionType) else ()
        nested = [o for o in options if dataclasses.is_dataclass(o)]
        items = typing.get_args(hint_type) if typing.get_origin(hint_type) is tuple else ()
        if dataclasses.is_dataclass(hint_type):
            kwargs[key] = build(hint_type, value if value is not None else {}, f"{prefix}{key}.")
        elif nested and value is not None:  # an optional section
            kwargs[key] = build(nested[0], value, f"{prefix}{key}.")
        elif items and dataclasses.is_dataclass(items[0]):  # a list of sections
            if not isinstance(value, list):
                raise ConfigError(f"{prefix}{key} must be a list of mappings, got {value!r}")
            kwargs[key] = tuple(build(items[0], v, f"{prefix}{key}[{i}].") for i, v in enumerate(value))
        else:
            kwargs[key] = _coerce(value, hint_type, f"{prefix}{key}")
    generic = SECTIONS.get(cls.__name__)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section checked by itself names its keys as it does everywhere: say where it is
        if generic is None or not prefix or prefix == f"{generic}.":
            raise
        raise type(e)(rekeyed(str(e), generic, prefix)) from None


SECTIONS = {
    "ParallelConfig": "parallel",
    "PhaseConfig": "rl.rollout or rl.learner",
    "SubmeshConfig": "mpmd.submeshes[]",
}
"""How a section that appears in more than one place names its keys in its own checks (``parallel.tensor`` for
``rl.learner.parallel.tensor`` too): :func:`build` puts the key's real place in their stead."""


def _coerce(value: Any, hint: Any, key: str) -> Any:
    options = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} must not be null; give a {type_name(hint)}")
    words = literal_options(hint)
    if words is not None:
        if value in words:
            return value
        close = difflib.get_close_matches(str(value), [str(w) for w in words], n=1)
        raise ConfigError(f"{key}={value!r} is not one of {words}" + (f"; did you mean {close[0]!r}?" if close else ""))
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, int | float | str) and not isinstance(value, bool):
            try:
                number = float(value)  # YAML 1.1 reads 3e-4 as a string
            except ValueError:
                continue
            if not math.isfinite(number):
                raise ConfigError(f"{key}={value!r} must be a finite number")
            return number
        if option is str and isinstance(value, str):
            return value
        if option is Any or (typing.get_origin(option) in (Mapping, dict) and isinstance(value, dict)):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list | tuple):
            kind = typing.get_args(option)[0]
            kind = str if typing.get_origin(kind) is typing.Literal else kind  # words: checked by the section
            if all(isinstance(x, kind) and not isinstance(x, bool) for x in value):
                return tuple(value)
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {type_name(hint)}, got {type(value).__name__}")
