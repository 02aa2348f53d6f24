"""``import-hf`` and ``export-hf``: a Hugging Face model folder as a hyperjax config and checkpoint, and back.

An import writes ``config.yaml`` (the model exactly, every other section at its defaults or as ``--set``
says), ``checkpoint/`` (an orbax checkpoint of the parameters at step 0, which ``generate``, ``train
--resume`` and :func:`hyperjax.train.checkpoint.restore_params` restore onto any layout) and a copy of the
tokenizer files. An export writes ``config.json``, safetensors and the tokenizer files the config's folder
holds. Both write into a temporary folder renamed into place at the end.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from hyperjax.config import Config, ModelConfig, Run
from hyperjax.config.hf import config_file, model_folder, read_hf_config, run_section, training_only
from hyperjax.config.hf_export import hf_from_model
from hyperjax.config.load import apply_override, build_imported
from hyperjax.errors import ConfigError
from hyperjax.files import write_json
from hyperjax.hf.io import (
    INDEX,
    SINGLE,
    check_out,
    check_shard_size,
    export_weights,
    has_weights,
    import_weights,
    is_shard,
    replace_folder,
)
from hyperjax.hf.names import views
from hyperjax.resolver import resolve

SOURCE_CONFIG = "source_config.json"
"""The ``config.json`` an import read, kept beside its ``config.yaml`` for what hyperjax does not model (the
special tokens' ids), which an export writes back and ``generate`` stops at."""

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The ``config.json`` fields an export carries over from the folder the model came from."""

TOKENIZER_FILES = (
    *("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"),
    *("vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja"),
)
"""The files of a model folder that travel with it unchanged."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Imported:
    """What :func:`import_hf` wrote.

    Attributes:
      config: the ``config.yaml`` path.
      checkpoint: the checkpoint folder (``None``: the folder held no weights).
      tensors: stored tensors read.
      copied: tokenizer files copied.
      not_applied: ``config.json`` fields that matter only for training there (dropout), as ``key=value``.
    """

    config: str
    checkpoint: str | None
    tensors: int
    copied: list[str]
    not_applied: list[str]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def imported_config(hf_dir: str | Path, sets: list[str]) -> tuple[dict[str, Any], Config]:
    """The raw run config of ``hf_dir`` with ``sets`` applied, and the config it makes."""
    where = str(config_file(hf_dir))
    given = read_hf_config(hf_dir)
    raw = run_section(given, where)
    for item in sets:
        apply_override(raw, item)
    return raw, build_imported(raw, given, where, sets)


AT_USE = (
    *("seq_len", "attention_kernel", "attention_impl", "rope_theta", "rope_scaling"),
    *("moe.capacity_factor", "moe.aux_loss_weight", "moe.bias_update_rate", "moe.load_imbalance"),
)
"""The ``model.*`` keys an import of weights may set apart from ``config.json``: how the model is run and
trained (its training length, attention kernel, rotary positions stretched for longer contexts, the experts'
capacity and balancing), not what its weights are."""


def _check_kept_model(m: ModelConfig, described: ModelConfig, hf_dir: Path) -> None:
    """An import of weights keeps the model ``config.json`` describes, but for :data:`AT_USE`.

    Raises:
      ConfigError: naming the first key a ``--set`` changed, both values and the fix.
    """
    changed = _changed(m, described, "model")
    if changed is None:
        return
    key, value, was = changed
    show = lambda v: "null" if v is None else "a section" if dataclasses.is_dataclass(v) else repr(v)
    raise ConfigError(
        f"--set {key}: {show(value)} changes the model {str(hf_dir / 'config.json')!r} describes ({key}="
        f"{show(was)}), whose weights the folder holds; drop it (an import of weights may set only "
        f"{', '.join(f'model.{k}' for k in AT_USE)}), or move the weights out to import the config alone as a new "
        "model's"
    )


def _changed(a: Any, b: Any, prefix: str) -> tuple[str, Any, Any] | None:
    """The first field (dotted from ``prefix``) where dataclasses ``a`` and ``b`` differ outside :data:`AT_USE`,
    with both values; nested sections are compared field by field."""
    for f in dataclasses.fields(a):
        key, x, y = f"{prefix}.{f.name}", getattr(a, f.name), getattr(b, f.name)
        if key.removeprefix("model.") in AT_USE or x == y:
            continue
        if dataclasses.is_dataclass(x) and dataclasses.is_dataclass(y):
            if (inner := _changed(x, y, key)) is not None:
                return inner
            continue
        return key, x, y
    return None


def import_hf(hf_dir: str | Path, out: str | Path, sets: list[str]) -> Imported:
    """Import Hugging Face folder ``hf_dir`` into folder ``out`` (replaced whole if it exists).

    The devices of the run the config describes must be started (:func:`hyperjax.start_devices`); the
    weights are read into the shardings its strategy gives them.

    Raises:
      ConfigError: an unsupported ``config.json`` (the field is named), or weights of another model.
    """
    hf_dir, out = model_folder(hf_dir), Path(out)
    check_out(out, {"HF_DIR": hf_dir}, marker="config.yaml", writes=imported)
    raw, cfg = imported_config(hf_dir, sets)
    run = resolve(cfg)
    hf = read_hf_config(hf_dir)
    copied = [name for name in TOKENIZER_FILES if (hf_dir / name).is_file()]
    weights = has_weights(hf_dir)
    described = imported_config(hf_dir, [])[1].model if weights else None  # the model the weights are of
    if described is not None:
        _check_kept_model(cfg.model, described, hf_dir)
    if weights and hf.get("quantization_config"):
        raise ConfigError(
            f"{str(hf_dir / 'config.json')!r}: quantization_config={hf['quantization_config']!r}: import-hf reads "
            "unquantised weights; dequantise the checkpoint to bfloat16 first (its config alone imports as it is)"
        )
    counted = {"tensors": 0}

    def write(tmp: Path) -> None:
        header = f"# {hf.get('model_type')} imported from {hf_dir.absolute()} by hyperjax import-hf\n"
        (tmp / "config.yaml").write_text(header + yaml.safe_dump(raw, sort_keys=False))
        for name in copied:
            shutil.copyfile(hf_dir / name, tmp / name)
        shutil.copyfile(config_file(hf_dir), tmp / SOURCE_CONFIG)
        if described is not None:
            mtp = hf.get("num_nextn_predict_layers", 0) if hf.get("model_type") == "deepseek_v3" else 0
            mtp = mtp if isinstance(mtp, int) and mtp > 0 else 0  # its layers follow the model's own
            named = _stored_as(run.config.model, described)
            counted["tensors"] = _write_checkpoint(run, named, hf_dir, tmp / "checkpoint", extra_layers=mtp)

    replace_folder(write, out)
    return Imported(
        config=str(out / "config.yaml"),
        checkpoint=str(out / "checkpoint") if weights else None,
        tensors=counted["tensors"],
        copied=copied,
        not_applied=training_only(hf),
    )


def _stored_as(m: ModelConfig, described: ModelConfig) -> ModelConfig:
    """``m`` with the experts' settings of :data:`AT_USE` as ``config.json`` has them: the model whose stored
    tensor names and shapes a folder's weights have (a capacity factor or a balancing weight changes neither,
    but no Hugging Face type writes a capacity factor)."""
    if m.moe is None or described.moe is None:
        return m
    kept = {k.split(".")[1]: getattr(described.moe, k.split(".")[1]) for k in AT_USE if k.startswith("moe.")}
    return dataclasses.replace(m, moe=dataclasses.replace(m.moe, **kept))


def _write_checkpoint(run: Run, named: ModelConfig, hf_dir: Path, folder: Path, *, extra_layers: int) -> int:
    """Write the weights of ``hf_dir`` (stored as model ``named`` names them) as a step-0 checkpoint of
    ``run``'s model in ``folder``; returns how many stored tensors were read."""
    from hyperjax.train.checkpoint import IMPORTED, Checkpoints
    from hyperjax.train.generate import params_like
    from hyperjax.train.saved_model import model_record

    like = params_like(run)[3]
    m = run.config.model
    shardings = {path: leaf.sharding for path, leaf in _flatten(like)}
    params = import_weights(named, hf_dir, shardings, extra_layers=extra_layers)
    tree = _unflatten(params, like)
    ckpt = Checkpoints(folder, keep=1)
    t = run.config.train
    meta = {
        "step": 0,
        "imported_from": str(hf_dir.absolute()),
        "data": {"source": t.data, "seed": t.seed, "position": 0, "global_batch": t.global_batch},
        "rng": {"seed": t.seed},
        "devices": run.devices,
        "strategy": run.describe(),
        "model": model_record(m),
        "records": [],
    }
    try:
        ckpt.save(0, {"params": tree}, meta)
    finally:
        ckpt.close()
    write_json(folder / IMPORTED, {"from": str(hf_dir.absolute())})
    return len({n for _, view in views(named) for n in view.names})


def export_hf(
    run: Run,
    checkpoint_dir: str | Path,
    out: str | Path,
    *,
    config_path: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: str = "float32",
) -> list[str]:
    """Write the newest checkpoint of ``checkpoint_dir`` (restored onto ``run``'s mesh) as a Hugging Face
    folder ``out``: ``config.json``, safetensors and the tokenizer files beside ``config_path``. Returns the
    files written.

    Raises:
      ConfigError: a model no Hugging Face type describes, or a checkpoint that is missing or of another model.
    """
    from hyperjax.train.checkpoint import restore_params
    from hyperjax.train.generate import params_like

    m = run.config.model
    config = hf_from_model(m)  # refuses a model no type describes before anything is read
    check_shard_size(m, max_shard_bytes, dtype)
    src = config_file(config_path).parent if config_path is not None else None  # a folder given is the folder
    inputs = {"--checkpoint-dir": checkpoint_dir, **({"the config's folder": src} if src else {})}
    origin = imported_from(checkpoint_dir)
    if origin is not None:  # the Hugging Face folder the weights came from, which the export must not replace
        inputs["the folder the checkpoint was imported from"] = origin
    check_out(out, inputs, marker="config.json", managed=("--checkpoint-dir", checkpoint_dir), writes=exported)
    like = params_like(run)[3]
    params = dict(_flatten(restore_params(checkpoint_dir, like, command="export-hf", model=m).state))
    copied = [n for n in TOKENIZER_FILES if src is not None and (src / n).is_file()]
    written: list[str] = []

    config.update(token_ids(src) if src is not None else dict.fromkeys(TOKEN_IDS))

    def write(tmp: Path) -> None:
        config["torch_dtype"] = dtype
        write_json(tmp / "config.json", config)
        written.extend(["config.json", *export_weights(m, params, tmp, max_shard_bytes=max_shard_bytes, dtype=dtype)])
        for name in copied:
            shutil.copyfile(src / name, tmp / name)
        written.extend(copied)

    replace_folder(write, Path(out))
    return written


def source_config(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The Hugging Face config a folder's model came from: the ``source_config.json`` an import kept, or the
    folder's own ``config.json``; ``None`` where it has neither.

    Raises:
      ConfigError: a file that is not a JSON object.
    """
    for name in (SOURCE_CONFIG, "config.json"):
        if (folder / name).is_file():
            return folder / name, read_hf_config(folder / name)
    return None


def token_ids(folder: Path) -> dict[str, Any]:
    """The special tokens' ids (:data:`TOKEN_IDS`) of the config :func:`source_config` finds in ``folder``, as
    it gives them (transformers keeps an id outside the vocabulary too, with a warning); with no such config
    (a model trained here), each null, so that ``transformers`` does not take its type's defaults (GPT-2's
    50256, Llama's 1 and 2), which name tokens the model was never taught."""
    found = source_config(folder)
    if found is None:
        return dict.fromkeys(TOKEN_IDS)
    return {k: found[1][k] for k in TOKEN_IDS if found[1].get(k) is not None}


def imported(name: str) -> bool:
    """Whether import-hf writes an entry of this name (a folder's with a trailing ``/``): ``config.yaml``, the
    source's ``config.json`` as it was, the checkpoint folder and the tokenizer's files."""
    return name in ("config.yaml", SOURCE_CONFIG, "checkpoint/", *TOKENIZER_FILES)


def exported(name: str) -> bool:
    """Whether export-hf writes a file of this name: ``config.json``, its safetensors and their index, and
    the tokenizer's files."""
    return name in ("config.json", SINGLE, INDEX, *TOKENIZER_FILES) or is_shard(name)


def imported_from(checkpoint_dir: str | Path) -> Path | None:
    """The Hugging Face folder an import-hf checkpoint folder's weights were read from (its record), if any."""
    from hyperjax.train.checkpoint import IMPORTED

    try:
        origin = json.loads((Path(checkpoint_dir) / IMPORTED).read_text()).get("from")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(origin) if isinstance(origin, str) else None


def _flatten(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, (*prefix, k))]
    return [(prefix, tree)]


def _unflatten(flat: dict[tuple, Any], like: Any) -> Any:
    """``flat``'s values in the nested structure of ``like`` (its keys' types kept: blocks are numbered)."""

    def walk(node: Any, prefix: tuple) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, (*prefix, k)) for k, v in node.items()}
        if prefix not in flat:
            raise ConfigError(f"parameter {'/'.join(map(str, prefix))} has no Hugging Face tensor")
        return flat[prefix]

    return walk(like, ())
