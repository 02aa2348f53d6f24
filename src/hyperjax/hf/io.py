"""Hugging Face checkpoints in and out: safetensors read block by block into each device's shard, and
written back in the layout ``transformers`` loads.

:func:`import_weights` reads a model folder's safetensors (one file, or shards with
``model.safetensors.index.json``) lazily: every device's shard of every parameter is read as the block of
the stored tensor that holds it (:meth:`hyperjax.hf.names.View.read`), so no device ever holds more than its
shard. :func:`export_weights` writes parameters one at a time into safetensors files of at most
``max_shard_bytes`` each, with an index when there are several, all into a temporary folder renamed into
place at the end.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hyperjax.config import ModelConfig
from hyperjax.errors import ConfigError
from hyperjax.files import cannot_make, write_json
from hyperjax.hf.names import View, stored_shapes, views

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD = "model-{:05d}-of-{:05d}.safetensors"
"""The name of shard ``i`` (from 1) of ``n`` where the weights are written in several files, as transformers
names them; :func:`is_shard` recognises them."""
FLOATS = ("F16", "BF16", "F32", "F64")
"""The safetensors element types a weight is read from (as float32)."""

UNUSED_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Stored tensors older ``transformers`` versions save that are not parameters (rotary tables, GPT-2's
causal masks): skipped on import."""


def is_shard(name: str) -> bool:
    """Whether ``name`` is one of :data:`SHARD`'s names."""
    return re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None


OTHER_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.pt", "*.pth", "tf_model.h5", "flax_model.msgpack", "*.gguf")
"""Files that hold a model's weights in a form import-hf does not read alone: safetensors shards without their
index, or other formats."""


def has_weights(folder: str | Path) -> bool:
    """Whether ``folder`` holds safetensors weights (one file, or an index of shards).

    Raises:
      ConfigError: it holds weights only in a form that is not read (:data:`OTHER_WEIGHTS`): importing its
        config alone would drop them without a word.
    """
    folder = Path(folder)
    if (folder / SINGLE).is_file() or (folder / INDEX).is_file():
        return True
    found = sorted({p.name for pattern in OTHER_WEIGHTS for p in folder.glob(pattern) if p.is_file()})
    if found:
        more = f" and {len(found) - 2} more" if len(found) > 2 else ""
        raise ConfigError(
            f"{str(folder)!r} holds weights ({', '.join(found[:2])}{more}) but no {SINGLE} and no {INDEX}, the "
            f"forms import-hf reads: add the shards' {INDEX}, save the model as safetensors (transformers' "
            "save_pretrained(folder, safe_serialization=True)), or move the weights out to import the config alone"
        )
    return False


def check_shard_size(m: ModelConfig, max_shard_bytes: int, dtype: str) -> None:
    """Every tensor of ``m`` stored as ``dtype`` fits a file of ``max_shard_bytes`` (a tensor is not split
    over files).

    Raises:
      ConfigError: the largest tensor, its size and the smallest ``--max-shard-gib`` that holds it.
    """
    itemsize = _dtype(dtype).itemsize
    name, shape = max(stored_shapes(m).items(), key=lambda kv: math.prod(kv[1]))
    need = math.prod(shape) * itemsize
    if need > max_shard_bytes:
        raise ConfigError(
            f"--max-shard-gib: a file holds at most {max_shard_bytes:,} bytes, but tensor {name!r} {list(shape)} is "
            f"{need:,} bytes as {dtype}, and a tensor is not split over files; pass --max-shard-gib "
            f"{math.ceil(need / 2**30 * 1e6) / 1e6:g} or more"
        )


class Stored:
    """The safetensors tensors of a model folder, opened lazily (``with Stored(folder) as s``).

    A name is found as given, or without the ``transformer.`` prefix that GPT-2 checkpoints written from
    its base model lack (as ``transformers`` loads them).
    """

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{str(index)!r} is not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConfigError(f"{str(index)!r}: weight_map must map tensor names to file names")
            if not weight_map:
                raise ConfigError(f"{str(index)!r}: weight_map lists no tensors; the index is not this model's")
            if (self.folder / SINGLE).is_file() and set(weight_map.values()) != {SINGLE}:  # which is meant?
                raise ConfigError(
                    f"{str(self.folder)!r} holds both {SINGLE} and {INDEX}; transformers loads {SINGLE}, the index "
                    "names other files: remove the one that is not this model's weights"
                )
        elif (self.folder / SINGLE).is_file():
            weight_map = None
        else:
            raise ConfigError(f"{str(self.folder)!r} holds no {SINGLE} and no {INDEX}")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        self._files = {}
        for name in files:
            try:
                self._files[name] = safe_open(str(self.folder / name), framework="np")
            except Exception as e:
                raise ConfigError(f"{str(self.folder / name)!r} cannot be read as safetensors ({e})") from None
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._files[SINGLE].keys()}  # noqa: SIM118 (a safetensors handle)
        self.weight_map = weight_map

    def find(self, name: str) -> str | None:
        """The stored name of tensor ``name`` (``None``: not stored)."""
        if name in self.weight_map:
            return name
        bare = name.removeprefix("transformer.")
        return bare if bare in self.weight_map else None

    def _slice(self, name: str) -> Any:
        stored = self.find(name)
        file = self.weight_map[stored]
        try:
            return self._files[file].get_slice(stored)
        except Exception as e:
            raise ConfigError(
                f"{str(self.folder / file)!r} does not hold tensor {stored!r} its index lists ({e})"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored element type of tensor ``name``, as safetensors names it (``F32``, ``BF16``, ``I64``)."""
        return self._slice(name).get_dtype()

    def fetch(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Block ``index`` of tensor ``name``, as float32."""
        return np.asarray(self._slice(name)[index], dtype=np.float32)

    def __enter__(self) -> Stored:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._files.clear()


TABLES = ("embed_tokens.weight", "wte.weight")
"""How the token embedding's name ends, by family (llama-like, GPT-2)."""

TIED_ROWS = 8192
"""Rows of a stored head compared with the embedding at a time."""


def _check_tied_head(stored: Stored, table: str) -> None:
    """A tied model's stored ``lm_head.weight`` is its embedding ``table``, as ``transformers`` ties them only
    then.

    Raises:
      ConfigError: the two differ in shape or in any element.
    """
    head, shape = "lm_head.weight", stored.shape(table)
    differs = stored.shape(head) != shape
    for start in range(0, shape[0], TIED_ROWS) if not differs else ():
        rows = (slice(start, min(start + TIED_ROWS, shape[0])), slice(None))
        if not np.array_equal(stored.fetch(head, rows), stored.fetch(table, rows)):
            differs = True
            break
    if differs:
        raise ConfigError(
            f"{str(stored.folder)!r}: config.json has tie_word_embeddings true, but the stored {head!r} differs from "
            f"{table!r} (transformers then leaves them untied); set tie_word_embeddings to false to import the head "
            f"as stored, or remove {head!r} if the model shares its embedding"
        )


def check_stored(m: ModelConfig, stored: Stored, *, extra_layers: int = 0) -> None:
    """Every tensor ``m`` needs is stored at its shape, and nothing else is stored but buffers, a tied
    model's copy of its head, and the ``extra_layers`` layers after the model's own (DeepSeek-V3's
    multi-token-prediction module, which ``transformers`` leaves unloaded too).

    Raises:
      ConfigError: a missing tensor, one not stored as floats, one of another shape (both shapes named), one
        the model lacks, or a tied model's stored head that is not its embedding.
    """
    want = stored_shapes(m)
    where = str(stored.folder)
    for name, shape in want.items():
        if stored.find(name) is None:
            raise ConfigError(f"{where}: tensor {name!r} is missing; the config.json describes a model that has it")
        dtype = stored.dtype(name)
        if dtype not in FLOATS:
            raise ConfigError(
                f"{where}: tensor {name!r} is stored as {dtype}, not a float type "
                f"({', '.join(FLOATS)}); the weights are not this model's, or need converting first"
            )
        if stored.shape(name) != shape:
            hint = "the weights belong to another model"
            if name.endswith("wpe.weight"):
                hint = f"the position table has {stored.shape(name)[0]} rows: keep model.seq_len at that"
            raise ConfigError(
                f"{where}: tensor {name!r} is {list(stored.shape(name))}, but the config's model needs "
                f"{list(shape)}; {hint}"
            )
    used = {stored.find(n) for n in want}
    if m.tie_embeddings and "lm_head.weight" not in want and stored.find("lm_head.weight") is not None:
        _check_tied_head(stored, next(n for n in want if n.endswith(TABLES)))
    skipped = tuple(f"model.layers.{i}." for i in range(m.layers, m.layers + extra_layers))
    extra = sorted(
        n
        for n in stored.weight_map
        if n not in used
        and not n.endswith(UNUSED_BUFFERS)
        and not (skipped and n.startswith(skipped))
        and not (m.tie_embeddings and n == "lm_head.weight")
    )
    if extra:
        raise ConfigError(
            f"{where}: tensor {extra[0]!r} (and {len(extra) - 1} more) has no place in the model config.json "
            "describes; hyperjax would drop it, so it refuses the checkpoint"
        )


def import_weights(
    m: ModelConfig, folder: str | Path, shardings: dict[tuple, Any], *, extra_layers: int = 0
) -> dict[tuple, jax.Array]:
    """The parameters of ``m`` read from ``folder``, each block straight into the device shard
    ``shardings[path]`` gives it (float32); ``extra_layers`` as :func:`check_stored`.

    Raises:
      ConfigError: as :func:`check_stored`.
    """
    with Stored(folder) as stored:
        check_stored(m, stored, extra_layers=extra_layers)
        out = {}
        for path, view in views(m):
            out[path] = _read_sharded(view, shardings[path], stored.fetch)
        return out


def _read_sharded(view: View, sharding: Any, fetch: Callable) -> jax.Array:
    return jax.make_array_from_callback(view.shape, sharding, lambda idx: view.read(idx, fetch), dtype=np.float32)


def export_weights(
    m: ModelConfig, params: dict[tuple, Any], out: Path, *, max_shard_bytes: int, dtype: str = "float32"
) -> list[str]:
    """Write ``params`` (paths as :func:`hyperjax.hf.names.views` gives them) as safetensors into folder
    ``out`` (which must exist): one file, or shards of at most ``max_shard_bytes`` with an index. Returns
    the files written (the shards', then the index)."""
    from safetensors.numpy import save_file

    shapes = stored_shapes(m)
    cast = _dtype(dtype)
    size = lambda name: math.prod(shapes[name]) * cast.itemsize
    groups: list[list[str]] = [[]]
    total, held = 0, 0
    for name in shapes:  # in the order the parameters come
        if groups[-1] and held + size(name) > max_shard_bytes:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size(name)
        total += size(name)
    files = [SINGLE] if len(groups) == 1 else [SHARD.format(i + 1, len(groups)) for i in range(len(groups))]
    weight_map = {}
    for file, names in zip(files, groups, strict=True):
        wanted, tensors = set(names), {}
        for path, view in views(m):  # every parameter with a tensor in this file, one at a time
            if not wanted.isdisjoint(view.names):
                view.write(np.asarray(jax.device_get(params[path]), dtype=np.float32), tensors)
        save_file({k: _cast(tensors[k], cast, k) for k in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        files.append(INDEX)
    return files


def _dtype(name: str) -> np.dtype:
    if name in ("float32", "float16"):
        return np.dtype(name)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise ConfigError(f"--dtype {name!r} is not float32, bfloat16 or float16")


def _cast(x: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """``x`` stored as ``dtype``; a finite float32 value past ``dtype``'s range (float16's 65,504) is refused by
    tensor name rather than written as infinity."""
    if dtype == np.float32:
        return x
    with np.errstate(over="ignore"):  # an overflow is found below and refused by name
        y = x.astype(dtype)
    overflow = np.isfinite(x) & ~np.isfinite(y)
    if overflow.any():
        import ml_dtypes  # its finfo knows bfloat16 too

        wider = "bfloat16 (float32's range) or float32" if dtype == np.float16 else "float32"
        past = x[overflow]
        worst = float(past[np.argmax(np.abs(past))])  # the value itself, sign and all
        raise ConfigError(
            f"export-hf --dtype {dtype.name}: tensor {name!r} {list(x.shape)} holds {worst:.6g}, past "
            f"{dtype.name}'s range of +-{float(ml_dtypes.finfo(dtype).max):g}; export with --dtype {wider}"
        )
    return y


def replace_folder(build: Callable[[Path], None], target: Path) -> None:
    """Run ``build`` on a fresh temporary folder beside ``target`` and rename it to ``target`` once it
    returns (an existing ``target`` is replaced only then): readers see the old folder or the whole new one."""
    target = Path(target).absolute()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    except OSError as e:  # check_out found it writable: changed since, or a file system that refuses folders
        raise ConfigError(f"--out {str(target)!r} cannot be written ({e}); choose a folder you can write") from None
    try:
        build(tmp)
        _as_created(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old."))
            os.replace(target, old / "x")
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old / "x", target)  # the old folder back where it was
                raise
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _as_created(folder: Path) -> None:
    """Give ``folder`` and what it holds the modes a plain ``mkdir`` and ``open`` would (under the umask):
    ``mkdtemp`` makes it private, and temporary files written into it may be too."""
    umask = _umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _umask() -> int:
    """This process's umask, read where Linux shows it (setting it to read it back races other threads)."""
    try:
        status = Path("/proc/self/status").read_text()
        return next(int(line.split()[1], 8) for line in status.splitlines() if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def check_out(
    out: str | Path,
    inputs: dict[str, str | Path],
    *,
    marker: str,
    managed: tuple[str, str | Path] | None = None,
    writes: Callable[[str], bool] | None = None,
) -> None:
    """``--out`` must neither be nor hold any of ``inputs`` (named by their option): replacing it would
    delete them; nor lie inside ``managed`` (an option and the checkpoint folder it names, whose step folders
    training keeps and deletes). An existing ``--out`` must be a folder this command wrote before (holding
    ``marker``, its ``config.yaml`` or ``config.json``, and, where ``writes`` is given, no entry it does not
    name, a folder's name given with a trailing ``/``: a downloaded model's licence, readme or ``original/``
    weights are not this command's) or an empty one: any other folder, or a file, is not replaced.

    Raises:
      ConfigError: naming the option and both paths.
    """
    if Path(out).is_symlink():
        raise ConfigError(
            f"--out {str(out)!r} is a link (to {os.readlink(out)!r}); writing replaces the link with a folder, not "
            "the folder it names: give that folder itself, or a new one"
        )
    target = Path(out).resolve()
    for option, path in inputs.items():
        source = Path(path).resolve()
        if source == target or target in source.parents:
            raise ConfigError(
                f"--out {str(out)!r} holds {option} {str(path)!r}, which writing it would replace; choose another --out"
            )
    if managed is not None and Path(managed[1]).resolve() in target.parents:
        option, path = managed
        raise ConfigError(
            f"--out {str(out)!r} lies inside {option} {str(path)!r}, whose step folders training writes and deletes "
            "(train.keep_checkpoints keeps the newest): a folder there could be read as a step or deleted with "
            "one; choose an --out outside it"
        )
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder to write (a new one, or one written before)")
    why = cannot_make(Path(out).absolute().parent)  # written beside --out as named (through a linked folder too)
    if why:
        raise ConfigError(f"--out {str(out)!r} cannot be written ({why}); choose a folder you can write")
    if target.is_dir() and any(target.iterdir()) and not (target / marker).is_file():
        raise ConfigError(
            f"--out {str(out)!r} is a folder with other files in it and no {marker}, so not one this command wrote; "
            "writing it would replace it whole: choose a new or empty folder"
        )
    if writes is not None and target.is_dir():
        other = sorted(
            name for name in (e.name + ("/" if e.is_dir() else "") for e in target.iterdir()) if not writes(name)
        )
        if other:
            shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
            raise ConfigError(
                f"--out {str(out)!r} holds {shown}, which this command does not write, so it is not a folder it "
                "wrote; writing it would replace it whole and delete them: choose a new or empty folder"
            )
