"""A mixture of experts' all-to-all as tasks: a compute lane and a communication lane per stage.

Inside a pipeline task (a chunk's forward or backward), every MoE layer's dispatch and combine are tasks
on the stage's communication lane; the rest of the block is two tasks on its compute lane: ``attention``
(the attention, the router, the shared expert and the dense layers before it) and ``experts`` (the
routed experts' grouped products). One pass through a chunk is a *stream*, a chain that alternates the two
lanes: ``attention 0, dispatch 0, experts 0, combine 0, attention 1, ..., output``; a backward runs the
chain the other way (``output', combine' L-1, experts' L-1, dispatch' L-1, attention' L-1, ...``), its
all-to-alls carrying the gradients.

A :class:`LaneSchedule` says the order of the tasks on each lane and which compute task each
communication task runs beside (``hides``). The schedules:

- ``none``: one stream; every exchange waits for the compute before it and the compute after it waits
  for the exchange, so all of it is exposed (today's order).
- ``two-microbatch``: a micro-batch split in two halves, two streams interleaved (DeepSeek-V3's
  two-micro-batch overlap): while half A's dispatch runs, half B's attention computes, and so on.
- ``fb-pair``: one micro-batch's forward and another's backward interleaved on the same stage (DualPipe's
  F-B pairing; :func:`hyperjax.mpmd.schedules.make_schedule` with ``pair=True`` places the pairs).

:func:`validate_lanes` checks any lane schedule: every task once, on its own lane, in its stream's order,
no lane waiting on itself, and each ``hides`` pair able to run side by side. :func:`replay_lanes` times one
with given task lengths; the cost model prices the schedules with it, so what is priced is what is checked.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Literal

from hyperjax.config import Overlap
from hyperjax.mpmd.schedules import ScheduleError

Lane = Literal["compute", "comm"]
Pass = Literal["F", "B"]


@dataclasses.dataclass(frozen=True, order=True)
class LaneTask:
    """One task of a stream.

    Attributes:
      stream: the stream (a half of the micro-batch, or the forward or backward of a pair).
      index: its place in the stream's chain.
      lane: ``compute`` or ``comm``.
      name: what it does, e.g. ``dispatch 3`` or ``experts' 0`` (a prime: the backward's).
    """

    stream: int
    index: int
    lane: Lane
    name: str

    def __str__(self) -> str:
        return f"{self.name} [{self.stream}]"


def chain(stream: int, layers: int, kind: Pass) -> tuple[LaneTask, ...]:
    """The chain of one pass of ``kind`` through ``layers`` MoE layers: ``4 layers + 1`` tasks, compute and
    communication alternating (compute first and last)."""
    names: list[str] = []
    if kind == "F":
        for i in range(layers):
            names += [f"attention {i}", f"dispatch {i}", f"experts {i}", f"combine {i}"]
        names.append("output")
    else:
        names.append("output'")
        for i in reversed(range(layers)):
            names += [f"combine' {i}", f"experts' {i}", f"dispatch' {i}", f"attention' {i}"]
    return tuple(LaneTask(stream, k, "compute" if k % 2 == 0 else "comm", n) for k, n in enumerate(names))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaneSchedule:
    """The lanes of one stage while it runs the streams of an overlap schedule.

    Attributes:
      overlap: the schedule's name.
      kinds: each stream's pass (``F`` or ``B``).
      chains: each stream's tasks in dependency order.
      compute: the compute lane's order.
      comm: the communication lane's order.
      hides: each communication task that runs beside a compute task of another stream, and that task.
    """

    overlap: Overlap
    kinds: tuple[Pass, ...]
    chains: tuple[tuple[LaneTask, ...], ...]
    compute: tuple[LaneTask, ...]
    comm: tuple[LaneTask, ...]
    hides: Mapping[LaneTask, LaneTask]

    def render(self) -> str:
        """The two lanes as text, one line each."""
        return "\n".join(
            f"{lane}: " + ", ".join(map(str, tasks)) for lane, tasks in (("compute", self.compute), ("comm", self.comm))
        )


@functools.lru_cache(maxsize=256)
def lane_schedule(overlap: Overlap, layers: int | tuple[int, ...], kinds: tuple[Pass, ...]) -> LaneSchedule:
    """The lane schedule of ``overlap`` for passes ``kinds`` through ``layers`` MoE layers (one count for every
    pass, or one per pass: an F-B pair of an interleaved pipeline may join chunks of different depths).

    ``none`` takes one pass; ``two-microbatch`` two passes of the same kind (the halves);
    ``fb-pair`` a forward and a backward.

    Raises:
      ScheduleError: passes the schedule does not take.
    """
    expected = {"none": 1, "two-microbatch": 2, "fb-pair": 2}[overlap]
    if len(kinds) != expected or (overlap == "two-microbatch" and kinds[0] != kinds[1]):
        raise ScheduleError(f"overlap {overlap!r} takes {expected} passes, not {kinds}")
    if overlap == "fb-pair" and sorted(kinds) != ["B", "F"]:
        raise ScheduleError(f"overlap 'fb-pair' pairs a forward with a backward, not {kinds}")
    counts = (layers,) * len(kinds) if isinstance(layers, int) else layers
    if len(counts) != len(kinds) or (overlap == "two-microbatch" and counts[0] != counts[1]):
        raise ScheduleError(f"overlap {overlap!r}: layer counts {counts} for passes {kinds}")
    chains = tuple(chain(s, n, k) for s, (n, k) in enumerate(zip(counts, kinds, strict=True)))
    compute, comm, hides = [], [], {}
    if len(chains) == 1:
        compute = [t for t in chains[0] if t.lane == "compute"]
        comm = [t for t in chains[0] if t.lane == "comm"]
    else:
        # round robin: a's compute, b's compute, a's exchange beside b's compute, b's exchange beside a's next;
        # once the shorter chain has ended, the longer one runs on alone, its exchanges hidden by nothing (a
        # pass through no MoE layer hides nothing)
        a, b = chains
        for k in range(0, max(len(a), len(b)), 2):
            compute += [x[k] for x in (a, b) if k < len(x)]
            for x, y, ahead in ((a, b, 0), (b, a, 2)):
                if k + 1 < len(x):
                    comm.append(x[k + 1])
                    if k + ahead < len(y) and len(y) > 1:
                        hides[x[k + 1]] = y[k + ahead]
    sched = LaneSchedule(
        overlap=overlap, kinds=kinds, chains=chains, compute=tuple(compute), comm=tuple(comm), hides=hides
    )
    validate_lanes(sched)
    return sched


def validate_lanes(sched: LaneSchedule) -> None:
    """Check a lane schedule (see the module docstring).

    Raises:
      ScheduleError: the first rule broken, naming the task.
    """
    name = sched.overlap
    tasks = {t for c in sched.chains for t in c}
    for lane, order in (("compute", sched.compute), ("comm", sched.comm)):
        seen = set()
        for t in order:
            if t.lane != lane:
                raise ScheduleError(f"lanes {name!r}: {t} is a {t.lane} task on the {lane} lane")
            if t in seen:
                raise ScheduleError(f"lanes {name!r}: {t} runs twice on the {lane} lane")
            if t not in tasks:
                raise ScheduleError(f"lanes {name!r}: {t} on the {lane} lane belongs to no stream")
            seen.add(t)
    missing = tasks - set(sched.compute) - set(sched.comm)
    if missing:
        raise ScheduleError(f"lanes {name!r}: {min(missing)} never runs ({len(missing)} tasks missing)")
    for lane, order in (("compute", sched.compute), ("comm", sched.comm)):
        for c in sched.chains:  # each lane keeps its streams' order
            mine = [t for t in order if t.stream == c[0].stream]
            if mine != [t for t in c if t.lane == lane]:
                raise ScheduleError(f"lanes {name!r}: the {lane} lane runs stream {c[0].stream} out of its order")
    times = replay_lanes(sched, dict.fromkeys(tasks, 1.0))  # raises where a lane waits on itself
    for x, c in sched.hides.items():
        if x.lane != "comm" or c.lane != "compute" or x.stream == c.stream:
            raise ScheduleError(f"lanes {name!r}: {x} can only hide behind compute of another stream, not behind {c}")
        (xs, xe), (cs, ce) = times[x], times[c]
        if xs >= ce or cs >= xe:
            raise ScheduleError(f"lanes {name!r}: {x} is to hide behind {c}, but the two never run together")


def replay_lanes(
    sched: LaneSchedule, seconds: Mapping[LaneTask, float], share: float = 0.0
) -> dict[LaneTask, tuple[float, float]]:
    """``{task: (start, end)}`` with each task lasting ``seconds[task]``: every lane runs its tasks in its
    order, each as soon as the lane is free and the task before it in its stream has ended.

    A compute task with an exchange beside it (``hides``) runs slower: the exchange holds ``share`` of
    the device's compute units while it runs (DeepEP's SMs), so a compute task of ``C`` beside an
    exchange of ``X`` lasts ``min(C / (1 - share), C + share X)``.

    Raises:
      ScheduleError: the lanes wait on each other forever.
    """
    beside = {c: seconds[x] for x, c in sched.hides.items()}
    prev = {t: c[i - 1] for c in sched.chains for i, t in enumerate(c) if i}
    lanes = [list(sched.compute), list(sched.comm)]
    at, clock = [0, 0], [0.0, 0.0]
    out: dict[LaneTask, tuple[float, float]] = {}
    while at[0] < len(lanes[0]) or at[1] < len(lanes[1]):
        progressed = False
        for i in (0, 1):
            if at[i] == len(lanes[i]):
                continue
            t = lanes[i][at[i]]
            before = prev.get(t)
            if before is not None and before not in out:
                continue
            start = max(clock[i], out[before][1] if before is not None else 0.0)
            length = seconds[t]
            if t in beside and share > 0:
                length = min(length / (1 - share), length + share * beside[t])
            out[t] = (start, start + length)
            clock[i] = start + length
            at[i] += 1
            progressed = True
        if not progressed:
            stuck = [lanes[i][at[i]] for i in (0, 1) if at[i] < len(lanes[i])]
            raise ScheduleError(f"lanes {sched.overlap!r}: {', '.join(map(str, stuck))} wait on each other forever")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaneTiming:
    """What a replay of a lane schedule says.

    Attributes:
      end_s: when the last task ends.
      exchange_s: every exchange's length, summed.
      exposed_s: time the compute lane waits for an exchange (``end_s`` minus the compute, slowed).
      slowdown_s: what sharing the device with the exchanges adds to the compute.
    """

    end_s: float
    exchange_s: float
    exposed_s: float
    slowdown_s: float


def lane_timing(sched: LaneSchedule, seconds: Mapping[LaneTask, float], share: float) -> LaneTiming:
    """Replay ``sched`` (:func:`replay_lanes`) and sum what the cost model reads."""
    times = replay_lanes(sched, seconds, share)
    end = max(e for _, e in times.values())
    compute = sum(e - s for t, (s, e) in times.items() if t.lane == "compute")
    plain = sum(seconds[t] for t in times if t.lane == "compute")
    return LaneTiming(
        end_s=end,
        exchange_s=sum(seconds[t] for t in times if t.lane == "comm"),
        exposed_s=max(0.0, end - compute),
        slowdown_s=compute - plain,
    )
