"""A predicted training step as a Chrome / Perfetto trace (open it in ui.perfetto.dev).

One process per pipeline stage; per stage a compute track (forward and backward of each micro-batch,
recomputation included) and a communication track (the exposed collectives of each micro-batch, the
data-parallel gradient reduction, the optimizer step). Stages run the schedule's order, GPipe (all
forwards, then all backwards) or 1F1B (warm-up forwards, then one forward and one backward in turn),
and each waits for the data it needs from its neighbours, so bubbles appear where they occur.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyperjax.cost.estimate import Estimate


def stage_order(stage: int, stages: int, microbatches: int, schedule: str) -> list[tuple[str, int]]:
    """The order stage ``stage`` runs its tasks: ``("F", j)`` forward and ``("B", j)`` backward of micro-batch j."""
    if schedule == "gpipe":
        return [("F", j) for j in range(microbatches)] + [("B", j) for j in range(microbatches)]
    warm = min(stages - stage - 1, microbatches)
    order = [("F", j) for j in range(warm)]
    f, b = warm, 0
    while b < microbatches:
        if f < microbatches:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def simulate(est: Estimate) -> list[dict[str, Any]]:
    """Trace events (microseconds) of one predicted step."""
    d = est.details
    stages, m = d["axes"]["pipeline"], d["microbatches"]
    fwd, bwd, comm = d["stage_forward_s"], d["stage_backward_s"], d["stage_comm_s"]
    schedule = "gpipe" if d["schedule"] == "gpipe" else "1f1b"
    # interleaving splits each stage into v chunks: the bubble shrinks by v (drawn as a shorter warm-up)
    scale = 1.0 / d["virtual_stages"] if d["virtual_stages"] > 1 else 1.0
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    orders = [stage_order(i, stages, m, schedule) for i in range(stages)]
    position = [0] * stages
    events: list[dict[str, Any]] = []
    while any(position[i] < len(orders[i]) for i in range(stages)):
        progressed = False
        for i in range(stages):
            if position[i] >= len(orders[i]):
                continue
            kind, j = orders[i][position[i]]
            # the neighbour's output is ready one chunk (1/v of its work) after it started
            upstream = [("F", i - 1, j, fwd)] if kind == "F" and i > 0 else []
            if kind == "B" and i < stages - 1:
                upstream = [("B", i + 1, j, bwd)]
            need = [(k, st, mb) for k, st, mb, _ in upstream] + ([("F", i, j)] if kind == "B" else [])
            if any(n not in done for n in need):
                continue
            ready = max(
                [clock[i], *(done[(k, st, mb)] - (1 - scale) * (work + comm / 2) for k, st, mb, work in upstream)]
            )
            if kind == "B":
                ready = max(ready, done[("F", i, j)])
            length = (fwd if kind == "F" else bwd) + comm / 2
            events.append(
                _event(
                    "forward" if kind == "F" else "backward",
                    ready,
                    fwd if kind == "F" else bwd,
                    i,
                    "compute",
                    {"microbatch": j},
                )
            )
            events.append(
                _event(
                    "exposed collectives",
                    ready + (fwd if kind == "F" else bwd),
                    comm / 2,
                    i,
                    "communication",
                    {"microbatch": j},
                )
            )
            done[(kind, i, j)] = clock[i] = ready + length
            position[i] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # a bug in stage_order, never user input
    end = max(clock)
    for i in range(stages):
        t = end
        if d["dp_exposed_s"]:
            events.append(
                _event("data-parallel gradient reduction (exposed)", t, d["dp_exposed_s"], i, "communication", {})
            )
            t += d["dp_exposed_s"]
        events.append(_event("optimizer step", t, d["optimizer_s"], i, "compute", {}))
    return events


def _event(name: str, start_s: float, dur_s: float, stage: int, track: str, args: dict) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": start_s * 1e6,
        "dur": dur_s * 1e6,
        "pid": stage,
        "tid": 0 if track == "compute" else 1,
        "args": args,
    }


def write_trace(est: Estimate, path: str | Path, *, title: str) -> None:
    """Write the trace of ``est`` to ``path`` (JSON in the Chrome trace event format), atomically."""
    events = simulate(est)
    meta = []
    for i in range(est.details["axes"]["pipeline"]):
        meta.append({"name": "process_name", "ph": "M", "pid": i, "args": {"name": f"stage {i}"}})
        meta.append({"name": "thread_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": "compute"}})
        meta.append({"name": "thread_name", "ph": "M", "pid": i, "tid": 1, "args": {"name": "communication"}})
    data = {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"title": title, "predicted_step_time_s": est.step_time_s},
    }
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(target)
