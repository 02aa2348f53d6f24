"""The placement pass's solvers: the fastest placement whose peak device memory fits a budget.

:func:`solve_exact` finds the optimum of the placement problem (:mod:`hyperjax.offload.problem`) as an
integer program (scipy's HiGHS); :func:`greedy` is the baseline that evicts groups by size times reuse
distance until the step fits; :func:`brute_force` enumerates small instances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from scipy import sparse

from hyperjax.offload.placement import Placement, parse_group
from hyperjax.offload.problem import GIB, Priced, Problem, Tally, evaluate

TIME_UNITS = 1e3
"""The integer program's times: this many units to the step's time with everything on the device."""
BYTE_UNITS = 2.0**20
"""The integer program's bytes: MiB (in bytes, HiGHS failed to solve some problems)."""


def _program(problem: Problem) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The integer program: variables x (one per group option), y (buffers), e (windows); row blocks
    ``one`` (one option per group), ``buffer`` (y_b >= x), ``memory`` (per phase) and ``window``
    (e_w >= load - capacity, per direction), each as ``(A, lower, upper)``.

    Times are in thousandths of the step's time on the device (:data:`TIME_UNITS`): in seconds, HiGHS's
    absolute tolerances (1e-6 on the objective, 1e-7 on a row) exceed what separates two placements of a
    millisecond step, and it returned one slower than the greedy baseline's while proving it optimal (in
    millionths, its solves failed on some problems)."""
    scale = TIME_UNITS / problem.base_step_s if problem.base_step_s > 0 else 1.0
    xs = [(g, o) for g, options in problem.groups.items() for o in options]
    bufs = list(problem.buffers)
    nx, ny, nw = len(xs), len(bufs), len(problem.windows)
    n = nx + ny + nw
    one = sparse.lil_matrix((len(problem.groups), n))
    buffer_rows: list[tuple[int, int]] = []
    memory = sparse.lil_matrix((2, n))
    window = sparse.lil_matrix((2 * nw, n))
    for r in range(2 * nw):
        window[r, nx + ny + r // 2] = 1.0
    cost = np.zeros(n)
    cost[nx + ny :] = 1.0
    index = {g: i for i, g in enumerate(problem.groups)}
    for j, (g, o) in enumerate(xs):
        c = problem.groups[g][o]
        one[index[g], j] = 1.0
        memory[0, j], memory[1, j] = (b / BYTE_UNITS for b in c.memory)
        cost[j] = c.seconds * scale
        for b in c.buffers:
            buffer_rows.append((nx + bufs.index(b), j))
        for w, direction, sec in c.loads:
            window[2 * w + direction, j] -= sec * scale
        for w, sec in c.capacity:
            for r in (2 * w, 2 * w + 1):
                window[r, j] += sec * scale
    for b, (ph, nbytes) in problem.buffers.items():
        memory[ph, nx + bufs.index(b)] = nbytes / BYTE_UNITS
    host = sparse.lil_matrix((1, n))
    for j, (g, o) in enumerate(xs):
        host[0, j] = problem.groups[g][o].host_bytes / BYTE_UNITS
    buffer = sparse.lil_matrix((len(buffer_rows), n))
    for r, (y, x) in enumerate(buffer_rows):
        buffer[r, y], buffer[r, x] = 1.0, -1.0
    caps = np.repeat([c * scale for _, c in problem.windows], 2)
    budget = (problem.budget_bytes / problem.allocator - np.array(problem.fixed)) / BYTE_UNITS
    blocks = {
        "one": (one.tocsr(), np.ones(one.shape[0]), np.ones(one.shape[0])),
        "buffer": (buffer.tocsr(), np.zeros(len(buffer_rows)), np.full(len(buffer_rows), np.inf)),
        "memory": (memory.tocsr(), np.full(2, -np.inf), budget),
        "window": (window.tocsr(), -caps, np.full(2 * nw, np.inf)),
        "host": (host.tocsr(), np.full(1, -np.inf), np.full(1, problem.host_bytes / BYTE_UNITS)),
    }
    if problem.ordered:  # interchangeable groups leave the device in a fixed order (no symmetric solutions)
        where = {x: j for j, x in enumerate(xs)}
        order = sparse.lil_matrix((len(problem.ordered), n))
        for r, (a, b) in enumerate(problem.ordered):
            order[r, where[(a, "host")]], order[r, where[(b, "host")]] = 1.0, -1.0
        blocks["order"] = (order.tocsr(), np.zeros(len(problem.ordered)), np.full(len(problem.ordered), np.inf))
    return xs, {"blocks": blocks, "c": cost, "nx": nx, "ny": ny, "nw": nw}


def _milp(cost, blocks, integrality, upper, time_limit_s: float = 60.0, gap: float = 1e-9):
    from scipy.optimize import Bounds, LinearConstraint, milp

    a = sparse.vstack([blk[0] for blk in blocks], format="csr")
    lo = np.concatenate([blk[1] for blk in blocks])
    hi = np.concatenate([blk[2] for blk in blocks])
    solve = lambda **more: milp(
        c=cost,
        constraints=LinearConstraint(a, lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(len(cost)), upper),
        options={"time_limit": time_limit_s, "mip_rel_gap": gap, **more},
    )
    with _native_stdout_silenced():  # HiGHS can print solver notes to the process's stdout (--json)
        res = solve()
        # HiGHS's presolve fails now and then on a problem it solves without it ("solve error", status 4),
        # which would read as "nothing fits"
        return solve(presolve=False) if res.status == 4 else res


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_exact(
    problem: Problem,
    *,
    time_limit_s: float = 60.0,
    gap: float = 1e-9,
    fallback: Callable[[Problem], Priced | None] | None = None,
) -> Priced | None:
    """The fastest placement that fits, found by HiGHS (proved within ``gap`` of the optimum, relative);
    ``None`` when none fits. Everything on the device, when it fits, is the fastest (a move only adds time),
    so it is taken without a search. When HiGHS reaches ``time_limit_s`` first, the best placement it found
    comes back with ``time_limited`` and the gap it proved (``proved_gap``); having found none by then,
    ``fallback``'s (default: :func:`greedy`), else the smallest-peak placement where that fits, its gap
    unproved."""
    whole = evaluate(problem, Placement(()))
    if whole.fits:
        return dataclasses.replace(whole, proved_gap=0.0)
    xs, p = _program(problem)
    nx, ny, nw = p["nx"], p["ny"], p["nw"]
    res = _milp(
        p["c"],
        list(p["blocks"].values()),
        np.r_[np.ones(nx + ny), np.zeros(nw)],
        np.r_[np.ones(nx + ny), np.full(nw, np.inf)],
        time_limit_s,
        gap,
    )
    limited = res.status == 1  # HiGHS's time (or iteration) limit
    if res.x is None:
        if not limited:
            return None
        found = (fallback or greedy)(problem)
        if found is None and (leanest := minimum_memory(problem)).fits:
            found = leanest
        return None if found is None else dataclasses.replace(found, proved_gap=None, time_limited=True)
    priced = evaluate(problem, Placement.of({g: o for j, (g, o) in enumerate(xs) if res.x[j] > 0.5}))
    proved = getattr(res, "mip_gap", None)
    return dataclasses.replace(
        priced, proved_gap=None if proved is None or not math.isfinite(proved) else float(proved), time_limited=limited
    )


def minimum_memory(problem: Problem) -> Priced:
    """The placement with the smallest peak device memory (its peak is the smallest budget that fits)."""
    xs, p = _program(problem)
    nx, ny = p["nx"], p["ny"]
    blocks = p["blocks"]
    keep = nx + ny  # x and y, then one variable z >= each phase's placed bytes
    widen = lambda a, col: sparse.hstack([a[:, :keep], np.full((a.shape[0], 1), col)], format="csr")
    mem = blocks["memory"][0]
    rows = [
        (widen(blocks["one"][0], 0.0), *blocks["one"][1:]),
        (widen(blocks["buffer"][0], 0.0), *blocks["buffer"][1:]),
        (widen(mem, -1.0), np.full(2, -np.inf), -np.array(problem.fixed) / BYTE_UNITS),
        (widen(blocks["host"][0], 0.0), *blocks["host"][1:]),
    ]
    res = _milp(np.r_[np.zeros(keep), 1.0], rows, np.r_[np.ones(keep), 0.0], np.r_[np.ones(keep), np.inf])
    if res.x is None:  # the host cannot take enough either: everything stays on the device
        return evaluate(problem, Placement(()))
    return evaluate(problem, Placement.of({g: o for j, (g, o) in enumerate(xs) if res.x[j] > 0.5}))


def greedy(
    problem: Problem, start: Placement | None = None, *, distance: Callable[[str], int] | None = None
) -> Priced | None:
    """The baseline: from ``start`` (everything on the device), evict groups in order of size times reuse
    distance (to the host, or an activation to recomputation when that prices lower) until the step fits,
    then bring back, last evicted first, every group that still fits on the device. Where evicting everything
    so does not fit (the host's staging buffers hold more than recomputing would), each group goes instead
    where it holds the least device memory. ``None`` when that does not fit either. ``distance``: a group's
    reuse distance (default: a training step's, in layers)."""
    choices = any(len(options) > 2 for options in problem.groups.values())  # device and two others somewhere
    for lean in (False, True) if choices else (False,):
        found = _greedy(problem, start, distance, lean=lean)
        if found is not None:
            return found
    return None


def _greedy(
    problem: Problem, start: Placement | None, distance: Callable[[str], int] | None, *, lean: bool
) -> Priced | None:
    """One pass of :func:`greedy`: each evicted group to its fastest option, or (``lean``) its leanest."""
    n = problem.layers
    current = {g: (start[g] if start is not None else "device") for g in problem.groups}
    tally = Tally(problem)
    for group, option in current.items():
        tally.add(group, option)

    def trial(group: str, option: str) -> tuple[float, float, bool]:
        tally.add(group, current[group], -1)
        tally.add(group, option)
        step, peak, fits, *_ = tally.terms()
        tally.add(group, option, -1)
        tally.add(group, current[group])
        return step, peak, fits

    def move(group: str, option: str) -> None:
        tally.add(group, current[group], -1)
        tally.add(group, option)
        current[group] = option

    def training_distance(group: str) -> int:  # layers of compute between the group's two uses in a step
        i, kind = parse_group(group)
        if kind == "optimizer":
            return 2 * n + 1
        if kind == "gradients":
            return i + 1
        return 2 * (n - i)

    distance = distance or training_distance
    order = sorted(problem.groups, key=lambda g: -problem.groups[g]["device"].memory[0] * distance(g))
    evicted = []
    fits = tally.terms()[2]
    for group in order:
        if fits:
            break
        if current[group] != "device":
            continue
        priced = {o: trial(group, o)[:2] for o in problem.groups[group] if o != "device"}  # (step, peak)
        option = min(priced, key=lambda o: priced[o][::-1] if lean else priced[o])
        move(group, option)
        evicted.append(group)
        fits = tally.terms()[2]
    if not fits:
        return None
    for group in reversed(evicted):
        step, _, still = trial(group, "device")
        if still and step <= tally.terms()[0]:
            move(group, "device")
    return evaluate(problem, Placement.of(current))


def brute_force(problem: Problem) -> Priced | None:
    """Every placement of a small problem; the fastest that fits (ties: the smaller peak)."""
    groups = list(problem.groups)
    best = None
    for combo in itertools.product(*(list(problem.groups[g]) for g in groups)):
        priced = evaluate(problem, Placement.of(dict(zip(groups, combo, strict=True))))
        if priced.fits and (best is None or priced.step_time_s < best.step_time_s - 1e-15):
            best = priced
    return best


def describe_infeasible(problem: Problem) -> tuple[str, float]:
    """What makes every placement too big: the largest term of the smallest peak, and that peak (bytes)."""
    smallest = minimum_memory(problem)
    placed = smallest.placement
    terms = dict(problem.fixed_terms)
    for b in {b for g in problem.groups for b in problem.groups[g][placed[g]].buffers}:
        terms[f"device staging buffer for host {b}"] = problem.buffers[b][1]
    return max(terms, key=terms.__getitem__), smallest.peak_bytes


def ceil_gib(nbytes: float) -> float:
    """Bytes in GiB, rounded up to three significant figures."""
    x = nbytes / GIB
    if x <= 0:
        return 0.0
    step = 10 ** (math.floor(math.log10(x)) - 2)
    return round(math.ceil(x / step) * step, 12)
