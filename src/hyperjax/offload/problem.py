"""The placement problem: every tensor group's options as linear terms, and the price of any placement.

A placement adds to the step without offload:

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

:func:`build_problem` states it for the stage of an :class:`hyperjax.cost.Estimate` that holds the most
memory; :func:`evaluate` prices any placement.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from hyperjax.cost import Estimate, LayerCost, StageCost, chunk_starts, state_bytes
from hyperjax.errors import ConfigError
from hyperjax.offload.placement import BLOCK_INPUT, PLACED_ACTIVATIONS, Placement, parse_group
from hyperjax.topology import Hardware

GIB = 2**30
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
      fixed: device bytes per phase that no placement moves (embeddings, the head, logits).
      fixed_terms: those bytes by what they are, for error messages.
      base_step_s: the step with everything on the device and nothing recomputed.
      budget_bytes: the device-memory budget.
      host_bytes: host memory per device (the preset's).
      stretch: time a pipeline stage adds stretches its bubble by this factor (1 without a pipeline).
      ordered: ``(a, b)`` pairs of interchangeable groups: ``b`` goes to the host only if ``a`` does (the
        exact solver's symmetry breaking; it excludes no distinct placement).
      allocator: a peak's bytes per byte of live tensors, as the estimate (``device.allocator_factor``).
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
    ordered: tuple[tuple[str, str], ...] = ()
    allocator: float = 1.05


@dataclasses.dataclass(frozen=True)
class Priced:
    """A placement's predicted step. From the exact pass, ``proved_gap`` is how far (relative) its step was
    proved from the fastest (``None``: not proved), and ``time_limited`` says it stopped at its time limit."""

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
    proved_gap: float | None = None
    time_limited: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The placement and its price as ``--json`` writes them (a pipeline's every stage alike)."""
        return {
            "placement": self.placement.to_dict(),
            "host_gib_per_device": self.host_bytes / GIB,
            "transfer_s": self.transfer_s,
            "exposed_transfer_s": self.exposed_transfer_s,
            "recompute_s": self.recompute_s,
            "step_time_s": self.step_time_s,
            "peak_gib": self.peak_bytes / GIB,
            "fits": self.fits,
        }

    def price(self) -> str:
        """What the placement costs, in words: host memory, transfers (and what of them is exposed), recomputation."""
        return (
            f"{self.host_bytes / GIB:.3g} GiB on the host; host transfers {self.transfer_s * 1e3:.3g} ms a step, "
            f"{self.exposed_transfer_s * 1e3:.3g} ms of it exposed; recomputation {self.recompute_s * 1e3:.3g} ms"
        )


def build_problem(
    est: Estimate,
    *,
    hardware: Hardware,
    budget_bytes: float,
    prefetch: int,
    reach: int | None = None,
    stage: int | None = None,
) -> Problem:
    """The placement problem of stage ``stage`` of ``est`` (default: the one that holds the most memory; the
    whole model for one stage).

    ``est`` is the estimate of the run with ``recompute: none``; ``hardware`` gives the host link. Staging
    buffers hold ``prefetch`` layers ahead; the transfers are issued ``reach`` layers ahead (default
    ``prefetch``; a shallower reach is a schedule the same buffers also run).

    Raises:
      ConfigError: the stage holds no decoder blocks (the pass places a decoder's tensor groups).
    """
    stage = est.stages[est.fullest if stage is None else stage]
    blocks = decoder_blocks(est, stage)
    if not blocks:
        raise ConfigError(
            "offload.policy: the placement pass places the tensor groups of a decoder-only model's blocks; "
            "a vision-language model has none it can place. Set offload.policy: none"
        )
    run = est.run
    n, m, k = len(blocks), est.run.microbatches, prefetch if reach is None else min(reach, prefetch)
    axes = stage.stage.axes
    link = hardware.host.bandwidth
    lat = hardware.host.latency

    def xfer(nbytes: float) -> float:
        return nbytes / link + lat

    windows: list[tuple[str, float]] = [("before the forward", 0.0)]
    windows += [(f"forward of layer {i}", m * layer.forward_s) for i, layer in enumerate(blocks)]
    windows += [("loss and head", m * stage.head_s)]
    windows += [(f"backward of layer {i}", m * layer.backward_s) for i, layer in enumerate(blocks)]
    windows += [("optimizer step", stage.optimizer_s)]
    start, turn, opt = 0, n + 1, 2 * n + 2
    fwd = lambda i: start if i < 0 else (turn if i >= n else 1 + i)
    bwd = lambda i: turn if i >= n else (opt if i < 0 else n + 2 + i)

    def spread(seconds: float, direction: int, where: Sequence[int]) -> tuple[tuple[int, int, float], ...]:
        # the windows a depth reaches, each once: a depth past the first or last layer adds no window (the
        # step's start has no compute to hide a transfer, so it takes one only where no layer's window is near)
        where = list(dict.fromkeys(where))
        where = [w for w in where if w != start] or [start]  # no prefetch: fetched when needed, all exposed
        return tuple((w, direction, seconds / len(where)) for w in where)

    acts_in_flight = stage.in_flight
    # each layer's parameters, gradients and optimizer state on the device, as the estimate counts them
    state = [state_bytes(run, axes, layer.params, layer.params, layer.expert_params) for layer in blocks]
    groups: dict[str, dict[str, Choice]] = {}
    for i, (layer, (p, g, o)) in enumerate(zip(blocks, state, strict=True)):
        before_f = [fwd(i - j) for j in range(1, k + 1)]  # the layers computed before layer i's forward
        after_f = [fwd(i + j) for j in range(1, k + 1)]
        before_b = [bwd(i + j) for j in range(1, k + 1)]  # backward runs from the last layer down
        after_b = [bwd(i - j) for j in range(1, k + 1)]
        tp = xfer(layer.param_transfer_bytes)
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
        for a in PLACED_ACTIVATIONS:
            nbytes = layer.activation_bytes[a]
            kept = acts_in_flight * nbytes
            t = m * xfer(nbytes)
            options = {
                "device": Choice(memory=(kept, 0.0)),
                "host": Choice(
                    memory=(0.0, 0.0),
                    loads=spread(t, 1, after_f) + spread(t, 0, before_b),
                    buffers=(f"activations {a}",),
                    host_bytes=kept,
                ),
            }
            if a != BLOCK_INPUT:  # the input is where a recomputation starts
                rec, still = m * layer.recompute_by_name_s[a], acts_in_flight * layer.recompute_keeps_bytes.get(a, 0.0)
                options["recompute"] = Choice(memory=(still, 0.0), seconds=rec, capacity=((bwd(i), rec),))
            groups[f"layers.{i}.act.{a}"] = options
    largest = lambda f: max(f(layer) for layer in blocks)  # staging buffers hold the largest layer's
    k = min(prefetch, n)  # a depth past the stage's layers stages no more of them
    buffers = {
        "params": (0, (k + 1) * largest(lambda x: x.param_transfer_bytes)),
        "gradients": (0, 2 * max(g for _, g, _ in state)),
        **{
            f"activations {a}": (0, (k + 1) * largest(lambda x, a=a: x.activation_bytes[a])) for a in PLACED_ACTIVATIONS
        },
        "optimizer stream": (1, 2 * max(sum(s) for s in state)),
    }
    mem = stage.memory
    acts_layers = acts_in_flight * sum(layer.activation_bytes[a] for layer in blocks for a in PLACED_ACTIVATIONS)
    outside = {  # what the layers' groups leave of the stage's memory terms
        "embeddings and head (parameters, gradients, optimizer state)": mem["params"]
        + mem["gradients"]
        + mem["optimizer"]
        - sum(sum(s) for s in state),
        "logits and loss": mem["activations"] - acts_layers,
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
        allocator=hardware.device.allocator_factor,
        host_bytes=hardware.host.bytes_per_device,
        stretch=1.0 + est.bubble_ratio,
        layers=n,
    )


def decoder_blocks(est: Estimate, stage: StageCost) -> list[LayerCost]:
    """The cost of every decoder block ``stage`` holds, in model order (a mixture of experts' dense and MoE
    blocks differ)."""
    m = est.run.config.model
    parts = {p.moe: p.layer for p in stage.parts if p.module == "decoder"}
    if not parts:
        return []
    starts = chunk_starts(est.run)
    return [
        parts[m.is_moe(b)]
        for c, n in zip(stage.stage.chunks, stage.stage.layers, strict=True)
        for b in range(starts[c], starts[c] + n)
    ]


class Tally:
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
            key = "activations" if kind.startswith("act.") else kind.split(".")[0]
            self.moved[key] = self.moved.get(key, 0.0) + sign * options["device"].memory[0]

    def terms(self) -> tuple[float, float, bool, float, tuple[float, float], float]:
        """Step time, peak, fits, exposed transfer time, per-phase peaks, staging bytes."""
        phase, staging = self.phase.copy(), 0.0
        for b, count in self.buffers.items():
            if count > 0:
                ph, nbytes = self.problem.buffers[b]
                phase[ph] += nbytes
                staging += nbytes
        exposed = float(np.maximum(self.loads.max(axis=1) - self.capacity, 0.0).sum())
        peak = self.problem.allocator * float(phase.max())
        step = self.problem.base_step_s + self.problem.stretch * (self.seconds + exposed)
        fits = peak <= self.problem.budget_bytes and self.host <= self.problem.host_bytes
        return (
            step,
            peak,
            fits,
            exposed,
            (self.problem.allocator * phase[0], self.problem.allocator * phase[1]),
            staging,
        )


def evaluate(problem: Problem, placement: Placement) -> Priced:
    """The predicted step of ``placement`` under ``problem``'s model."""
    tally = Tally(problem)
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
