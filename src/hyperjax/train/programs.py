"""A resolved run made ready to step on the live devices: one SPMD program, or a pipeline's programs.

:func:`build_program` returns what the training loop needs and nothing about how it is made: the step
function, the initial state, the memory per device, and how a checkpoint holds the state. An SPMD run's
checkpoint holds its arrays as they lie on the mesh (each process writes its shards); a pipeline's holds
every chunk's state gathered onto process 0 (see :mod:`hyperjax.mpmd.state`), which alone writes it, so it
restores onto any number of processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from hyperjax.config import Config
from hyperjax.cost.hlo import Collective, read_compiled
from hyperjax.mpmd import PipelineRunner, from_host, host_like, model_chunks, to_host
from hyperjax.topology import make_mesh
from hyperjax.train.data import Batches, CaptionBatches
from hyperjax.train.prepare import Prepared
from hyperjax.train.step import build_train_step, compiled_bytes, init_state, make_optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """A run ready to train.

    Attributes:
      advance: ``(state, step index) -> (state, metrics)``.
      state: the initial training state on the devices.
      memory: bytes per device of the compiled step (or of a pipeline's fullest stage).
      collectives: reads the compiled step's collectives (one SPMD program; ``None`` for a pipeline); read
        only when asked, since the program's text of a large mesh is long.
      processes: the process of each device of that program, in its device order.
      host_checkpoints: checkpoints hold host arrays that process 0 writes (a pipeline's).
      to_saved: ``(state, step) -> what a checkpoint holds`` (``None`` in processes that do not write it).
      saved_like: the structure, shapes and (for an SPMD run) shardings a checkpoint restores into.
      from_saved: ``(what a checkpoint held, step) -> state``.
    """

    advance: Callable[[Any, int], tuple[Any, dict[str, Any]]]
    state: Any
    memory: int
    collectives: Callable[[], tuple[Collective, ...]] | None
    processes: list[int] | None
    host_checkpoints: bool
    to_saved: Callable[[Any, int], Any]
    saved_like: Callable[[Any], Any]
    from_saved: Callable[[Any, int], Any]


def build_program(ready: Prepared, model: nnx.Module) -> Program:
    """The program of ``ready``'s run for ``model`` (built with the run's dtype, recompute and seed)."""
    data = data_for(ready.run.config)
    return (_pipeline if ready.run.staged else _spmd)(ready, model, data)


def data_for(cfg: Config) -> Batches | CaptionBatches:
    t, m = cfg.train, cfg.model
    if m.vision is not None:
        v = m.vision
        return CaptionBatches(
            global_batch=t.global_batch,
            seq_len=m.seq_len,
            vocab=m.vocab,
            image_size=v.image_size,
            patch=v.patch,
            channels=v.channels,
            seed=t.seed,
        )
    return Batches(source=t.data, global_batch=t.global_batch, seq_len=m.seq_len, vocab=m.vocab, seed=t.seed)


def _spmd(ready: Prepared, model: nnx.Module, data: Batches | CaptionBatches) -> Program:
    """One SPMD program over the whole mesh."""
    run, t = ready.run, ready.run.config.train
    mesh = make_mesh(run.hardware, run.axes, devices=jax.devices()[: run.devices])
    graphdef, param_state = nnx.split(model)
    optimizer = make_optimizer(t)
    step = build_train_step(
        graphdef=graphdef,
        param_state=param_state,
        strategy=ready.strategy,
        mesh=mesh,
        optimizer=optimizer,
        microbatches=run.microbatches,
        feeds={"images": 4} if run.config.model.vision is not None else None,
        placement=ready.offload.placement if ready.offload is not None else None,
        moe=run.config.model.moe,
        replicas=run.replica_axes,
    )
    state = init_state(param_state, optimizer, step)
    compiled = step.fn.lower(state, data.global_batch_arrays(0, step.batch_shardings)).compile()

    def advance(state: Any, i: int) -> tuple[Any, dict[str, Any]]:
        return compiled(state, data.global_batch_arrays(i, step.batch_shardings))

    return Program(
        advance=advance,
        state=state,
        memory=compiled_bytes(compiled),
        collectives=lambda: tuple(read_compiled(compiled, run.devices).collectives),
        processes=[d.process_index for d in mesh.devices.flat],
        host_checkpoints=False,
        to_saved=lambda state, step: state,
        saved_like=lambda state: state,
        from_saved=lambda saved, step: saved,
    )


def pipeline_runner(ready: Prepared, model: nnx.Module) -> PipelineRunner:
    """The runner of a pipeline or MPMD run: ``model`` cut into the run's chunks, one program per chunk on
    its stage's submesh, with the run's optimizer (clipped over every stage by the runner)."""
    run, t = ready.run, ready.run.config.train
    chunks, entry = model_chunks(model, run)
    return PipelineRunner(
        chunks=chunks,
        entry=entry,
        run=run,
        strategy=ready.strategy,
        devices=jax.devices()[: run.devices],
        optimizer=make_optimizer(t, clip=False),
        grad_clip=t.grad_clip,
    )


def _pipeline(ready: Prepared, model: nnx.Module, data: Batches | CaptionBatches) -> Program:
    """One program per chunk on its stage's submesh, run by the schedule's grid (see hyperjax.mpmd)."""
    runner = pipeline_runner(ready, model)
    state = runner.init_state()

    def advance(state: Any, i: int) -> tuple[Any, dict[str, Any]]:
        return runner.step(state, data.batch(i))

    return Program(
        advance=advance,
        state=state,
        memory=runner.memory_per_device(state),
        collectives=None,
        processes=None,
        host_checkpoints=True,
        to_saved=lambda state, step: to_host(runner, state, step),
        saved_like=lambda state: host_like(runner),
        from_saved=lambda saved, step: from_host(runner, saved, step),
    )
