"""Rewards: what a completion earns, as a float per completion.

A reward is a function ``(prompts, completions) -> floats``, both lists of text (byte-level tokens decoded
as UTF-8, as the shipped corpus is). ``rl.reward`` names a built-in, a built-in with its argument
(``word:LORD``), or ``module:function`` importable from the working directory or the Python path.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from hyperjax.errors import ConfigError

Reward = Callable[[Sequence[str], Sequence[str]], Sequence[float]]
"""``(prompts, completions) -> one float per completion``."""

_TEXT = re.compile(r"[A-Za-z ]")


def letters(prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """The share of a completion's characters that are ASCII letters or spaces, as most of the corpus's are
    (a byte that is not UTF-8 reads as one replacement character)."""
    return [len(_TEXT.findall(c)) / max(len(c), 1) for c in completions]


def word(target: str) -> Reward:
    """How many times ``target`` occurs in a completion, as a whole word."""
    pattern = re.compile(rf"\b{re.escape(target)}\b")
    return lambda prompts, completions: [float(len(pattern.findall(c))) for c in completions]


def match(pattern: str) -> Reward:
    """1 when a completion holds a match of the regular expression ``pattern``, else 0."""
    compiled = re.compile(pattern)
    return lambda prompts, completions: [float(compiled.search(c) is not None) for c in completions]


BUILTIN: dict[str, Callable[..., Reward] | Reward] = {"letters": letters, "word": word, "match": match}
"""Built-in rewards: ``letters``; ``word:WORD`` (whole-word count); ``match:REGEX`` (1 if it matches)."""
_TAKES_ARGUMENT = ("word", "match")


def load_reward(spec: str) -> Reward:
    """The reward ``rl.reward`` names.

    Raises:
      ConfigError: an unknown built-in, a built-in missing its argument, a bad pattern, or a
        ``module:function`` that cannot be imported or is not callable.
    """
    name, sep, arg = spec.partition(":")
    if name in BUILTIN:
        if name in _TAKES_ARGUMENT:
            if not arg:
                raise ConfigError(f"rl.reward={spec!r}: the built-in {name!r} takes an argument: {name}:VALUE")
            try:
                return BUILTIN[name](arg)
            except re.error as e:
                raise ConfigError(f"rl.reward={spec!r}: {arg!r} is not a regular expression ({e})") from None
        if sep:
            raise ConfigError(f"rl.reward={spec!r}: the built-in {name!r} takes no argument; write rl.reward: {name}")
        return BUILTIN[name]
    if not sep:
        raise ConfigError(
            f"rl.reward={spec!r} is not a built-in reward ({', '.join(_described())}) nor module:function"
        )
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(name)
    except Exception as e:
        raise ConfigError(f"rl.reward={spec!r}: module {name!r} cannot be imported ({type(e).__name__}: {e})") from None
    fn = getattr(module, arg, None)
    if not callable(fn):
        raise ConfigError(f"rl.reward={spec!r}: module {name!r} has no function {arg!r}")
    return fn


def check_reward(spec: str) -> None:
    """``rl.reward`` as far as a command that prices the run (``predict``, ``plan``) can check it: a built-in
    in full, its argument too; a ``module:function`` is not imported, since the module may exist only where
    the run trains (``train`` imports it), unless its name is a misspelt built-in's (``mach:x``) found nowhere.

    Raises:
      ConfigError: as :func:`load_reward`, for a built-in.
    """
    name = spec.partition(":")[0]
    if name in BUILTIN or ":" not in spec:
        load_reward(spec)
        return
    close = [] if "." in name else difflib.get_close_matches(name, list(BUILTIN), n=1, cutoff=0.75)
    if close and importlib.util.find_spec(name) is None:  # found without running the module
        raise ConfigError(
            f"rl.reward={spec!r}: no module {name!r} is on the path; did you mean the built-in {close[0]!r} "
            f"(rl.reward: {close[0]}:{spec.partition(':')[2]})?"
        )


def score(reward: Reward, spec: str, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """``reward`` of each completion as a float64 array, checked.

    Raises:
      ConfigError: a reward that raises, or returns the wrong count or a value that is not a finite number.
    """
    try:
        values = list(reward(list(prompts), list(completions)))
    except Exception as e:
        raise ConfigError(f"rl.reward={spec!r} raised {type(e).__name__}: {e}") from None
    if len(values) != len(completions):
        raise ConfigError(
            f"rl.reward={spec!r} returned {len(values)} values for {len(completions)} completions; return one each"
        )
    try:
        out = np.asarray([float(v) for v in values], np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"rl.reward={spec!r} returned a value that is not a number; return floats") from None
    bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
    if bad:
        raise ConfigError(f"rl.reward={spec!r} returned {out[bad[0]]} for completion {bad[0]}; return finite floats")
    return out


def _described() -> list[str]:
    return [f"{n}:VALUE" if n in _TAKES_ARGUMENT else n for n in BUILTIN]
