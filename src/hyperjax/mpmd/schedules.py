"""Pipeline schedules as data: each is a pure function returning a stage x time grid.

A grid has one row per pipeline stage (a submesh) and one column per time slot. A cell holds the
:class:`Task` the stage runs in that slot, or ``None`` when the stage idles (a bubble). Tasks take whole
slots: a forward one slot, a full backward two (it costs about twice the forward), and when the backward
is split (zero-bubble) its input-gradient part ``B`` and weight-gradient part ``W`` one slot each. A task
lasting several slots fills consecutive cells with the same value.

With ``v`` virtual stages, stage ``s`` holds the model chunks ``s, s + p, s + 2p, ...`` (``p`` stages), so
a micro-batch passes through every stage ``v`` times. Chunks are numbered in model order
(:attr:`Task.chunk`), and a task's dependencies are on the neighbouring chunks.

The grids are built the same way for every schedule: each stage's order of tasks (the part that makes
a schedule what it is) is placed slot by slot, each task as soon as its stage is free and the tasks it
depends on have finished in an earlier slot. :func:`validate` checks any grid; the runtime executes the
grid column by column and the cost model reads the same grid.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from hyperjax.config import Run, ScheduleName, TaskKind, choices
from hyperjax.errors import ConfigError, positive_int

SCHEDULES: tuple[ScheduleName, ...] = choices(ScheduleName)
PAIRED: tuple[ScheduleName, ...] = ("1f1b", "interleaved")
"""The schedules whose forwards and backwards ``parallel.overlap: fb-pair`` pairs."""
_SLOTS = {"F": 1, "B": 2, "W": 1}  # slots per task; "B" is 1 slot when the backward is split


class ScheduleError(ConfigError):
    """A schedule grid breaks a rule (a bug in a schedule, or a hand-written grid)."""


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One unit of pipeline work.

    Attributes:
      kind: ``F`` forward, ``B`` backward (input and weight gradients, or only the input gradient when
        the schedule splits the backward), ``W`` weight gradient (split backward only).
      microbatch: the micro-batch index.
      chunk: the model chunk, in model order (``0 .. stages * virtual_stages - 1``).
    """

    kind: TaskKind
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


Grid = tuple[tuple[Task | None, ...], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """A schedule's grid and the facts needed to read it.

    Attributes:
      name: one of :data:`SCHEDULES`.
      stages: pipeline stages (rows).
      microbatches: micro-batches per step.
      virtual_stages: model chunks per stage.
      split_backward: whether the backward is split into ``B`` and ``W``.
      grid: ``grid[stage][slot]``.
      pairs: ``(F, B)`` tasks of different micro-batches that run together on their stage as one program,
        F's slot then B's, both tasks' inputs ready at its start (``parallel.overlap: fb-pair``: each
        one's all-to-all hides behind the other's compute, :mod:`hyperjax.mpmd.lanes`); empty otherwise.
    """

    name: ScheduleName
    stages: int
    microbatches: int
    virtual_stages: int
    split_backward: bool
    grid: Grid
    pairs: tuple[tuple[Task, Task], ...] = ()

    @property
    def chunks(self) -> int:
        """Model chunks in all."""
        return self.stages * self.virtual_stages

    @property
    def slots(self) -> int:
        """Columns of the grid."""
        return len(self.grid[0]) if self.grid else 0

    def stage_of(self, chunk: int) -> int:
        """The stage that holds ``chunk``."""
        return chunk % self.stages

    def slots_of(self, task: Task) -> int:
        """Slots ``task`` occupies."""
        return 1 if self.split_backward else _SLOTS[task.kind]

    def bubble_fraction(self) -> float:
        """Idle cells over all cells (every task of a uniform pipeline takes its nominal slots)."""
        cells = self.stages * self.slots
        return sum(c is None for row in self.grid for c in row) / cells if cells else 0.0

    def starts(self) -> list[tuple[int, int, Task]]:
        """``(slot, stage, task)`` for each task where it starts, in time order then stage order."""
        return list(self._starts)

    @functools.cached_property
    def _starts(self) -> tuple[tuple[int, int, Task], ...]:
        out = []
        for s, row in enumerate(self.grid):
            for t, cell in enumerate(row):
                if cell is not None and (t == 0 or row[t - 1] != cell):
                    out.append((t, s, cell))
        return tuple(sorted(out))

    @functools.cached_property
    def order(self) -> tuple[tuple[int, Task, tuple[int, ...]], ...]:
        """``(stage, task, positions of its dependencies in this order)`` for every task, in start order:
        what a replay walks."""
        position: dict[Task, int] = {}
        out = []
        for i, (_, s, task) in enumerate(self._starts):
            position[task] = i
            deps = tuple(position[d] for d in self.dependencies(task))
            out.append((s, task, deps))
        return tuple(out)

    @functools.cached_property
    def partner(self) -> dict[Task, Task]:
        """Each paired task's partner."""
        return {**dict(self.pairs), **{b: f for f, b in self.pairs}}

    def dependencies(self, task: Task) -> list[Task]:
        """What ``task`` waits for in this grid (:func:`pair_dependencies`)."""
        return pair_dependencies(task, self.chunks, self.split_backward, self.partner)

    def render(self) -> str:
        """The grid as text, one line per stage (``.`` for a bubble)."""
        width = max((len(str(c)) for row in self.grid for c in row if c is not None), default=1)
        return "\n".join(
            f"stage {s}: " + " ".join(("." if c is None else str(c)).ljust(width) for c in row)
            for s, row in enumerate(self.grid)
        )


def check_sizes(name: str, stages: int, microbatches: int, virtual_stages: int) -> None:
    """Sizes schedule ``name`` can take.

    Raises:
      ConfigError: naming the config key and the fix.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={name!r} is not one of {SCHEDULES}")
    for key, value in (
        ("parallel.pipeline", stages),
        ("train.microbatches", microbatches),
        ("parallel.virtual_stages", virtual_stages),
    ):
        positive_int(value, key)
    if virtual_stages > 1 and name != "interleaved":
        raise ConfigError(
            f"parallel.virtual_stages={virtual_stages} needs parallel.schedule: interleaved (got {name!r}); "
            "set virtual_stages: 1 or use the interleaved schedule"
        )
    if virtual_stages == 1 and name == "interleaved":
        raise ConfigError(
            "parallel.schedule='interleaved' with parallel.virtual_stages=1 is 1F1B's grid; give each stage two "
            "or more chunks (virtual_stages >= 2), or set parallel.schedule: 1f1b"
        )
    if name == "interleaved" and microbatches % stages:
        raise ConfigError(
            f"the interleaved schedule runs micro-batches in groups of parallel.pipeline={stages}, but "
            f"train.microbatches={microbatches} is not a multiple of it; use a multiple of {stages}"
        )


def _gpipe_order(stage: int, stages: int, m: int, v: int) -> list[Task]:
    return [Task("F", j, stage) for j in range(m)] + [Task("B", j, stage) for j in range(m)]


def _one_f_one_b_order(
    stage: int, stages: int, m: int, v: int, *, backward: tuple[str, ...] = ("B",), paired: bool = False
) -> list[Task]:
    warm = min(warm_up(stage, stages, paired=paired), m)
    order = [Task("F", j, stage) for j in range(warm)]
    f = warm
    for b in range(m):
        if f < m:
            order.append(Task("F", f, stage))
            f += 1
        order.extend(Task(kind, b, stage) for kind in backward)
    return order


def _paired_order(stage: int, stages: int, m: int, v: int) -> list[Task]:
    order = _interleaved_order if v > 1 else _one_f_one_b_order
    return order(stage, stages, m, v, paired=True)


def warm_up(stage: int, stages: int, virtual_stages: int = 1, *, paired: bool = False) -> int:
    """Forwards (chunk forwards when interleaved) stage ``stage`` runs before its first backward, however few
    the micro-batches; ``paired``: before its first F-B pair (``parallel.overlap: fb-pair``).

    1F1B: ``p - s - 1``; paired ``2(p - s) - 1``. A pair starts only once its backward's gradient has come
    back and hands its output on only at its end, so the round trip through the later stages takes twice as
    long as 1F1B's, and the warm-up covers it (the last stage pairs too).
    Interleaved: Megatron-LM's ``2(p - s - 1) + (v - 1) p``; paired one more, as its combined 1F1B schedule
    for interleaved pipelines warms up (``overlap_moe_expert_parallel_comm``). Its plain order already
    counts each hand-over at the end of a step's forward and backward, so one forward is all a pair adds.
    """
    p, s, v = stages, stage, virtual_stages
    if v == 1:
        return 2 * (p - s) - 1 if paired else p - s - 1
    return 2 * (p - s - 1) + (v - 1) * p + paired


def _interleaved_order(stage: int, stages: int, m: int, v: int, *, paired: bool = False) -> list[Task]:
    # Megatron-LM's interleaved 1F1B: micro-batches advance in groups of `stages` through the chunks
    p, total = stages, m * v

    def forward(i: int) -> Task:
        group, k = divmod(i, p * v)
        return Task("F", group * p + k % p, (k // p) * p + stage)

    def backward(i: int) -> Task:
        group, k = divmod(i, p * v)
        return Task("B", group * p + k % p, (v - 1 - k // p) * p + stage)

    warm = min(warm_up(stage, p, v, paired=paired), total)
    order = [forward(i) for i in range(warm)]
    f = warm
    for b in range(total):
        if f < total:
            order.append(forward(f))
            f += 1
        order.append(backward(b))
    return order


def _zero_bubble_order(stage: int, stages: int, m: int, v: int) -> list[Task]:
    # ZB-H1: 1F1B with the weight-gradient part of each backward deferred until the stage would
    # otherwise wait; the placement below (not this order) decides when a deferred W runs
    return _one_f_one_b_order(stage, stages, m, v, backward=("B",))


_ORDERS: dict[str, Callable[[int, int, int, int], list[Task]]] = {
    "gpipe": _gpipe_order,
    "1f1b": _one_f_one_b_order,
    "interleaved": _interleaved_order,
    "zero-bubble": _zero_bubble_order,
}


def make_schedule(
    name: str, stages: int, microbatches: int, virtual_stages: int = 1, *, pair: bool = False
) -> Schedule:
    """The grid of schedule ``name`` for ``stages`` stages and ``microbatches`` micro-batches.

    With ``pair`` (1F1B or interleaved), stage ``s`` warms up with :func:`warm_up` forwards, and every
    later forward runs as one program with the backward after it in the stage's order (:attr:`Schedule.pairs`,
    under interleaving possibly of another of the stage's chunks): the pair starts once both tasks' inputs are
    ready and hands both outputs on at its end (:func:`pair_dependencies`).

    Raises:
      ConfigError: an unknown schedule or sizes it cannot take, naming the config key.
    """
    check_sizes(name, stages, microbatches, virtual_stages)
    stages, microbatches, virtual_stages = int(stages), int(microbatches), int(virtual_stages)  # a NumPy one too
    if pair and name not in PAIRED:
        raise ConfigError(
            f"parallel.overlap='fb-pair' pairs tasks of the {' and '.join(PAIRED)} schedules, not of {name!r}"
        )
    split = name == "zero-bubble"
    order_of = _paired_order if pair else _ORDERS[name]
    orders = [order_of(s, stages, microbatches, virtual_stages) for s in range(stages)]
    partner: dict[Task, Task] = {}
    if pair:  # each forward after the warm-up with the backward that follows it
        for s, order in enumerate(orders):
            warm = warm_up(s, stages, virtual_stages, paired=True)
            for f, b in zip(order[warm:], order[warm + 1 :], strict=False):
                if f.kind == "F" and b.kind == "B" and f not in partner and b not in partner:
                    partner[f], partner[b] = b, f
    chunks = stages * virtual_stages
    slots_of = (lambda t: 1) if split else (lambda t: _SLOTS[t.kind])
    done: dict[Task, int] = {}  # task -> first free slot after it
    rows: list[list[Task | None]] = [[] for _ in range(stages)]
    position = [0] * stages
    pending_w: list[list[Task]] = [[] for _ in range(stages)]

    def ready_at(task: Task) -> int | None:
        deps = pair_dependencies(task, chunks, split, partner)
        if any(d not in done for d in deps):
            return None
        return max((done[d] for d in deps), default=0)

    def place(s: int, task: Task) -> None:
        rows[s].extend([task] * slots_of(task))
        done[task] = len(rows[s])

    work = sum(slots_of(t) for o in orders for t in o) + (stages * microbatches * virtual_stages if split else 0)
    t = 0
    while any(position[s] < len(orders[s]) or pending_w[s] for s in range(stages)):
        if t > 2 * work + stages:  # a schedule whose orders wait on each other: a bug, not user input
            raise ScheduleError(f"schedule {name!r} deadlocks for {stages} stages, {microbatches} micro-batches")
        for s in range(stages):
            if len(rows[s]) > t or (position[s] >= len(orders[s]) and not pending_w[s]):
                continue  # busy, or finished
            task = orders[s][position[s]] if position[s] < len(orders[s]) else None
            at = ready_at(task) if task is not None else None
            if task is not None and at is not None and at <= t:
                place(s, task)
                position[s] += 1
                if task.kind == "F" and task in partner:
                    place(s, partner[task])
                    position[s] += 1
                if split and task.kind == "B":
                    pending_w[s].append(Task("W", task.microbatch, task.chunk))
            elif pending_w[s]:
                place(s, pending_w[s].pop(0))  # deferred weight work fills what would be a bubble
            else:
                rows[s].append(None)
        t += 1
    width = max(len(r) for r in rows)
    grid = tuple(tuple(r + [None] * (width - len(r))) for r in rows)
    sched = Schedule(
        name=name,
        stages=stages,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        split_backward=split,
        grid=grid,
        pairs=tuple((f, b) for f, b in partner.items() if f.kind == "F"),
    )
    validate(sched)
    return sched


def run_schedule(run: Run) -> Schedule:
    """The grid a resolved run's stages execute: its schedule (1F1B for MPMD submeshes without one), with
    forwards and backwards paired under ``parallel.overlap: fb-pair``."""
    return make_schedule(
        run.schedule or "1f1b",
        len(run.stages),
        run.microbatches,
        run.virtual_stages,
        pair=run.overlap == "fb-pair",
    )


def pair_dependencies(task: Task, chunks: int, split: bool, partner: dict[Task, Task]) -> list[Task]:
    """What ``task`` waits for when the tasks in ``partner`` run in pairs, each pair one program: a pair
    starts once the inputs of both its tasks are ready, and hands its outputs on at its end (its
    backward's)."""
    deps = dependencies(task, chunks, split)
    mate = partner.get(task)
    if mate is not None and task.kind == "F":
        deps += [d for d in dependencies(mate, chunks, split) if d != task]
    return [partner[d] if d.kind == "F" and d in partner and partner[d] != task else d for d in deps]


def dependencies(task: Task, chunks: int, split: bool) -> list[Task]:
    j, c = task.microbatch, task.chunk
    if task.kind == "F":
        return [Task("F", j, c - 1)] if c > 0 else []
    if task.kind == "W":
        return [Task("B", j, c)]
    deps = [Task("F", j, c)]
    if c < chunks - 1:
        deps.append(Task("B", j, c + 1))
    return deps


def validate(sched: Schedule) -> None:
    """Check a grid: every task exactly once on its stage, contiguous, after everything it depends on.

    Raises:
      ScheduleError: the first rule broken, naming the task, stage and slot.
    """
    p, m, v, split = sched.stages, sched.microbatches, sched.virtual_stages, sched.split_backward
    if len(sched.grid) != p or len({len(r) for r in sched.grid}) > 1:
        raise ScheduleError(f"schedule {sched.name!r}: the grid needs {p} rows of equal length")
    kinds = ("F", "B", "W") if split else ("F", "B")
    expected = {Task(k, j, c) for k in kinds for j in range(m) for c in range(p * v)}
    span: dict[Task, tuple[int, int]] = {}
    for s, row in enumerate(sched.grid):
        t = 0
        while t < len(row):
            task = row[t]
            if task is None:
                t += 1
                continue
            length = sched.slots_of(task)
            if tuple(row[t : t + length]) != (task,) * length:
                raise ScheduleError(f"schedule {sched.name!r}: {task} on stage {s} at slot {t} needs {length} slots")
            if task in span:
                raise ScheduleError(f"schedule {sched.name!r}: {task} runs twice (stage {s}, slot {t})")
            if task not in expected:
                raise ScheduleError(f"schedule {sched.name!r}: {task} at stage {s}, slot {t} is not a task of it")
            if sched.stage_of(task.chunk) != s:
                raise ScheduleError(
                    f"schedule {sched.name!r}: {task} runs on stage {s}, but chunk {task.chunk} lives on "
                    f"stage {sched.stage_of(task.chunk)}"
                )
            span[task] = (t, t + length)
            t += length
    missing = expected - set(span)
    if missing:
        raise ScheduleError(f"schedule {sched.name!r}: {min(missing)} never runs ({len(missing)} tasks missing)")
    for f, b in sched.pairs:  # a pair: F, then at once B (the dependencies below hold its inputs to its start)
        same = sched.stage_of(f.chunk) == sched.stage_of(b.chunk)
        if f.kind != "F" or b.kind != "B" or f.microbatch == b.microbatch or not same:
            raise ScheduleError(
                f"schedule {sched.name!r}: a pair is a forward and a backward of two micro-batches on one stage, "
                f"not {f} and {b}"
            )
        if span[b][0] != span[f][1]:
            raise ScheduleError(f"schedule {sched.name!r}: paired {f} and {b} do not run back to back")
    for task, (start, _) in span.items():
        for dep in sched.dependencies(task):
            if span[dep][1] > start:
                raise ScheduleError(
                    f"schedule {sched.name!r}: {task} starts at slot {start} before {dep} ends at slot {span[dep][1]}"
                )
