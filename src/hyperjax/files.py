"""Files written whole or not at all (readers see the old file or the complete new one, never a part), YAML
files read strictly (a key given twice is an error, not the last one silently kept), and the shipped corpus."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml


def write_json(path: str | Path, data: Any, *, indent: int | None = 2) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file beside it, then a rename): through a
    symbolic link to the file it names, with the mode the file had (a new one: the user's umask)."""
    target = Path(os.path.realpath(path))
    umask = os.umask(0)
    os.umask(umask)
    mode = target.stat().st_mode & 0o7777 if target.is_file() else 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cannot_make(folder: str | Path) -> str | None:
    """Why files cannot be written in ``folder`` once it is made (``None`` when they can), found without
    making it: ``folder``, or the nearest of its parents that exists, must be a folder in which a file can be
    created (one is made and removed there)."""
    base = Path(folder).absolute()
    while not os.path.lexists(base) and base != base.parent:  # a dangling link exists: no folder is made there
        base = base.parent
    if not base.is_dir():
        return f"{str(base)!r} is a file" if base.is_file() else f"{str(base)!r} is not a folder (a link to none?)"
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        return f"no file can be created in folder {str(base)!r}: {e.strerror or e}"
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (where plain YAML keeps the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # <<: a merged key the mapping overrides is not repeated
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            repeated = key in first
        except TypeError:  # an unhashable key: construct_mapping says so
            break
        first.setdefault(key, key_node.start_mark.line + 1)
        if repeated:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"key {key!r} is given twice (first on line {first[key]}); keep one",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, name: str = "<text>") -> Any:
    """``text`` parsed as YAML (safe types only; ``None`` when blank), a key given twice in one mapping being
    an error; the errors' positions name ``name`` (the file's path).

    Raises:
      yaml.YAMLError: ``text`` is not valid YAML, or repeats a key.
    """
    if not text.strip():  # blank (tabs too, which YAML would refuse): no document
        return None
    loader = _UniqueKeyLoader(text)
    loader.name = name  # what its marks print: text has no name of its own
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path, *, what: str, error: type[Exception]) -> Any:
    """The YAML document in the file at ``path`` (:func:`parse_yaml`; ``None`` for an empty file).

    Raises:
      error: the file is not UTF-8 text, not valid YAML or repeats a key; the message names ``what`` (``"config
        file"``) and the path.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return parse_yaml(text, str(path))
    except yaml.YAMLError as e:
        raise error(f"{what} {str(path)!r} is not valid YAML: {e}") from None


CORPUS = "kjv-genesis-exodus.txt.gz"


@cache
def corpus_bytes() -> np.ndarray:
    """The shipped corpus (Genesis and Exodus, King James Version, public domain) as uint8 tokens."""
    data = resources.files("hyperjax.data").joinpath(CORPUS).read_bytes()
    return np.frombuffer(gzip.decompress(data), dtype=np.uint8)
