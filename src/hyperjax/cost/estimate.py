"""Predict a training step on real hardware: time, memory and communication of a resolved run.

Each stage of the run is priced for one micro-batch (:mod:`hyperjax.cost.stage`), and the stages are
combined by the schedule the runtime executes. Stages equal in devices, mesh and layers are combined in
closed form, every stage priced as the slowest of them: GPipe and 1F1B idle the grid's own fraction,
interleaved and zero-bubble the fraction of their grid replayed with these task lengths. Unequal stages
(a pipeline with ``stage_devices`` or ``stage_layers``, a vision-language model's submeshes) are replayed
on the grid task by task, each chunk with its own lengths. The data-parallel gradient reduction overlaps
the last micro-batch's backward; the optimizer step follows. It answers in milliseconds for any size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from hyperjax.config import Run, check_run
from hyperjax.cost.counts import count_params, model_flops_per_sequence
from hyperjax.cost.overlap import Pair, pair_exchange
from hyperjax.cost.pipeline import in_flight, peak_with, with_in_flight
from hyperjax.cost.spans import hand_over_span, run_stage_spans
from hyperjax.cost.stage import ChunkCost, StageCore, StageCost, price_stage, stage_core
from hyperjax.errors import ConfigError
from hyperjax.mpmd.schedules import Schedule, Task, run_schedule
from hyperjax.mpmd.timing import (
    cached_schedule,
    closed_form_idle,
    paired_seconds,
    replay,
    replay_end,
    task_seconds,
    uniform_bubble,
)

GIB = 2**30
MEMORY_TERMS = ("params", "optimizer", "gradients", "activations")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """A predicted training step.

    Attributes:
      run: the resolved run it prices.
      step_time_s: seconds per optimizer step.
      devices: devices in the job.
      model_flops_per_step: FLOPs of forward and backward over the global batch, recomputation excluded.
      mfu: model FLOPs utilisation, ``model_flops_per_step / (step_time_s * devices * peak)``, the peak
        the compute dtype's products run at (:meth:`Hardware.matmul_flops`: TF32's for float32 on A100/H100).
      memory_per_device_gib: the fullest stage's ``params``, ``optimizer``, ``gradients``, ``activations``
        and ``peak``.
      fits: whether ``peak`` fits the device memory.
      overflow: when it does not fit, the largest memory term.
      breakdown_s: ``compute``, ``exposed_communication``, ``pipeline_bubble``, ``recompute``,
        ``optimizer`` of the slowest stage (they add up to ``step_time_s``).
      communication_s: every collective's total time per step on the slowest stage, by name, exposed or not.
      all_to_all: a mixture of experts' dispatch and combine on the slowest stage per step under the run's
        overlap schedule: ``total_s``, ``exposed_s`` (what its compute waits for) and ``hidden_fraction``
        (``1 - exposed / total``); ``None`` for a dense model.
      fp8: with ``train.fp8``, the slowest stage's ``recipe``, ``products_s`` (its FP8 products per step,
        forward and backward) and ``cast_s`` (its casts to FP8 per step, weights included); else ``None``.
      kinds: the distinct stage costs: stages alike but for the micro-batches they hold share one.
      kind_of: each stage's kind (an index into ``kinds``).
      in_flight: the micro-batches each stage holds at its peak.
      critical: the slowest stage (per micro-batch), whose terms make the breakdown.
      fullest: the stage with the largest peak memory.
      bubble_ratio: the pipeline's idle time over the slowest stage's busy time.
      closed_form: whether the stages were combined in closed form (equal stages) or replayed.
    """

    run: Run
    step_time_s: float
    devices: int
    model_flops_per_step: float
    mfu: float
    memory_per_device_gib: dict[str, float]
    fits: bool
    overflow: str | None
    breakdown_s: dict[str, float]
    communication_s: dict[str, float]
    all_to_all: dict[str, float] | None
    kinds: tuple[StageCost, ...]
    kind_of: tuple[int, ...]
    in_flight: tuple[int, ...]
    critical: int
    fullest: int
    bubble_ratio: float
    closed_form: bool
    fp8: dict[str, Any] | None = None

    @functools.cached_property
    def stages(self) -> tuple[StageCost, ...]:
        """Every stage's cost, in stage order."""
        return tuple(
            with_in_flight(self.kinds[k], stage, held)
            for k, stage, held in zip(self.kind_of, self.run.stages, self.in_flight, strict=True)
        )

    @property
    def params(self) -> int:
        """Parameters of the model."""
        return count_params(self.run.config.model)

    def details(self) -> dict[str, Any]:
        """Derived sizes, for people reading ``--json``: the slowest stage's mesh, layers, task lengths."""
        c = self.stages[self.critical]
        spans = c.spans
        task = self.task_lengths()
        return {
            "axes": {"pipeline": len(self.run.stages), **c.stage.axes},
            "microbatches": self.run.microbatches,
            "micro_batch": self.run.micro_batch,
            "layers_per_stage": c.layers,
            "params": self.params,
            "tiers": {k: sp.tier for k, sp in spans.items()},
            "task_s": {"F": task[0], "B": task[1], "W": task[2]},
            "in_flight": self.stages[self.fullest].in_flight,
            "bubble_ratio": self.bubble_ratio,
            "closed_form": self.closed_form,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data (the ``hyperjax predict --json`` object)."""
        return {
            "step_time_s": self.step_time_s,
            "devices": self.devices,
            "model_flops_per_step": self.model_flops_per_step,
            "mfu": self.mfu,
            "memory_per_device_gib": self.memory_per_device_gib,
            "fits": self.fits,
            "overflow": self.overflow,
            "breakdown_s": self.breakdown_s,
            "communication_s": self.communication_s,
            **({"all_to_all": self.all_to_all} if self.all_to_all is not None else {}),
            **({"fp8": self.fp8} if self.fp8 is not None else {}),
            "details": self.details(),
            "run": self.run.to_dict(),
        }

    def task_lengths(self) -> tuple[float, float, float]:
        """The slowest stage's ``F``, ``B`` and ``W`` per chunk, averaged over its chunks."""
        c = self.stages[self.critical]
        v = len(c.chunks)
        return (
            sum(t.forward_s for t in c.chunks) / v,
            sum(t.backward_s for t in c.chunks) / v,
            sum(t.weight_s for t in c.chunks) / v,
        )

    def schedule(self) -> tuple[Schedule, dict[Task, float]]:
        """The grid the step was priced on and each task's predicted length (exposed communication
        included): every stage at the slowest stage's lengths when combined in closed form."""
        run = self.run
        sched = run_schedule(run)
        if self.closed_form:
            return sched, task_seconds(sched, *self.task_lengths())
        pairs = pair_costs(sched, self.stages, run.exchange_share)
        return sched, chunk_task_seconds(sched, self.stages, pairs)


def chunk_task_seconds(
    sched: Schedule, stages: tuple[StageCost, ...], pairs: Mapping[tuple[int, int], Pair]
) -> dict[Task, float]:
    """Every task of ``sched`` at its own chunk's predicted length, each pair (``fb-pair``) shortened by what
    running its two tasks together saves (``pairs``: :func:`pair_costs`)."""
    lengths = {c.chunk: c for s in stages for c in s.chunks}
    kind = {"F": "forward_s", "B": "backward_s", "W": "weight_s"}
    seconds = {task: getattr(lengths[task.chunk], kind[task.kind]) for _, _, task in sched.starts()}
    return paired_seconds(sched, seconds, {k: p.saving_s for k, p in pairs.items()})


def pair_costs(sched: Schedule, stages: tuple[StageCost, ...], share: float) -> dict[tuple[int, int], Pair]:
    """Every pair of ``sched`` (``fb-pair``) priced, by its forward's and its backward's chunk."""
    exchange = {c.chunk: c.exchange for s in stages for c in s.chunks}
    out: dict[tuple[int, int], Pair] = {}
    for f, b in sched.pairs:
        if (f.chunk, b.chunk) not in out:
            out[(f.chunk, b.chunk)] = pair_exchange(exchange[f.chunk], exchange[b.chunk], share)
    return out


def _fsdp_comm(run: Run, c: StageCost, m: int) -> float:
    """FSDP's gathers and reduce-scatters a step: two gathers and one reduce-scatter a layer for each of ``m``
    micro-batches, or each once a step (``parallel.fsdp_reshard: false``, timed with the data-parallel
    reduction)."""
    if not run.config.parallel.fsdp_reshard:
        return sum(p.layers * (p.layer.fsdp_gather_s + p.layer.fsdp_scatter_s) for p in c.parts)
    return m * sum(p.layers * (2 * p.layer.fsdp_gather_s + p.layer.fsdp_scatter_s) for p in c.parts)


def memory_budget(run: Run) -> float:
    """The bytes one device's tensors may use: ``offload.device_memory_gib`` when set, else the preset's
    HBM less what its runtime reserves (``device.reserved_bytes``). Training, serving and the offload
    passes judge ``fits`` against it alike."""
    gib = run.config.offload.device_memory_gib
    return gib * GIB if gib is not None else run.hardware.device.usable_bytes


def estimate(run: Run, *, cores: dict[tuple, StageCore] | None = None) -> Estimate:
    """Predict one training step of ``run`` on its hardware.

    Args:
      run: the resolved run.
      cores: stage cores already priced for runs of the same model, hardware and dtype (a search shares
        one between the strategies it prices); ``None``: priced afresh.

    Raises:
      ConfigError: ``run`` is not a resolved :class:`Run`, or it is an ``rl:`` config's.
    """
    check_run(run, "estimate", "estimate_rl")
    if cores is not None and not isinstance(cores, dict):
        raise ConfigError(f"estimate(cores=): cores is {cores!r}; pass a dict shared between calls, or None")
    hw = run.hardware
    spans = run_stage_spans(hw, run)
    p2p = hand_over_span(hw, run)
    last = run.chunks - 1
    cores = {} if cores is None else cores
    kinds: list[StageCost] = []
    kind_of: list[int] = []
    held = [in_flight(run, i) for i in range(len(run.stages))]
    seen: dict[int, int] = {}
    for i, (stage, sp) in enumerate(zip(run.stages, spans, strict=True)):
        # stages alike but for their micro-batches in flight share their cost (and runs in a search, its core)
        key = (
            stage.devices,
            tuple(stage.axes.items()),
            stage.modules,
            stage.layers,
            0 in stage.chunks,
            last in stage.chunks,
            id(sp),
            run.recompute,
            run.sequence_parallel,
            run.expert_tensor_split,
            run.rows,
            run.overlap,
            run.exchange_share,
            run.config.train.fp8,
            p2p,
        )
        core = cores.get(key)
        if core is None:
            core = cores[key] = stage_core(run, stage, sp, p2p)
        if id(core) not in seen:
            seen[id(core)] = len(kinds)
            kinds.append(price_stage(run, stage, core, in_flight=held[i]))
        kind_of.append(seen[id(core)])
    m = run.microbatches
    critical = max(range(len(kind_of)), key=lambda i: kinds[kind_of[i]].per_microbatch_s)
    c = kinds[kind_of[critical]]
    mine = with_in_flight(c, run.stages[critical], held[critical]).chunks  # its chunks, numbered as its own
    busy = m * c.per_microbatch_s
    equal = len({(s.devices, tuple(s.axes.items()), s.layers, s.modules) for s in run.stages}) == 1
    paired: list[Pair] = []  # the slowest stage's pairs (fb-pair)
    if len(kind_of) == 1 and run.overlap != "fb-pair":
        idle = 0.0
    elif equal and run.overlap != "fb-pair":
        idle = _closed_form_idle(run, c)
    else:
        sched = cached_schedule(run.schedule, len(kind_of), m, run.virtual_stages, run.overlap == "fb-pair")
        if sched.pairs:
            share = run.exchange_share
            stages = tuple(with_in_flight(kinds[k], st, h) for k, st, h in zip(kind_of, run.stages, held, strict=True))
            costs = pair_costs(sched, stages, share)
            here = set(run.stages[critical].chunks)
            paired = [costs[(f.chunk, b.chunk)] for f, b in sched.pairs if f.chunk in here]
            busy -= sum(p.saving_s for p in paired)
            end = max(e for _, _, e in replay(sched, chunk_task_seconds(sched, stages, costs)).values())
        else:
            lengths = {}
            for k, stage in zip(kind_of, run.stages, strict=True):
                for n, t in zip(stage.chunks, kinds[k].chunks, strict=True):
                    lengths |= {(n, "F"): t.forward_s, (n, "B"): t.backward_s, (n, "W"): t.weight_s}
            end = replay_end(sched, lengths)
        idle = end - busy if end - busy > 1e-12 * busy else 0.0  # a replay's rounding is no bubble
    step = busy + idle + c.data_parallel_exposed_s + c.optimizer_s + c.weight_cast_s
    fullest = max(range(len(kind_of)), key=lambda i: peak_with(kinds[kind_of[i]], held[i]))
    memory = dict(with_in_flight(kinds[kind_of[fullest]], run.stages[fullest], held[fullest]).memory)
    fits = memory["peak"] <= memory_budget(run)
    # a pair's exchange hidden, and its compute slowed, against the two tasks apart (fb-pair)
    pair_hidden = sum(p.hidden_s for p in paired)
    pair_slowdown = sum(p.slowdown_s for p in paired)
    flops = model_flops_per_sequence(run.config.model) * run.global_batch
    return Estimate(
        run=run,
        step_time_s=step,
        devices=run.devices,
        model_flops_per_step=flops,
        mfu=flops / (step * run.devices * hw.matmul_flops(run.dtype)),
        memory_per_device_gib={k: v / GIB for k, v in memory.items()},
        fits=fits,
        overflow=None if fits else max(MEMORY_TERMS, key=memory.__getitem__),
        breakdown_s={
            "compute": m * (c.compute_s + c.slowdown_s) + pair_slowdown + c.weight_cast_s,
            "exposed_communication": m * (c.comm_s + c.p2p_s) + c.data_parallel_exposed_s - pair_hidden,
            "pipeline_bubble": idle,
            "recompute": m * c.recompute_s,
            "optimizer": c.optimizer_s,
        },
        communication_s={
            "tensor_parallel": m * sum(p.layers * p.layer.tensor_comm_s for p in c.parts),
            "context_parallel": m * sum(p.layers * p.layer.context_comm_s for p in c.parts),
            "expert_parallel": m * sum(p.layers * p.layer.expert_comm_s for p in c.parts),
            "fsdp": _fsdp_comm(run, c, m),
            "pipeline_p2p": m * c.p2p_s,
            # FSDP's once-a-step collectives (parallel.fsdp_reshard: false) are timed with the reduction
            "data_parallel": c.data_parallel_s - (0.0 if run.config.parallel.fsdp_reshard else _fsdp_comm(run, c, m)),
        },
        all_to_all=_all_to_all(run, mine, m, paired),
        fp8=_fp8(run, c, m),
        kinds=tuple(kinds),
        kind_of=tuple(kind_of),
        in_flight=tuple(held),
        critical=critical,
        fullest=fullest,
        bubble_ratio=idle / busy if busy else 0.0,
        closed_form=equal and run.overlap != "fb-pair",
    )


def _all_to_all(run: Run, chunks: tuple[ChunkCost, ...], m: int, paired: Sequence[Pair]) -> dict[str, float] | None:
    """The ``all_to_all`` of an estimate: the slowest stage's ``chunks``' exchanges per step, and what its
    compute waits for (the tasks of its ``paired`` pairs' exchanges as the pairs leave them exposed)."""
    if run.config.model.moe is None:
        return None
    total = m * sum(t.exchange.total_s for t in chunks)
    exposed = m * sum(t.exchange.exposed_s for t in chunks)
    exposed -= sum(p.unpaired_exposed_s - p.exposed_s for p in paired)
    hidden = total - exposed  # parts summed in another order than the whole: below 1e-9 of it is rounding
    return {
        "total_s": total,
        "exposed_s": exposed,
        "hidden_fraction": min(1.0, hidden / total) if total > 0 and hidden > 1e-9 * total else 0.0,
    }


def _fp8(run: Run, c: StageCost, m: int) -> dict[str, Any] | None:
    """The ``fp8`` of an estimate: the slowest stage's FP8 products and casts per step."""
    fp8 = run.config.train.fp8
    if fp8 is None:
        return None
    return {
        "recipe": fp8.recipe,
        "products_s": m * sum(p.layers * p.layer.fp8_products_s for p in c.parts),
        "cast_s": m * sum(p.layers * p.layer.cast_s for p in c.parts) + c.weight_cast_s,
    }


def _closed_form_idle(run: Run, c: StageCost) -> float:
    """The idle time of a pipeline of stages like ``c``: in closed form where one holds (every schedule but
    zero-bubble with a long ``W`` or fewer micro-batches than stages), else the grid replayed at these task
    lengths (only their ratios matter: rounded to three figures, the replays are shared)."""
    p, m, v = len(run.stages), run.microbatches, run.virtual_stages
    f, b, w = (sum(getattr(t, k) for t in c.chunks) / v for k in ("forward_s", "backward_s", "weight_s"))
    idle = closed_form_idle(run.schedule, p, m, f, b, w)
    if idle is not None:
        return idle
    ratio = lambda x: float(f"{x / f:.3g}")
    frac = uniform_bubble(run.schedule, p, m, v, 1.0, ratio(b), ratio(w))
    return m * c.per_microbatch_s * frac / (1 - frac)
