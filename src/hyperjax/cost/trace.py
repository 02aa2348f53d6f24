"""A predicted training step as a Chrome / Perfetto trace (open it in ui.perfetto.dev).

The step is the schedule's own grid (:mod:`hyperjax.mpmd.schedules`, the one the runtime executes)
replayed with the cost model's task lengths: each stage runs its tasks in the grid's order, each as soon
as the stage is free and its inputs have arrived, so bubbles appear where they occur. One process per
pipeline stage, with a compute track (forward ``F``, backward ``B`` and, when the backward is split,
weight-gradient ``W`` tasks of each micro-batch and chunk, recomputation included) and a communication
track (each task's exposed collectives, the data-parallel gradient reduction, then the optimizer step).
A mixture of experts adds an all-to-all track: the communication lane of :mod:`hyperjax.mpmd.lanes`,
every dispatch and combine where the run's overlap schedule runs it inside its task (or its pair).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hyperjax.config import Run
from hyperjax.cost.estimate import Estimate
from hyperjax.cost.overlap import lane_events
from hyperjax.cost.parts import chunk_starts
from hyperjax.errors import ConfigError
from hyperjax.files import write_json
from hyperjax.mpmd.schedules import Task
from hyperjax.mpmd.timing import replay

COMPUTE, COMMUNICATION, ALL_TO_ALL = 0, 1, 2

TRACE_EVENTS = 1_000_000
"""The most events a trace draws: at about 170 bytes an event (as written here), a JSON file near 170 MB, which
the browser-based trace viewers load slowly or not at all."""


def check_traceable(run: Run) -> None:
    """The trace of ``run``'s step has at most :data:`TRACE_EVENTS` events: two of each task (a forward or a
    backward of a micro-batch on a model chunk), for a mixture of experts two of each of its layers'
    token exchanges, and each stage's gradient reduction and optimizer step.

    Raises:
      ConfigError: the counts, their factors and the fix.
    """
    tasks = 2 * run.microbatches * run.chunks
    m = run.config.model
    events = tasks * (2 + (2 * m.moe_layers / run.chunks if m.moe is not None else 0)) + 2 * len(run.stages)
    if events > TRACE_EVENTS:
        raise ConfigError(
            f"--trace: the step runs {tasks:,} tasks (forward and backward of {run.microbatches:,} micro-batches "
            f"on {run.chunks} model chunks), about {events:,.0f} trace events, more than the {TRACE_EVENTS:,} a "
            "trace draws; trace a step of fewer micro-batches (a smaller train.global_batch, or a larger "
            "train.micro_batch), whose schedule the trace shows alike, and price this one without --trace"
        )


def task_events(
    times: dict[Task, tuple[int, float, float]], *, pid: int = 0, comm_s: float | Mapping[int, float] = 0.0
) -> list[dict[str, Any]]:
    """Trace events of replayed tasks (``{task: (stage, start, end)}`` in seconds), one process per stage
    from ``pid`` on. ``comm_s`` (one figure, or one per chunk) of each ``F`` and ``B`` task is drawn on the
    communication track."""
    events = []
    for task, (stage, start, end) in sorted(times.items(), key=lambda kv: kv[1][1]):
        per = comm_s.get(task.chunk, 0.0) if isinstance(comm_s, Mapping) else comm_s
        comm = per if task.kind != "W" else 0.0
        name = {"F": "forward", "B": "backward", "W": "weight gradient"}[task.kind]
        args = {"task": str(task), "microbatch": task.microbatch, "chunk": task.chunk}
        events.append(_event(name, start, end - start - comm, pid + stage, COMPUTE, args))
        if comm > 0:
            events.append(_event("exposed collectives", end - comm, comm, pid + stage, COMMUNICATION, args))
    return events


def stage_metadata(stages: int, *, pid: int = 0, label: str = "stage") -> list[dict[str, Any]]:
    """Process and thread names for ``stages`` stages from ``pid`` on."""
    meta = []
    for i in range(stages):
        meta.append({"name": "process_name", "ph": "M", "pid": pid + i, "args": {"name": f"{label} {i}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid + i, "args": {"sort_index": pid + i}})
        meta.append({"name": "thread_name", "ph": "M", "pid": pid + i, "tid": COMPUTE, "args": {"name": "compute"}})
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid + i, "tid": COMMUNICATION, "args": {"name": "communication"}}
        )
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid + i, "tid": ALL_TO_ALL, "args": {"name": "all-to-all"}}
        )
    return meta


def exchange_events(est: Estimate, times: dict[Task, tuple[int, float, float]], *, pid: int = 0) -> list[dict]:
    """The all-to-all track: each ``F`` and ``B`` task's dispatches and combines as its lanes run them, a
    pair's (``fb-pair``) from the pair's start."""
    run = est.run
    if run.config.model.moe is None:
        return []
    sched, _ = est.schedule()
    share = run.exchange_share
    partner = {f: b for f, b in sched.pairs}
    paired = set(partner) | set(partner.values())
    m, starts = run.config.model, chunk_starts(run)
    layers = {}  # chunk -> its MoE layers (a stage's MoE blocks are priced alike; a chunk may hold none)
    for cost, stage in zip(est.stages, run.stages, strict=True):
        block = next((p.layer for p in cost.parts if p.moe and p.layers), None)
        for c, n in zip(stage.chunks, stage.layers, strict=True):
            layers[c] = [block] * sum(m.is_moe(i) for i in range(starts[c], starts[c] + n)) if block else []
    events = []
    for task, (stage, start, _) in times.items():
        if task.kind == "W" or (task in paired and task.kind == "B"):
            continue
        if task in partner:
            kinds, overlap, streams = ("F", "B"), "fb-pair", (layers[task.chunk], layers[partner[task].chunk])
        else:
            kinds = (task.kind,) * (2 if run.overlap == "two-microbatch" else 1)
            overlap = "two-microbatch" if run.overlap == "two-microbatch" else "none"
            streams = (layers[task.chunk],) * len(kinds)
        for lane_task, s, e in lane_events(streams, overlap, kinds, share):
            args = {"task": str(task), "lane task": str(lane_task)}
            events.append(_event(lane_task.name, start + s, e - s, pid + stage, ALL_TO_ALL, args))
    return events


def simulate(est: Estimate, *, pid: int = 0) -> list[dict[str, Any]]:
    """Trace events (microseconds) of one predicted step."""
    sched, seconds = est.schedule()
    times = replay(sched, seconds)
    comm = {c.chunk: c.comm_s / 2 for s in est.stages for c in s.chunks}
    if est.closed_form:
        share = est.stages[est.critical].chunks
        comm = dict.fromkeys(comm, sum(c.comm_s for c in share) / len(share) / 2)
    events = task_events(times, pid=pid, comm_s=comm) + exchange_events(est, times, pid=pid)
    end = max(e for _, _, e in times.values())
    stage = est.stages[est.critical]  # the step ends with the slowest stage's reduction and update
    for i in range(sched.stages):
        t = end
        if stage.data_parallel_exposed_s:
            events.append(
                _event(
                    "data-parallel gradient reduction (exposed)",
                    t,
                    stage.data_parallel_exposed_s,
                    pid + i,
                    COMMUNICATION,
                    {},
                )
            )
            t += stage.data_parallel_exposed_s
        events.append(_event("optimizer step", t, stage.optimizer_s, pid + i, COMPUTE, {}))
        # an offload placement's step (``with_offload``): the recomputation it chose and the host transfers it
        # leaves exposed, after the step it was priced over, so the trace ends at the step it prices
        t += stage.optimizer_s
        for name in ("recompute", "exposed_host_transfer") if "exposed_host_transfer" in est.breakdown_s else ():
            label = {"recompute": "recomputation (placement)", "exposed_host_transfer": "exposed host transfers"}
            seconds = est.breakdown_s[name]
            if seconds > 0:
                events.append(_event(label[name], t, seconds, pid + i, COMPUTE, {"offload": est.run.offload}))
                t += seconds
    return events


def _event(name: str, start_s: float, dur_s: float, pid: int, tid: int, args: dict) -> dict[str, Any]:
    return {"name": name, "ph": "X", "ts": start_s * 1e6, "dur": dur_s * 1e6, "pid": pid, "tid": tid, "args": args}


def write_trace(est: Estimate, path: str | Path, *, title: str) -> None:
    """Write the trace of ``est`` to ``path`` (JSON in the Chrome trace event format), atomically.

    Raises:
      ConfigError: the step has more tasks than a trace draws (:func:`check_traceable`).
    """
    check_traceable(est.run)
    data = {
        "traceEvents": stage_metadata(len(est.run.stages)) + simulate(est),
        "displayTimeUnit": "ms",
        "otherData": {"title": title, "predicted_step_time_s": est.step_time_s},
    }
    write_json(path, data, indent=None)
