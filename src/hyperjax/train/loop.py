"""Train a resolved run on the live mesh: step, log, plot, summarise.

Every process runs the same loop; process 0 alone prints, writes metrics and draws the loss curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import jax

from hyperjax.config import Run, check_run
from hyperjax.errors import ConfigError
from hyperjax.models import build_model, count_params
from hyperjax.offload import block_policies
from hyperjax.train.breakdown import CollectiveTime, check_profiled, collective_times, profile_ops
from hyperjax.train.checkpoint import Checkpoints, imported, restore_params, saved_meta, saved_steps
from hyperjax.train.interrupt import Interrupted, stop_on_interrupt
from hyperjax.train.prepare import Prepared, check_log, check_outputs, prepare
from hyperjax.train.programs import build_program
from hyperjax.train.saved_model import check_model, model_record


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """What a training run measured.

    Attributes:
      losses: the loss of every step, in order.
      step_times_s: wall time of every step on the emulated devices (the first includes compilation).
      memory_per_device: bytes per device of the compiled step (arguments + outputs + temporaries - aliased);
        for a schedule of per-chunk programs (``Run.staged``), of the fullest stage's parameters, gradient
        accumulators and optimizer state.
      params: model parameters.
      expert_load: a mixture of experts' routed copies per expert in the last step, one row per MoE layer
        (``None`` for a dense model).
      records: every step's metrics, as written to ``metrics_out``.
      collectives: with ``profile``, where the last step's collectives spent their time on process 0's
        devices (:mod:`hyperjax.train.breakdown`); empty otherwise.
      compiled: the indices of the steps that compiled the program (the first; a resumed run's first too).
    """

    losses: list[float]
    step_times_s: list[float]
    memory_per_device: int
    params: int
    expert_load: list[list[float]] | None = None
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    collectives: tuple[CollectiveTime, ...] = ()
    compiled: tuple[int, ...] = (0,)

    @property
    def step_time_s(self) -> float:
        """Median step time but the steps that compiled (``compiled``: the first, and a resumed run's first)."""
        times = [t for i, t in enumerate(self.step_times_s) if i not in self.compiled] or self.step_times_s
        return statistics.median(times)


ROUTER_METRICS = ("aux_loss", "expert_load_max_over_mean", "dropped_fraction")
"""The per-step metrics a mixture-of-experts run adds (see :func:`hyperjax.train.step.router_metrics`)."""


def train(
    run: Run | Prepared,
    *,
    metrics_out: str | None = None,
    out_dir: str | None = None,
    log: TextIO | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    profile: bool = False,
) -> RunResult:
    """Train ``run`` on the devices already started (see :func:`hyperjax.start_devices`).

    Args:
      run: from :func:`hyperjax.resolve` (or already :func:`hyperjax.train.prepare` d).
      metrics_out: a JSON-lines file, one object per step (process 0 writes it).
      out_dir: where process 0 writes ``loss.png``.
      log: where progress lines go (default: stdout on process 0, nowhere elsewhere).
      checkpoint_dir: write a checkpoint there every ``train.checkpoint_every`` steps and after the last.
      resume: continue from the latest checkpoint in ``checkpoint_dir`` (restored onto this run's mesh);
        the metrics of the steps it holds are written to ``metrics_out`` again, so the file covers the run.
      profile: run the last step under JAX's profiler on process 0 and time every collective of the
        compiled step (:attr:`RunResult.collectives`; one SPMD program only).

    Raises:
      HyperjaxError: a run that cannot train here (see :func:`hyperjax.train.prepare.prepare`), ``run`` not a
        resolved :class:`Run` (or one of an ``rl:`` config: :func:`hyperjax.train_rl` trains those), outputs
        that cannot be written (:func:`~hyperjax.train.prepare.check_outputs`), ``resume`` without a readable
        checkpoint, or one written for another model or data.
      Interrupted: Ctrl-C in a single process (:mod:`hyperjax.train.interrupt`): the run stopped after the
        step under way, with that step's checkpoint written (where ``checkpoint_dir`` is given) and
        ``loss.png`` drawn.
    """
    if not isinstance(run, Prepared):
        check_run(run, "train", "train_rl")
    check_outputs(metrics_out, out_dir, checkpoint_dir, resume=resume)
    check_log(log, "train")
    ready = run if isinstance(run, Prepared) else prepare(run)
    run = ready.run
    cfg, t = run.config, run.config.train
    lead = jax.process_index() == 0
    log = (sys.stdout if lead else None) if log is None else log
    policies = block_policies(ready.offload.placement, cfg.model.layers) if ready.offload is not None else None
    model = build_model(
        cfg.model,
        dtype=run.dtype,
        recompute=run.recompute,
        recompute_modules=t.recompute_modules,
        seed=t.seed,
        policies=policies,
        overlap=run.overlap,
        fp8=t.fp8,
    )
    if profile:
        check_profiled(run)
    program = build_program(ready, model)
    step_fn, state = program.advance, program.state
    tokens = t.global_batch * cfg.model.seq_len
    ckpt = None
    if checkpoint_dir is not None:
        ckpt = Checkpoints(checkpoint_dir, keep=t.keep_checkpoints, host=program.host_checkpoints)
    records: list[dict[str, Any]] = []
    if resume:
        try:
            if imported(ckpt.directory):  # weights alone (import-hf): they start the run at step 0
                if run.staged:
                    raise ConfigError(
                        f"{str(ckpt.directory)!r} holds imported weights, which start an SPMD run; set "
                        "parallel.pipeline=1 and parallel.overlap other than fb-pair to train from them"
                    )
                restored = restore_params(
                    ckpt.directory, state["params"], command="train --resume", model=run.config.model
                )
                state = {**state, "params": restored.state}
            else:
                restored = ckpt.restore(program.saved_like(state))
                _check_same_run(restored.meta, run, ckpt.directory / str(restored.step))
                state, records = program.from_saved(restored.state, restored.step), restored.records
        except BaseException:
            ckpt.close()
            raise
        if log is not None:
            log.write(
                f"resumed from {ckpt.directory / str(restored.step)} (step {restored.step}, written on "
                f"{restored.meta['devices']} devices under {restored.meta['strategy']})\n"
            )
    resumed_at = len(records)  # this run's first step compiles its program
    sink = open(metrics_out, "w") if (metrics_out and lead) else None  # noqa: SIM115 (closed below)
    for record in records if sink is not None else ():
        sink.write(json.dumps(record) + "\n")
    bar = _progress_bar(t.steps, len(records)) if (log is sys.stdout and sys.stdout.isatty()) else None
    expert_load, timed, stopped_at = None, {}, None
    with stop_on_interrupt(single_process=jax.process_count() == 1) as asked:
        try:
            for i in range(len(records), t.steps):
                start = time.perf_counter()
                if profile and lead and i + 1 == t.steps:
                    (state, metrics), elapsed, timed = profile_ops(partial(_wait, step_fn, state, i))
                    loss = float(metrics["loss"])
                else:
                    state, metrics = step_fn(state, i)
                    loss = float(metrics["loss"])
                    elapsed = time.perf_counter() - start
                record = {
                    "step": i + 1,
                    "loss": loss,
                    "tokens_per_s": tokens / elapsed,
                    "step_time_s": elapsed,
                    "grad_norm": float(metrics["grad_norm"]),
                    "rss_bytes": resident_bytes(),
                }
                if not (math.isfinite(loss) and math.isfinite(record["grad_norm"])):
                    _diverged(i + 1, loss, record["grad_norm"], run, ckpt)
                for key in ROUTER_METRICS:
                    if key in metrics:
                        record[key] = float(metrics[key])
                if "expert_load" in metrics:
                    expert_load = jax.device_get(metrics["expert_load"]).tolist()
                records.append(record)
                stopped_at = i + 1 if asked() and i + 1 < t.steps else None
                if ckpt is not None and ((i + 1) % t.checkpoint_every == 0 or i + 1 == t.steps or stopped_at):
                    ckpt.save(i + 1, program.to_saved(state, i + 1), _meta(run, records))
                if (i + 1) % t.checkpoint_every == 0:
                    trim_heap()
                if ckpt is not None and lead:
                    ckpt.write_progress(i + 1)
                if sink is not None:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                if bar is not None:
                    bar[0].update(bar[1], advance=1, loss=loss, tps=tokens / elapsed)
                elif log is not None and (i == 0 or (i + 1) % max(1, t.steps // 10) == 0 or i + 1 == t.steps):
                    moe = (
                        f"  aux {record['aux_loss']:.3f}  load max/mean {record['expert_load_max_over_mean']:.2f}"
                        f"  dropped {record['dropped_fraction']:.1%}"
                        if "aux_loss" in record
                        else ""
                    )
                    log.write(
                        f"step {i + 1:>4}/{t.steps}  loss {loss:.4f}  {tokens / elapsed:,.0f} tokens/s  "
                        f"{elapsed * 1e3:.0f} ms{moe}\n"
                    )
                    log.flush()
                if stopped_at:
                    break
        finally:
            if sink is not None:
                sink.close()
            if bar is not None:
                bar[0].stop()
            if ckpt is not None:
                ckpt.close()
    result = RunResult(
        losses=[r["loss"] for r in records],
        step_times_s=[r["step_time_s"] for r in records],
        memory_per_device=program.memory,
        params=count_params(model),
        expert_load=expert_load,
        records=records,
        collectives=tuple(collective_times(program.collectives(), timed, program.processes)) if timed else (),
        compiled=(0, resumed_at),
    )
    if lead and out_dir is not None:
        plot_losses(result.losses, Path(out_dir) / "loss.png", title=f"{cfg.model.family}, {run.describe()}")
    if stopped_at:
        written = f"; its checkpoint is {ckpt.directory / str(stopped_at)}" if ckpt is not None else ""
        raise Interrupted(f"after step {stopped_at} of {t.steps}{written}")
    return result


def _diverged(step: int, loss: float, grad_norm: float, run: Run, ckpt: Checkpoints | None) -> None:
    """Stop a run whose step ``step`` gave a loss or gradient norm that is not finite: every later step would
    be too, so nothing of it is kept (no checkpoint, no metrics line), and the error names the step and the fix.

    Raises:
      ConfigError: always.
    """
    t = run.config.train
    if ckpt is not None:
        ckpt.wait()  # the previous step's write, so that the newest kept is named
    steps = saved_steps(ckpt.directory) if ckpt is not None else []
    kept = f"; the last checkpoint, {ckpt.directory / str(max(steps))}, is kept" if steps else ""
    raise ConfigError(
        f"step {step}: the loss is {loss} and the gradient norm {grad_norm}: training diverged (train.lr={t.lr}, "
        f"train.warmup_steps={t.warmup_steps}, train.grad_clip={t.grad_clip}); lower train.lr or raise "
        f"train.warmup_steps{kept}"
    )


def _wait(step_fn: Any, state: Any, i: int) -> Any:
    return jax.block_until_ready(step_fn(state, i))


def trim_heap() -> None:
    """Give the allocator's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing).

    A checkpoint copies the whole state to host buffers on several threads, and XLA's threads allocate
    too; glibc keeps freed pages in per-thread heaps, so without this the resident memory creeps up (by
    about 100 MiB over 200 steps of ``benchmarks/reliability.py``). Called every ``train.checkpoint_every``
    steps, after the checkpoint if there is one.
    """
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


OPTIMIZER_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip")
"""The ``train.*`` keys of the optimizer and its learning-rate schedule a checkpoint records: a run resumes only
with the same (another would change the steps it goes on with; ``train.steps``, the schedule's length, may grow)."""


def _optimizer(t: Any) -> dict[str, Any]:
    """The values of :data:`OPTIMIZER_KEYS` as the config gives them (a null ``warmup_steps``, a tenth of
    ``train.steps``, grows with the schedule's length as its cosine decay does)."""
    return {k: getattr(t, k) for k in OPTIMIZER_KEYS}


def _meta(run: Run, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a checkpoint records beside the arrays: where the data stands, the seeds, the run so far."""
    t = run.config.train
    return {
        "step": len(records),
        "data": {"source": t.data, "seed": t.seed, "position": len(records), "global_batch": t.global_batch},
        "rng": {"seed": t.seed},
        "devices": run.devices,
        "strategy": run.describe(),
        "model": model_record(run.config.model),
        "optimizer": _optimizer(t),
        "records": list(records),  # a copy: orbax writes it on another thread while training goes on
    }


def check_resume(directory: str | Path, run: Run) -> None:
    """What ``train --resume`` checks of the newest checkpoint in ``directory`` once it is read (the run it
    continues, :func:`_check_same_run`; imported weights, their model), from its record alone: before any
    folder is made or device started. A record that cannot be read is left to the restore.

    Raises:
      ConfigError: as :func:`_check_same_run`.
    """
    steps = saved_steps(directory)
    meta = saved_meta(directory, steps[-1]) if steps else None
    if meta is None:
        return
    where = Path(directory) / str(steps[-1])
    if imported(directory):
        check_model(meta, run.config.model, f"checkpoint {str(where)!r}")
    elif isinstance(meta.get("data"), dict) and isinstance(meta.get("step"), int):
        _check_same_run(meta, run, where)


def _check_same_run(meta: dict[str, Any], run: Run, where: Path) -> None:
    """A checkpoint continues only the run it came from: same data, seed, global batch, model and optimizer
    settings (:data:`OPTIMIZER_KEYS`)."""
    t = run.config.train
    want = {"source": t.data, "seed": t.seed, "global_batch": t.global_batch}
    keys = {"source": "train.data", "seed": "train.seed", "global_batch": "train.global_batch"}
    for key, value in want.items():
        if meta["data"].get(key) != value:
            raise ConfigError(
                f"checkpoint {str(where)!r} was written with {keys[key]}={meta['data'].get(key)!r} but this run "
                f"has {keys[key]}={value!r}; resume with the same {keys[key]}, or use a new --checkpoint-dir"
            )
    check_model(meta, run.config.model, f"checkpoint {str(where)!r}")
    now = _optimizer(t)
    for key, was in (meta.get("optimizer") or {}).items():  # recorded since the optimizer's keys were
        if key in now and now[key] != was:
            raise ConfigError(
                f"checkpoint {str(where)!r} was written with train.{key}={was!r} but this run has "
                f"train.{key}={now[key]!r}: the optimizer would go on from its state under another "
                f"setting; resume with train.{key}={was!r}, or start a new run in a new --checkpoint-dir"
            )
    if meta["step"] > t.steps:
        raise ConfigError(
            f"checkpoint {str(where)!r} is at step {meta['step']}, past train.steps={t.steps}; "
            f"set --steps {meta['step']} or more"
        )


def _progress_bar(steps: int, done: int = 0) -> tuple[Any, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tps]:,.0f} tokens/s"),
        TimeRemainingColumn(),
    )
    task = progress.add_task("train", total=steps, completed=done, loss=float("nan"), tps=0.0)
    progress.start()
    return progress, task


def plot_losses(losses: list[float], path: Path, *, title: str) -> None:
    """Draw the loss curve to ``path`` (PNG), written whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> None:
    """Lay out ``fig`` and write it to ``path`` as PNG, whole or not at all; close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)


def summary(run: Run, result: RunResult) -> dict[str, Any]:
    """The closing summary of a run as plain data."""
    return {
        "hardware": run.hardware.name,
        "strategy": run.describe(),
        "mesh": run.axes,
        "stages": [{"name": s.name, "devices": s.devices, "mesh": dict(s.axes)} for s in run.stages],
        "devices": run.devices,
        "processes": jax.process_count(),
        "params": result.params,
        "memory_per_device_bytes": result.memory_per_device,
        "emulated_step_time_s": result.step_time_s,
        "first_loss": result.losses[0],
        "final_loss": result.losses[-1],
        "expert_load": result.expert_load,
        "collectives": [c.to_dict() for c in result.collectives],
    }
