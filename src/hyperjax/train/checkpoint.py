"""Training checkpoints with orbax: the whole state of a run, written in the background, atomically.

A checkpoint holds the parameters, the optimizer state (with its step count, which drives the learning-rate
schedule), the step, the data-pipeline position and the random seeds, and the metrics of every step so far.
Batches are a pure function of ``(seed, step)`` (see :mod:`hyperjax.train.data`), so the position is the
step and a resumed run reads exactly the batches the uninterrupted one would have read.

orbax writes each checkpoint into ``<dir>/<step>.orbax-checkpoint-tmp`` and renames it to ``<dir>/<step>``
only once every process has finished writing, so a write interrupted by SIGKILL leaves the previous
checkpoint as the latest readable one. Restoring reads each array straight into the sharding the new run
wants, so a checkpoint restores onto any mesh (any strategy, any device count) that holds the same model.

A pipeline's state lives in the processes of each stage's submesh, which orbax cannot write as global
arrays; its checkpoints hold *host* arrays instead (``host=True``): the state gathered onto process 0
(:mod:`hyperjax.mpmd.state`), which alone writes it, the same way; every process reads it back and places
its own chunks, so it restores onto any process count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hyperjax.config import ModelConfig
from hyperjax.errors import ConfigError
from hyperjax.files import write_json
from hyperjax.mpmd.transfer import from_process0
from hyperjax.train.quiet_reads import reading
from hyperjax.train.saved_model import check_model

PROGRESS = "progress.json"  # the last step any attempt completed (read by the supervising launcher)
IMPORTED = "imported.json"  # beside step 0 when it holds imported weights alone (hyperjax import-hf)


def imported(directory: str | Path) -> bool:
    """Whether ``directory`` holds imported weights alone (a step-0 checkpoint of parameters, no optimizer
    state), which ``train --resume`` starts from and ``generate`` restores as any checkpoint."""
    return (Path(directory) / IMPORTED).is_file() and saved_steps(directory) == [0]


FINISHED = "_CHECKPOINT_METADATA"
"""The file orbax writes into a checkpoint before it renames the folder to its step; deleting an old checkpoint
may remove it first, so a step folder without it is what an interrupted deletion left (a husk)."""


def saved_steps(directory: str | Path) -> list[int]:
    """The steps of the finished checkpoints in ``directory``, oldest first (no JAX needed)."""
    return sorted(step for step, finished in _step_folders(directory).items() if finished)


def _step_folders(directory: str | Path) -> dict[int, bool]:
    """Every step folder in ``directory``, with whether it is a finished checkpoint (holds :data:`FINISHED`)."""
    d = Path(directory)
    if not d.is_dir():
        return {}
    return {int(p.name): (p / FINISHED).is_file() for p in d.iterdir() if p.name.isdigit() and p.is_dir()}


def _remove_husks(directory: Path) -> None:
    """Delete the step folders older than the newest finished checkpoint that are not finished themselves:
    what a deletion of an old checkpoint (``train.keep_checkpoints``) left when the run was killed during it."""
    folders = _step_folders(directory)
    newest = max((step for step, finished in folders.items() if finished), default=None)
    for step, finished in folders.items():
        if not finished and newest is not None and step < newest:
            shutil.rmtree(directory / str(step), ignore_errors=True)


def saved_meta(directory: str | Path, step: int) -> dict[str, Any] | None:
    """The record (``meta``) of the checkpoint of ``step`` in ``directory`` as its JSON file holds it, read
    without JAX or orbax; ``None`` when it cannot be read (a restore reads it then, and says)."""
    try:
        meta = json.loads((Path(directory) / str(step) / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def last_progress(directory: str | Path) -> int | None:
    """The last step a run in ``directory`` completed, whether or not a checkpoint holds it."""
    try:
        return int(json.loads((Path(directory) / PROGRESS).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restored:
    """What a checkpoint gave back.

    Attributes:
      state: the training state, placed in the shardings of the state it was restored into.
      step: optimizer steps done.
      records: the metrics of steps 1..step, as written to ``--metrics-out``.
      meta: everything else the checkpoint recorded (data position, seeds, devices, strategy).
    """

    state: Any
    step: int
    records: list[dict[str, Any]]
    meta: dict[str, Any]


class Checkpoints:
    """The checkpoints of one run in one folder; every process of the job makes the same calls.

    Args:
      directory: the folder (created if missing).
      keep: how many of the latest checkpoints to keep.
      host: the state comes as host arrays that process 0 alone holds and writes (a pipeline's); every
        process reads them back.
    """

    def __init__(self, directory: str | Path, *, keep: int, host: bool = False) -> None:
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self._ocp, self._keep, self.host = ocp, keep, host
        self._manager = None  # a process that writes nothing (host arrays, not process 0) has none
        if not host or jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                _remove_husks(self.directory)
            self._manager = self._open(processes={0} if host else None, read_only=False)

    def _open(self, *, processes: set[int] | None, read_only: bool) -> Any:
        """An orbax manager of the folder for ``processes`` (``None``: every process of the job)."""
        ocp = self._ocp
        mp = ocp.options.MultiprocessingOptions(
            primary_host=min(processes) if processes else 0, active_processes=processes
        )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self._keep,
            enable_async_checkpointing=not read_only,
            create=False,
            read_only=read_only,
            multiprocessing_options=mp,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(multiprocessing_options=mp),
            "meta": ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        }
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The step of the newest finished checkpoint, or ``None``. With host arrays over several processes,
        process 0's answer in every process (only it holds a manager; the others would read the folder), so
        that all of them restore the same step; every process must call it then."""
        if self._manager is None:
            steps = saved_steps(self.directory)
            local = steps[-1] if steps else None
        else:
            local = self._manager.latest_step()
        if not self.host:
            return local
        agreed = from_process0(-1 if local is None else local, f"hyperjax/checkpoint/latest/{self.directory}")
        return None if agreed < 0 else agreed

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start writing ``state`` as checkpoint ``step``; returns once the arrays are copied off the devices.

        The previous write, if still running, is finished first. ``meta`` must be JSON. With host arrays,
        only process 0 writes (its ``state``; the others pass ``None``).
        """
        ocp = self._ocp
        if self._manager is None:
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(_arrays(state)), meta=ocp.args.JsonSave(meta)),
        )

    def restore(self, like: Any, *, step: int | None = None) -> Restored:
        """Read checkpoint ``step`` (default: the latest) into the structure and shardings of ``like``.

        Raises:
          ConfigError: no checkpoint, a model whose tensors differ from the saved ones (the first
            differing path and both shapes are named), or files that cannot be read.
        """
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise ConfigError(
                f"--resume: no checkpoint in {str(self.directory)!r}; train without --resume to start one, "
                "or give the --checkpoint-dir of an earlier run"
            )
        where = f"checkpoint {str(self.directory / str(step))!r}"
        reader = self._manager
        if self.host:  # every process reads the host arrays, into host arrays
            abstract = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), like)
            if jax.process_count() > 1:
                reader = self._open(processes={jax.process_index()}, read_only=True)
        else:
            abstract = jax.tree.map(_abstract, _arrays(like))
        own = contextlib.closing(reader) if reader is not self._manager else contextlib.nullcontext()
        with reading(self.directory / str(step)), own:  # from before any read starts: a failed one ends the others
            try:
                saved = reader.item_metadata(step)["state"]
                saved_tree = saved.tree if hasattr(saved, "tree") else saved
            except Exception as e:
                raise ConfigError(f"{where} cannot be read ({_first_line(e)}); {_fix(self.directory, step)}") from None
            _check_shapes(abstract, saved_tree, where)
            try:
                state = ocp.args.StandardRestore(abstract)
                out = reader.restore(step, args=ocp.args.Composite(state=state, meta=ocp.args.JsonRestore()))
            except Exception as e:
                raise ConfigError(f"{where} cannot be read ({_first_line(e)}); {_fix(self.directory, step)}") from None
        meta = dict(out["meta"] or {})
        records = meta.get("records")
        valid = (
            meta.get("step") == step
            and isinstance(records, list)
            and len(records) == step
            and isinstance(meta.get("data"), dict)
            and all(key in meta for key in ("devices", "strategy"))
        )
        if not valid:
            raise ConfigError(f"{where} has no valid run record (meta); {_fix(self.directory, step)}")
        state = jax.tree.map(
            lambda saved, old: saved if isinstance(old, (jax.Array, jax.ShapeDtypeStruct)) else type(old)(saved),
            out["state"],
            like,
        )
        return Restored(state=state, step=step, records=meta.pop("records"), meta=meta)

    def write_progress(self, step: int) -> None:
        """Record that ``step`` is done (process 0 calls this; the supervising launcher reads it)."""
        write_json(self.directory / PROGRESS, {"step": step}, indent=None)

    def wait(self) -> None:
        """Wait for the last write to finish."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last write to finish, then release the folder."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()


def restore_params(
    directory: str | Path, like: Any, *, command: str = "generate", model: ModelConfig | None = None
) -> Restored:
    """The parameters alone of the newest checkpoint in ``directory``, read into the structure and shardings
    of ``like`` (a tree of arrays or ``jax.ShapeDtypeStruct`` with shardings); the optimizer state stays on
    disk. ``Restored.state`` is the parameter tree. One process reads (an SPMD run's checkpoint).

    Raises:
      ConfigError: no checkpoint, one written by a pipeline (saved stage by stage), or one of another model
        (the first differing tensor path and both shapes are named; with ``model``, the first differing key
        of the model the checkpoint records, :func:`hyperjax.train.saved_model.check_model`).
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    steps = saved_steps(directory)
    if not steps:
        raise ConfigError(
            f"{command}: no checkpoint in --checkpoint-dir {str(directory)!r}; train with --checkpoint-dir "
            f"{str(directory)!r} first, or give the folder an earlier run wrote its checkpoints to"
        )
    step = steps[-1]
    where = f"checkpoint {str(directory / str(step))!r}"
    abstract = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else _abstract(x), like)
    options = ocp.CheckpointManagerOptions(create=False, read_only=True, save_interval_steps=0)
    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    with (
        reading(directory / str(step)),
        ocp.CheckpointManager(directory, options=options, item_handlers=handlers) as reader,
    ):
        try:
            saved = reader.item_metadata(step)["state"]
            saved_tree = saved.tree if hasattr(saved, "tree") else saved
        except Exception as e:
            raise ConfigError(f"{where} cannot be read ({_first_line(e)}); {_fix(directory, step, command)}") from None
        held = saved_tree.get("params") if isinstance(saved_tree, dict) else None
        if isinstance(held, (list, tuple)) or (isinstance(held, dict) and all(str(k).isdigit() for k in held)):
            raise ConfigError(
                f"{where} was written by a pipeline run, or one pairing forwards and backwards (its parameters "
                f"are saved chunk by chunk); {command} reads checkpoints of one SPMD program: train with "
                "parallel.pipeline=1 and parallel.overlap other than fb-pair, or give another --checkpoint-dir"
            )
        _check_shapes({"params": abstract}, {"params": held or {}}, where, verb=command)
        if model is not None:  # from the record's file, before the arrays are read
            check_model(saved_meta(directory, step) or {}, model, where)
        try:
            args = ocp.args.PyTreeRestore(
                {"params": abstract},
                restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract}),
                partial_restore=True,
            )
            out = reader.restore(step, args=ocp.args.Composite(state=args, meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise ConfigError(f"{where} cannot be read ({_first_line(e)}); {_fix(directory, step, command)}") from None
    meta = dict(out["meta"] or {})
    return Restored(state=out["state"]["params"], step=step, records=meta.pop("records", []), meta=meta)


def _arrays(state: Any) -> Any:
    """``state`` with plain Python numbers (a pipeline's step count) as NumPy scalars orbax can store."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else np.asarray(x), state)


def _abstract(x: Any) -> Any:
    """What orbax restores ``x`` as: an array in its sharding, or (a NumPy scalar from :func:`_arrays`) itself."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


def _check_shapes(abstract: Any, saved: Any, where: str, verb: str = "resume") -> None:
    expected = {_path(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
    found = {_path(k): v for k, v in jax.tree_util.tree_leaves_with_path(saved, is_leaf=lambda x: hasattr(x, "shape"))}
    # rl.init_checkpoint names the checkpoint read; the other commands read --checkpoint-dir
    other = f"point {verb} at a checkpoint of this model" if verb.startswith("rl.") else "use a new --checkpoint-dir"
    if not found and expected:  # no model has no tensors: the step's listing of them is gone
        raise ConfigError(
            f"{where} lists no tensors: its metadata (orbax's _METADATA) is missing or empty, so the checkpoint is "
            f"damaged, whichever model wrote it; restore the folder from a copy, or {other}"
        )
    params_only = found and all(p.startswith("params/") for p in found)
    for path, want in sorted(expected.items(), key=lambda kv: not kv[0].startswith("params/")):
        if path not in found and params_only and not path.startswith("params/"):
            raise ConfigError(
                f"{where} holds parameters only, no {path.split('/')[0]} (what an rl: run writes), so it cannot "
                f"{verb}; start another rl: run from its weights with rl.init_checkpoint, or give --checkpoint-dir "
                "a folder a train run or import-hf wrote"
            )
        if path not in found:
            raise ConfigError(
                f"{where} has no tensor {path} (shape {tuple(want.shape)}): it was written for another model "
                "or another pipeline layout (a pipeline's state is saved stage by stage: parallel.pipeline, "
                "parallel.virtual_stages and parallel.stage_layers must match, an SPMD checkpoint does not "
                "resume as a pipeline, and parallel.overlap=fb-pair runs and saves as a pipeline of one stage); "
                f"{verb} with the config it was written with, or {other}"
            )
        if tuple(found[path].shape) != tuple(want.shape):
            raise ConfigError(
                f"{where}: tensor {path} was saved with shape {tuple(found[path].shape)} but this model has "
                f"{tuple(want.shape)}; {verb} with the model config it was written with, or {other}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ConfigError(
            f"{where} holds tensors this model lacks ({', '.join(extra[:3])}); {verb} with the model config it "
            f"was written with, or {other}"
        )


def _path(keys: tuple) -> str:
    """``params/blocks/0/mlp/w_in``: the same name whether a node was saved as a dict, list or named tuple."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in keys)


def _fix(directory: Path, step: int, command: str = "train --resume") -> str:
    """What to do about the unreadable checkpoint of ``step``, said for the ``command`` that read it."""
    earlier = [s for s in saved_steps(directory) if s < step]
    resuming = command == "train --resume"
    if earlier:
        then = f"to resume from step {earlier[-1]}" if resuming else f"so that {command} reads step {earlier[-1]}"
        return f"remove {str(directory / str(step))!r} {then}"
    if resuming:
        return "remove it and train without --resume"
    then = "train the rl: config" if command.startswith("rl.") else f"run {command}"  # rl.init_checkpoint: a key
    return f"write the checkpoint again (hyperjax train, or import-hf), then {then}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:160]}{'...' if len(line) > 160 else ''}"
