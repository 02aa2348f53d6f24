"""Where an emulated step's time goes: every collective of the compiled step, timed by XLA's profiler.

On the emulated machine a step's time is mostly its collectives, and which ones depends on how the mesh
lies over the emulating processes: a collective inside one process costs a fraction of one whose groups
cross processes (gloo over loopback TCP, one rank per device). :func:`profile_ops` runs a step under
JAX's profiler and reads how long every XLA operation ran on this process's devices;
:func:`collective_times` joins those times with the compiled program's collectives (kind, devices per
group, processes a group spans, bytes) into one row per kind of collective.

A collective's time on one device includes its wait for the slowest member of its group, so the rows
say where the step waits, which is what makes it slow.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from hyperjax.config import Run
from hyperjax.cost.hlo import Collective
from hyperjax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveTime:
    """The collectives of one kind, group size and process span in a step, and their time.

    Attributes:
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or ``collective-permute``.
      participants: devices per group.
      processes: processes one group spans (the most over its groups).
      count: collectives of this row in the step.
      arrays: the arrays they move (a collective XLA combined from several moves several; XLA's CPU
        backend runs one collective per array).
      bytes: their result bytes on one device, together.
      seconds: their time on one device per step (the mean over this process's devices).
    """

    kind: str
    participants: int
    processes: int
    count: int
    arrays: int
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return dataclasses.asdict(self)


def check_profiled(run: Run) -> None:
    """Refuse to profile a run whose step is not one SPMD program.

    Raises:
      ConfigError: a pipeline or MPMD run, naming the flag, its stages and the fix.
    """
    if run.pipelined:
        raise ConfigError(
            f"--profile: collectives are timed in one SPMD program, not in the {len(run.stages)} pipeline or MPMD "
            "stages of this run (parallel.pipeline or mpmd.submeshes); drop --profile, or set parallel.pipeline=1"
        )
    if run.staged:
        raise ConfigError(
            "--profile: collectives are timed in one SPMD program, not in the paired forward and backward "
            "programs of parallel.overlap=fb-pair; drop --profile, or set parallel.overlap: none"
        )


def profile_ops(fn: Callable[[], Any]) -> tuple[Any, float, dict[str, float]]:
    """Run ``fn`` (which must wait for its result) under JAX's profiler.

    Returns:
      ``fn``'s result, the seconds ``fn`` took (starting and stopping the profiler and reading its trace
      left out), and the seconds each XLA operation (by instruction name) ran, summed over this process's
      devices and divided by their number.
    """
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            start = time.perf_counter()
            out = fn()
            elapsed = time.perf_counter() - start
        traces = sorted(Path(folder).rglob("*.trace.json.gz"))
        if not traces:
            raise RuntimeError(f"JAX's profiler wrote no trace under {folder}")
        with gzip.open(traces[-1]) as f:
            events = json.load(f)["traceEvents"]
    total: collections.Counter = collections.Counter()
    for event in events:
        if event.get("ph") == "X":
            total[event["name"]] += event.get("dur", 0.0) * 1e-6
    devices = len(jax.local_devices())
    return out, elapsed, {name: seconds / devices for name, seconds in total.items()}


def collective_times(
    collectives: Sequence[Collective], seconds: dict[str, float], processes: Sequence[int]
) -> list[CollectiveTime]:
    """One row per (kind, devices per group, processes spanned) of a compiled step's collectives.

    Args:
      collectives: the compiled step's collectives (:func:`hyperjax.cost.hlo.read_compiled`).
      seconds: per instruction name, its time on one device (:func:`profile_ops`).
      processes: the process of each device of the program, in its device assignment's order.

    Returns:
      The rows, slowest first (collectives over groups of one device left out).
    """
    rows: dict[tuple[str, int, int], list] = {}
    for c in collectives:
        if c.group_size < 2:
            continue
        span = max(len({processes[d] for d in group}) for group in c.groups)
        row = rows.setdefault((c.kind, c.group_size, span), [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += c.arrays
        row[2] += c.result_bytes
        row[3] += seconds.get(c.name, 0.0)
    out = [
        CollectiveTime(
            kind=k, participants=n, processes=p, count=int(v[0]), arrays=int(v[1]), bytes=int(v[2]), seconds=v[3]
        )
        for (k, n, p), v in rows.items()
    ]
    return sorted(out, key=lambda r: -r.seconds)
