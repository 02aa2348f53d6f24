"""How long a schedule's grid takes when its tasks have lengths: replayed, or in closed form.

:func:`replay` runs a grid with given task lengths (each task as soon as its stage is free and its inputs
have arrived). For equal stages most schedules need no replay: :func:`closed_form_idle` gives each
stage's idle time directly, and tests hold it equal to the replay wherever it answers. GPipe, 1F1B and
interleaved 1F1B idle ``(p - 1)(F + B)`` per stage (F and B per chunk) whatever the ratio of the two;
ZB-H1 idles ``(p - 1)(F + B) - min(m - 1, p - 1) W`` while ``W <= min(F, B)``: with at least as many
micro-batches as stages that is Qi et al.'s ``(p - 1)(F + B - W)``, and with fewer only ``m - 1`` deferred
weight gradients fill the cool-down. Elsewhere the grid is replayed, once per set of length ratios.
"""

from __future__ import annotations

import functools

from hyperjax.config import ScheduleName
from hyperjax.mpmd.schedules import Schedule, Task, make_schedule


def theory_bubble(
    name: str, stages: int, microbatches: int, virtual_stages: int = 1, costs: tuple[float, float, float] | None = None
) -> float:
    """The textbook bubble fraction of a uniform pipeline under ``name``.

    GPipe and 1F1B: ``(p-1)/(m+p-1)``; interleaved 1F1B: ``(p-1)/(v*m+p-1)`` (the bubble shrinks by v);
    these do not depend on the forward/backward ratio. Zero-bubble ZB-H1 idles ``(p-1)(F + B - W)`` per
    stage (Qi et al., 2024) against ``m (F + B + W)`` of work, for the forward, input-gradient and
    weight-gradient costs ``costs = (F, B, W)``; with the three equal (the default) that is
    ``(p-1)/(3m+p-1)``, a third of 1F1B's bubble. The ZB-H1 figure holds while ``W <= min(F, B)``;
    a longer W no longer fits the gaps it fills, and the grid idles more than this.
    """
    p, m, v = stages, microbatches, virtual_stages
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zero-bubble":
        f, b, w = costs or (1.0, 1.0, 1.0)
        idle = (p - 1) * max(f + b - w, 0.0)
        return idle / (m * (f + b + w) + idle)
    return (p - 1) / (m + p - 1)


def closed_form_idle(
    name: ScheduleName, stages: int, microbatches: int, forward: float, backward: float, weight: float = 0.0
) -> float | None:
    """Each stage's idle time in a step of equal stages, in closed form; ``None`` where none is known to hold.

    Args:
      name: the schedule.
      stages: pipeline stages ``p``.
      microbatches: micro-batches ``m``.
      forward, backward, weight: one chunk's ``F``, ``B`` (the input-gradient part when the backward is
        split) and ``W`` task lengths.
    """
    p = stages
    if p == 1:
        return 0.0
    if name in ("gpipe", "1f1b", "interleaved"):
        return (p - 1) * (forward + backward)
    if name == "zero-bubble" and weight <= min(forward, backward):
        return (p - 1) * (forward + backward) - min(microbatches - 1, p - 1) * weight
    return None


def replay(sched: Schedule, seconds: dict[Task, float]) -> dict[Task, tuple[int, float, float]]:
    """Times of every task when each lasts ``seconds[task]``: ``{task: (stage, start, end)}``.

    Each stage runs its tasks in the grid's order, each as soon as the stage is free and its
    dependencies have ended. With every task at its nominal slots this reproduces the grid.
    """
    clock = [0.0] * sched.stages
    ends: list[float] = []
    out: dict[Task, tuple[int, float, float]] = {}
    for s, task, deps in sched.order:
        start = max([clock[s], *(ends[d] for d in deps)])
        clock[s] = start + seconds[task]
        ends.append(clock[s])
        out[task] = (s, start, clock[s])
    return out


def replay_end(sched: Schedule, lengths: dict[tuple[int, str], float]) -> float:
    """When the last task of :func:`replay` ends, with each task lasting ``lengths[(chunk, kind)]``."""
    clock = [0.0] * sched.stages
    ends: list[float] = []
    for s, task, deps in sched.order:
        start = clock[s]
        for d in deps:
            start = max(start, ends[d])
        clock[s] = start + lengths[(task.chunk, task.kind)]
        ends.append(clock[s])
    return max(clock)


def replayed_bubble(sched: Schedule, seconds: dict[Task, float]) -> float:
    """Idle time over stage time of :func:`replay` (from the first start to the last end)."""
    times = replay(sched, seconds)
    end = max(e for _, _, e in times.values())
    return 1 - sum(seconds.values()) / (sched.stages * end) if end else 0.0


def task_seconds(sched: Schedule, forward: float, backward: float, weight: float = 0.0) -> dict[Task, float]:
    """Every task of a pipeline of equal stages: ``F`` lasts ``forward``, ``B`` ``backward`` and ``W`` ``weight``.

    For a split backward, ``backward`` is the input-gradient part only.
    """
    length = {"F": forward, "B": backward, "W": weight}
    return {task: length[task.kind] for _, _, task in sched.starts()}


@functools.lru_cache(maxsize=8192)
def grid_bubble(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The bubble fraction of a schedule's grid (every task at its nominal slots), cached."""
    return cached_schedule(name, stages, microbatches, virtual_stages).bubble_fraction()


@functools.lru_cache(maxsize=256)
def cached_schedule(name: str, stages: int, microbatches: int, virtual_stages: int, pair: bool = False) -> Schedule:
    """:func:`make_schedule`, remembered (a search replays the same few grids many times)."""
    return make_schedule(name, stages, microbatches, virtual_stages, pair=pair)


def paired_seconds(
    sched: Schedule, seconds: dict[Task, float], saving: dict[tuple[int, int], float]
) -> dict[Task, float]:
    """``seconds`` with every pair of ``sched`` shortened by the ``saving`` of its forward's and backward's
    chunks (running the two together instead of apart), shared between the two in proportion to their
    lengths."""
    out = dict(seconds)
    for f, b in sched.pairs:
        whole = seconds[f] + seconds[b]
        if whole > 0:
            cut = saving.get((f.chunk, b.chunk), 0.0)
            out[f] = seconds[f] - cut * seconds[f] / whole
            out[b] = seconds[b] - cut * seconds[b] / whole
    return out


@functools.lru_cache(maxsize=8192)
def uniform_bubble(
    name: str, stages: int, microbatches: int, virtual_stages: int, forward: float, backward: float, weight: float
) -> float:
    """The bubble fraction of the grid replayed with equal stages and the given task lengths.

    Only the ratios of the lengths matter; callers round them so that the cache is shared. With a
    backward twice the forward (or ``F = B = W`` when split) this is the grid's own bubble. Over equal
    stages the idle time of these grids does not depend on the micro-batch count once it reaches the
    stage count (the steady state has no gaps), so the grid is replayed for at most ``2 * stages``
    micro-batches and the idle time set against the full count's work.
    """
    m = min(microbatches, 2 * stages)
    sched = cached_schedule(name, stages, m, virtual_stages)
    seconds = task_seconds(sched, forward, backward, weight)
    end = max(e for _, _, e in replay(sched, seconds).values())
    idle = end - sum(seconds.values()) / stages
    work = microbatches * virtual_stages * (forward + backward + weight)
    return idle / (idle + work) if idle + work > 0 else 0.0
