"""The placement pass: the fastest placement whose peak device memory fits a budget.

One model of a step serves every solver. A placement adds to the step without offload:

- recomputation: each recomputed activation costs the forward ops that produce it, once per
  micro-batch, in the backward of its layer;
- transfers over the preset's host link (one direction at a time, full duplex): a host-placed layer's
  parameters are fetched before its forward and again before its backward, host activations are
  written after the forward and fetched before the backward, host gradients are written (and, when
  micro-batches accumulate, read back) during the backward, host optimizer state is streamed through
  the device in the optimizer step. With prefetch depth ``k`` a transfer is spread over the compute of
  the ``k`` layers before the use ("windows"); in each window the transfer time beyond the window's
  compute (and recomputation) is exposed. Windows aggregate a step's micro-batches;
- host memory: what the placement puts on the host must fit the preset's host memory per device;
- memory, at two peaks: the start of the backward (weights, gradients, optimizer state, activations of
  the micro-batches in flight) and the optimizer step (no activations); plus staging buffers on the
  device for what streams from the host: ``k + 1`` layers of parameters or activations, two of
  gradients or optimizer state.

:func:`solve_exact` finds the optimum of this model as an integer program (scipy's HiGHS);
:func:`greedy` is the baseline that evicts groups by size times reuse distance until the step fits;
:func:`brute_force` enumerates small instances. :func:`evaluate` prices any placement.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from scipy import sparse

from hyperjax.offload.placement import ACTIVATIONS, Placement, options_of, parse_group

GIB = 2**30
FRAGMENTATION = 1.05  # as the estimate: allocator fragmentation and workspace
PHASES = ("backward", "optimizer")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One option of one group, as linear terms.

    Attributes:
      memory: device bytes per phase.
      seconds: time added to the step (recomputation).
      loads: ``(window, direction, seconds)`` host-link time put on a window (0 in, 1 out).
      capacity: ``(window, seconds)`` compute added to a window (recomputation runs there).
      buffers: the staging buffers this option needs on the device.
      host_bytes: host memory it takes.
    """

    memory: tuple[float, float]
    seconds: float = 0.0
    loads: tuple[tuple[int, int, float], ...] = ()
    capacity: tuple[tuple[int, float], ...] = ()
    buffers: tuple[str, ...] = ()
    host_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class Problem:
    """A placement problem: groups with their options, windows, buffers and the fixed memory.

    Attributes:
      groups: ``{group: {option: Choice}}`` in layer order.
      windows: ``(name, compute seconds)`` over which host transfers overlap.
      buffers: ``{buffer: (phase index, bytes)}``.
      fixed: device bytes per phase that no placement moves (embeddings, the head, block inputs, logits).
      fixed_terms: those bytes by what they are, for error messages.
      base_step_s: the step with everything on the device and nothing recomputed.
      budget_bytes: the device-memory budget.
      host_bytes: host memory per device (the preset's).
      stretch: time a pipeline stage adds stretches its bubble by this factor (1 without a pipeline).
    """

    groups: dict[str, dict[str, Choice]]
    windows: tuple[tuple[str, float], ...]
    buffers: dict[str, tuple[int, float]]
    fixed: tuple[float, float]
    fixed_terms: dict[str, float]
    base_step_s: float
    budget_bytes: float
    host_bytes: float = float("inf")
    stretch: float = 1.0
    layers: int = 0


@dataclasses.dataclass(frozen=True)
class Priced:
    """A placement's predicted step."""

    placement: Placement
    step_time_s: float
    peak_bytes: float
    fits: bool
    recompute_s: float
    transfer_s: float
    exposed_transfer_s: float
    host_bytes: float
    phase_bytes: tuple[float, float]
    moved_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    staging_bytes: float = 0.0


def build_problem(est: Any, *, hardware: Any, budget_bytes: float, prefetch: int) -> Problem:
    """The placement problem of one pipeline stage (or the whole model).

    ``est`` is the :class:`hyperjax.cost.Estimate` of the run with ``train.recompute: none``;
    ``hardware`` gives the host link.
    """
    d, layer = est.details, est.details["layer"]
    n, m, k = d["layers_per_stage"], d["microbatches"], prefetch
    link = hardware.host.bandwidth
    lat = hardware.host.latency

    def xfer(nbytes: float) -> float:
        return nbytes / link + lat

    windows: list[tuple[str, float]] = [("before the forward", 0.0)]
    windows += [(f"forward of layer {i}", m * layer["forward_s"]) for i in range(n)]
    windows += [("loss and head", m * d["logits_s"])]
    windows += [(f"backward of layer {i}", m * layer["backward_s"]) for i in range(n)]
    windows += [("optimizer step", d["optimizer_s"])]
    start, turn, opt = 0, n + 1, 2 * n + 2
    fwd = lambda i: start if i < 0 else (turn if i >= n else 1 + i)
    bwd = lambda i: turn if i >= n else (opt if i < 0 else n + 2 + i)

    def spread(seconds: float, direction: int, where: Sequence[int]) -> tuple[tuple[int, int, float], ...]:
        if not where:  # no prefetch: fetched when needed, all of it exposed
            where = [start]
        return tuple((w, direction, seconds / len(where)) for w in where)

    acts_in_flight = d["in_flight"]
    groups: dict[str, dict[str, Choice]] = {}
    for i in range(n):
        before_f = [fwd(i - j) for j in range(1, k + 1)]  # the layers computed before layer i's forward
        after_f = [fwd(i + j) for j in range(1, k + 1)]
        before_b = [bwd(i + j) for j in range(1, k + 1)]  # backward runs from the last layer down
        after_b = [bwd(i - j) for j in range(1, k + 1)]
        p, g, o = layer["params_bytes"], layer["gradients_bytes"], layer["optimizer_bytes"]
        tp = xfer(layer["param_transfer_bytes"])
        groups[f"layers.{i}.params"] = {
            "device": Choice(memory=(p, p)),
            "host": Choice(
                memory=(0.0, 0.0),
                loads=spread(m * tp, 0, before_f)
                + spread(m * tp, 0, before_b)
                + ((opt, 0, xfer(p)), (opt, 1, xfer(p))),
                buffers=("params", "optimizer stream"),
                host_bytes=p,
            ),
        }
        groups[f"layers.{i}.gradients"] = {
            "device": Choice(memory=(g, g)),
            "host": Choice(
                memory=(0.0, 0.0),
                loads=spread(m * xfer(g), 1, after_b) + spread((m - 1) * xfer(g), 0, before_b) + ((opt, 0, xfer(g)),),
                buffers=("gradients", "optimizer stream"),
                host_bytes=g,
            ),
        }
        groups[f"layers.{i}.optimizer"] = {
            "device": Choice(memory=(o, o)),
            "host": Choice(
                memory=(0.0, 0.0),
                loads=((opt, 0, xfer(o)), (opt, 1, xfer(o))),
                buffers=("optimizer stream",),
                host_bytes=o,
            ),
        }
        for a in ACTIVATIONS:
            nbytes, rec = layer["activation_bytes"][a], layer["recompute_s"][a]
            kept = acts_in_flight * nbytes
            t = m * xfer(nbytes)
            groups[f"layers.{i}.act.{a}"] = {
                "device": Choice(memory=(kept, 0.0)),
                "host": Choice(
                    memory=(0.0, 0.0),
                    loads=spread(t, 1, after_f) + spread(t, 0, before_b),
                    buffers=(f"activations {a}",),
                    host_bytes=kept,
                ),
                "recompute": Choice(memory=(0.0, 0.0), seconds=m * rec, capacity=((bwd(i), m * rec),)),
            }
    acts_layer = sum(layer["activation_bytes"][a] for a in ACTIVATIONS)
    lp, lg, lo = layer["params_bytes"], layer["gradients_bytes"], layer["optimizer_bytes"]
    buffers = {
        "params": (0, (k + 1) * layer["param_transfer_bytes"]),
        "gradients": (0, 2 * lg),
        **{f"activations {a}": (0, (k + 1) * layer["activation_bytes"][a]) for a in ACTIVATIONS},
        "optimizer stream": (1, 2 * (lp + lg + lo)),
    }
    mem = {key: GIB * value for key, value in est.memory_per_device_gib.items()}
    block_in = n * acts_in_flight * layer["activation_bytes"]["block_in"]
    outside = {  # what the layers' groups leave of the estimate's memory terms
        "embeddings and head (parameters, gradients, optimizer state)": mem["params"]
        + mem["gradients"]
        + mem["optimizer"]
        - n * (lp + lg + lo),
        f"block inputs (layers.*.act.block_in, {acts_in_flight} micro-batches in flight)": block_in,
        "logits and loss": mem["activations"]
        - n * acts_in_flight * (acts_layer + layer["activation_bytes"]["block_in"]),
    }
    fixed_backward = sum(outside.values())
    fixed_optimizer = outside["embeddings and head (parameters, gradients, optimizer state)"]
    return Problem(
        groups=groups,
        windows=tuple(windows),
        buffers=buffers,
        fixed=(fixed_backward, fixed_optimizer),
        fixed_terms=outside,
        base_step_s=est.step_time_s,
        budget_bytes=budget_bytes,
        host_bytes=hardware.host.bytes_per_device,
        stretch=1.0 + d["bubble_ratio"],
        layers=n,
    )


class _Tally:
    """Running sums of a placement's terms, updated one group option at a time."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.phase = np.array(problem.fixed, dtype=float)
        self.loads = np.zeros((len(problem.windows), 2))
        self.capacity = np.array([c for _, c in problem.windows], dtype=float)
        self.seconds = self.transfer = self.host = 0.0
        self.buffers: collections.Counter[str] = collections.Counter()
        self.moved = {"params": 0.0, "optimizer": 0.0, "gradients": 0.0, "activations": 0.0}

    def add(self, group: str, option: str, sign: int = 1) -> None:
        options = self.problem.groups[group]
        c = options[option]
        self.phase += sign * np.asarray(c.memory)
        self.seconds += sign * c.seconds
        self.host += sign * c.host_bytes
        for w, direction, sec in c.loads:
            self.loads[w, direction] += sign * sec
            self.transfer += sign * sec
        for w, sec in c.capacity:
            self.capacity[w] += sign * sec
        for b in c.buffers:
            self.buffers[b] += sign
        if option != "device":  # what leaves the device, by the estimate's memory terms
            kind = parse_group(group)[1]
            self.moved["activations" if kind.startswith("act.") else kind] += sign * options["device"].memory[0]

    def terms(self) -> tuple[float, float, bool, float, tuple[float, float], float]:
        """Step time, peak, fits, exposed transfer time, per-phase peaks, staging bytes."""
        phase, staging = self.phase.copy(), 0.0
        for b, count in self.buffers.items():
            if count > 0:
                ph, nbytes = self.problem.buffers[b]
                phase[ph] += nbytes
                staging += nbytes
        exposed = float(np.maximum(self.loads.max(axis=1) - self.capacity, 0.0).sum())
        peak = FRAGMENTATION * float(phase.max())
        step = self.problem.base_step_s + self.problem.stretch * (self.seconds + exposed)
        fits = peak <= self.problem.budget_bytes and self.host <= self.problem.host_bytes
        return step, peak, fits, exposed, (FRAGMENTATION * phase[0], FRAGMENTATION * phase[1]), staging


def evaluate(problem: Problem, placement: Placement) -> Priced:
    """The predicted step of ``placement`` under ``problem``'s model."""
    tally = _Tally(problem)
    for group in problem.groups:
        tally.add(group, placement[group])
    step, peak, fits, exposed, phases, staging = tally.terms()
    return Priced(
        placement=placement,
        step_time_s=step,
        peak_bytes=peak,
        fits=fits,
        recompute_s=tally.seconds,
        transfer_s=tally.transfer,
        exposed_transfer_s=exposed,
        host_bytes=tally.host,
        phase_bytes=phases,
        moved_bytes=tally.moved,
        staging_bytes=staging,
    )


def _program(problem: Problem) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The integer program: variables x (one per group option), y (buffers), e (windows); row blocks
    ``one`` (one option per group), ``buffer`` (y_b >= x), ``memory`` (per phase) and ``window``
    (e_w >= load - capacity, per direction), each as ``(A, lower, upper)``."""
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
        memory[0, j], memory[1, j] = c.memory
        cost[j] = c.seconds
        for b in c.buffers:
            buffer_rows.append((nx + bufs.index(b), j))
        for w, direction, sec in c.loads:
            window[2 * w + direction, j] -= sec
        for w, sec in c.capacity:
            for r in (2 * w, 2 * w + 1):
                window[r, j] += sec
    for b, (ph, nbytes) in problem.buffers.items():
        memory[ph, nx + bufs.index(b)] = nbytes
    host = sparse.lil_matrix((1, n))
    for j, (g, o) in enumerate(xs):
        host[0, j] = problem.groups[g][o].host_bytes
    buffer = sparse.lil_matrix((len(buffer_rows), n))
    for r, (y, x) in enumerate(buffer_rows):
        buffer[r, y], buffer[r, x] = 1.0, -1.0
    caps = np.repeat([c for _, c in problem.windows], 2)
    budget = problem.budget_bytes / FRAGMENTATION - np.array(problem.fixed)
    blocks = {
        "one": (one.tocsr(), np.ones(one.shape[0]), np.ones(one.shape[0])),
        "buffer": (buffer.tocsr(), np.zeros(len(buffer_rows)), np.full(len(buffer_rows), np.inf)),
        "memory": (memory.tocsr(), np.full(2, -np.inf), budget),
        "window": (window.tocsr(), -caps, np.full(2 * nw, np.inf)),
        "host": (host.tocsr(), np.full(1, -np.inf), np.full(1, problem.host_bytes)),
    }
    return xs, {"blocks": blocks, "c": cost, "nx": nx, "ny": ny, "nw": nw}


def _milp(cost, blocks, integrality, upper, time_limit_s: float = 60.0):
    from scipy.optimize import Bounds, LinearConstraint, milp

    a = sparse.vstack([blk[0] for blk in blocks], format="csr")
    lo = np.concatenate([blk[1] for blk in blocks])
    hi = np.concatenate([blk[2] for blk in blocks])
    with _native_stdout_silenced():  # HiGHS can print solver notes to the process's stdout (--json)
        return milp(
            c=cost,
            constraints=LinearConstraint(a, lo, hi),
            integrality=integrality,
            bounds=Bounds(np.zeros(len(cost)), upper),
            options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
        )


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


def solve_exact(problem: Problem, *, time_limit_s: float = 60.0) -> Priced | None:
    """The fastest placement that fits, found by HiGHS; ``None`` when none fits."""
    xs, p = _program(problem)
    nx, ny, nw = p["nx"], p["ny"], p["nw"]
    res = _milp(
        p["c"],
        list(p["blocks"].values()),
        np.r_[np.ones(nx + ny), np.zeros(nw)],
        np.r_[np.ones(nx + ny), np.full(nw, np.inf)],
        time_limit_s,
    )
    if res.x is None:
        return None
    return evaluate(problem, Placement.of({g: o for j, (g, o) in enumerate(xs) if res.x[j] > 0.5}))


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
        (widen(mem, -1.0), np.full(2, -np.inf), -np.array(problem.fixed)),
        (widen(blocks["host"][0], 0.0), *blocks["host"][1:]),
    ]
    res = _milp(np.r_[np.zeros(keep), 1.0], rows, np.r_[np.ones(keep), 0.0], np.r_[np.ones(keep), np.inf])
    if res.x is None:  # the host cannot take enough either: everything stays on the device
        return evaluate(problem, Placement(()))
    return evaluate(problem, Placement.of({g: o for j, (g, o) in enumerate(xs) if res.x[j] > 0.5}))


def greedy(problem: Problem, start: Placement | None = None) -> Priced | None:
    """The baseline: from ``start`` (everything on the device), evict groups in order of size times reuse
    distance (to the host, or an activation to recomputation when that prices lower) until the step fits,
    then bring back, last evicted first, every group that still fits on the device. ``None`` when evicting
    everything does not fit."""
    n = problem.layers
    current = {g: (start[g] if start is not None else "device") for g in problem.groups}
    tally = _Tally(problem)
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

    def distance(group: str) -> int:  # layers of compute between the group's two uses in a step
        i, kind = parse_group(group)
        if kind == "optimizer":
            return 2 * n + 1
        if kind == "gradients":
            return i + 1
        return 2 * (n - i)

    order = sorted(problem.groups, key=lambda g: -problem.groups[g]["device"].memory[0] * distance(g))
    evicted = []
    fits = tally.terms()[2]
    for group in order:
        if fits:
            break
        if current[group] != "device":
            continue
        option = min(options_of(group)[1:], key=lambda o: trial(group, o)[:2])
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
