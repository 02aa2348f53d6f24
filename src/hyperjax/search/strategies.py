"""The strategies a search considers: every valid combination of degrees and options, as config overrides.

A candidate is its overrides applied over the config (:func:`candidate`), with the layout keys a search
decides afresh cleared: pipeline stage sizes and layers, micro-batch count and, for a vision-language
model searched as one SPMD program, the MPMD submeshes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator
from typing import Any

from hyperjax.config import Config, ModelConfig, SubmeshConfig
from hyperjax.config.parallel import MODIFIERS, MPMD_REPLACED, ParallelConfig, without_idle_modifiers
from hyperjax.mpmd.schedules import PAIRED
from hyperjax.resolver.checks import IDLE_DEFAULTS, idle_settings, set_settings
from hyperjax.topology import Hardware

CLEARED: dict[str, Any] = {
    "parallel.stage_devices": None,
    "parallel.stage_layers": None,
    "train.microbatches": None,
    "emulate.devices": None,
    "emulate.processes": None,
}
"""What every candidate resets before its own overrides: the search decides these. (A config's
``parallel.gradient_buckets`` is held: a strategy that cannot honour it fails to resolve and is not tried.)"""

SEARCHED = frozenset(
    [
        "data",
        "fsdp",
        "tensor",
        "sequence_parallel",
        "context",
        "pipeline",
        "virtual_stages",
        "schedule",
        "zero_stage",
        "expert",
        "expert_tensor",
        "overlap",
    ]
)
"""The ``parallel.*`` keys :func:`strategies` varies (``plan`` holds one given with ``--set`` to its value)."""

RECOMPUTE = ("none", "selective", "full")
"""Tried in this order: each adds time and saves memory, so the first that fits is the fastest."""


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending (pairs ``d, n // d`` up to the square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def apply(cfg: Any, overrides: dict[str, Any]) -> Any:
    """``cfg`` with dotted-key ``overrides`` applied (``train.fp8.all_gather`` too), each section replaced once
    with all of its keys (validated by the dataclasses)."""
    fields: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            fields[head] = value
    fields |= {head: apply(getattr(cfg, head), inner) for head, inner in nested.items()}
    return dataclasses.replace(cfg, **fields)


WHOLE_RUN: dict[str, Any] = {f"parallel.{key}": getattr(ParallelConfig(), key) for key in MPMD_REPLACED}
"""The whole run's layout keys an MPMD split resets to their defaults: its submeshes replace them (the resolver
refuses them set); the split's own overrides then set the pipeline and schedule keys it needs."""


def laid_out(cfg: Config, overrides: dict[str, Any]) -> Config:
    """``cfg`` with a candidate's layout: :data:`CLEARED`, then the ``overrides``; an MPMD split also resets
    :data:`WHOLE_RUN`, keeping sequence parallelism where a submesh has a tensor axis."""
    subs = overrides.get("mpmd.submeshes")
    split = {}
    if subs:
        tensor = any(sub.tensor > 1 for sub in subs)
        split = {**WHOLE_RUN, "parallel.sequence_parallel": cfg.parallel.sequence_parallel and tensor}
    return apply(cfg, {**CLEARED, **split, **overrides})


def candidate(cfg: Config, overrides: dict[str, Any]) -> Config:
    """The config a candidate's ``overrides`` select (:func:`laid_out`), with the config's settings whose
    feature the candidate turns off reset (:func:`selected`)."""
    chosen = laid_out(cfg, overrides)
    chosen = dataclasses.replace(chosen, parallel=without_idle_modifiers(chosen.parallel, chosen.mpmd.submeshes))
    return apply(chosen, {k: IDLE_DEFAULTS[k] for k in idle_settings(chosen)})


def selected(cfg: Config, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with what else the candidate changes in ``cfg``, so that ``cfg`` with them is the run
    priced: the keys of :data:`CLEARED` the search decides (a config's ``parallel.stage_layers``,
    ``train.microbatches``; not the device count, which ``--devices`` gives), and the ``parallel.*`` modifiers
    (:data:`hyperjax.config.parallel.MODIFIERS`: ``fsdp_reshard``, ``tp_overlap``, ...) and the other settings
    (:data:`hyperjax.resolver.checks.IDLE_DEFAULTS`: a mixture of experts' dispatcher, FP8 weight gathers) whose
    feature the candidate turns off, at the defaults :func:`candidate` resets them to (a run without the
    feature refuses them set)."""
    chosen = candidate(cfg, overrides)
    keys = [k for k in CLEARED if not k.startswith("emulate.")] + [f"parallel.{k}" for k in MODIFIERS]
    keys += list(set_settings(cfg))
    return overrides | {
        k: _value(chosen, k) for k in keys if k not in overrides and _value(chosen, k) != _value(cfg, k)
    }


def _value(cfg: Config, key: str) -> Any:
    """``cfg``'s value of the dotted ``key``."""
    return functools.reduce(getattr, key.split("."), cfg)


def strategies(
    cfg: Config, devices: int, *, accumulate: bool = False, one_program: bool = False
) -> Iterator[dict[str, Any]]:
    """Every valid combination of degrees and options for ``cfg``'s model on ``devices`` devices.

    Recomputation is not part of the combination: the search tries :data:`RECOMPUTE` in order and keeps
    the first that fits. A mixture of experts adds the expert degree (carved, like data and fsdp, out of
    the devices the other degrees leave: it carries batch outside the experts) and, with tensor
    parallelism, whether the experts spread over the tensor axis too (``parallel.expert_tensor: 1``), and
    where an all-to-all runs, the overlap schedules that can hide it (``parallel.overlap``). A
    vision-language model is searched as one SPMD program (no pipeline stages, which would cut through
    both modules); :func:`submesh_strategies` gives its MPMD splits. One program runs every row of a replica at
    once, and with ``accumulate`` also in micro-batches of ``train.micro_batch`` (gradient accumulation),
    whose forwards may then pair with the previous micro-batch's backward (``fb-pair`` on one stage) unless
    ``one_program`` asks for steps that run as one SPMD program on one stage (an RL learner's).
    """
    m, t = cfg.model, cfg.train
    vision = m.vision is not None
    experts = m.moe.experts if m.moe is not None else 1
    split = tensor_sizes(m).values()
    for tensor in (d for d in divisors(devices) if all(size % d == 0 for size in split)):
        for context in (d for d in divisors(devices // tensor) if m.seq_len % d == 0 and d <= MAX_CONTEXT):
            # a mixture of experts' blocks differ in cost (dense first, then MoE), so its stages are balanced
            # unequally anyway: any stage count up to the layers; a dense model's stages hold equal layers
            uneven = m.moe is not None
            pipelines = (
                [1]
                if vision or one_program
                else [
                    d
                    for d in divisors(devices // (tensor * context))
                    if (d <= m.layers if uneven else m.layers % d == 0)
                ]
            )
            for pipeline in pipelines:
                rest = devices // (tensor * context * pipeline)
                for fsdp, expert in ((f, e) for f in divisors(rest) for e in divisors(rest // f) if experts % e == 0):
                    data = rest // (fsdp * expert)
                    dp = data * fsdp * expert
                    if t.global_batch % dp:
                        continue
                    per_replica = t.global_batch // dp
                    if pipeline > 1:
                        micro_options = [mb for mb in divisors(per_replica) if mb <= 16]
                    else:  # one program: every row at once (and, accumulating, the config's micro-batch)
                        micro = t.micro_batch
                        more = accumulate and micro is not None and micro < per_replica and per_replica % micro == 0
                        micro_options = [None, micro] if more else [None]
                    schedules = [("1f1b", 1)]
                    if pipeline > 1:
                        schedules += [("interleaved", v) for v in (2, 3, 4) if m.layers % (pipeline * v) == 0]
                        schedules.append(("zero-bubble", 1))
                    # experts' hidden widths split over the tensor axis, or the experts spread over it too
                    spread_ok = m.moe is not None and tensor > 1 and experts % (expert * tensor) == 0
                    spreads = [None, 1] if spread_ok else [None]
                    for micro, (schedule, virtual), spread in itertools.product(micro_options, schedules, spreads):
                        exchanged = m.moe is not None and (expert > 1 or (spread == 1 and tensor > 1))
                        rows = micro or per_replica
                        overlaps = ["none"]
                        if exchanged and not vision and m.moe.capacity_factor is None and rows % 2 == 0:
                            overlaps.append("two-microbatch")
                        # F-B pairs: a pipeline's 1F1B, or one stage's accumulated micro-batches (a decoder's)
                        one_stage = vision or one_program
                        if exchanged and not one_stage and schedule in PAIRED and per_replica // rows >= 2 * pipeline:
                            overlaps.append("fb-pair")
                        # sequence parallelism moves the same bytes as plain tensor parallelism and
                        # stores less, so it is never worse: only the sequence-parallel variant is priced
                        for zero, overlap in itertools.product((0, 1, 2) if data > 1 else (0,), overlaps):
                            yield {
                                "parallel.data": data,
                                "parallel.fsdp": fsdp,
                                "parallel.tensor": tensor,
                                "parallel.sequence_parallel": tensor > 1,
                                "parallel.context": context,
                                "parallel.pipeline": pipeline,
                                "parallel.virtual_stages": virtual,
                                "parallel.schedule": schedule,
                                "parallel.zero_stage": zero,
                                "train.micro_batch": micro,
                                **(
                                    {
                                        "parallel.expert": expert,
                                        "parallel.expert_tensor": spread,
                                        "parallel.overlap": overlap,
                                    }
                                    if m.moe
                                    else {}
                                ),
                                **({"mpmd.submeshes": ()} if vision else {}),
                            }


MAX_CONTEXT = 16
"""The widest context split the search tries."""


def tensor_sizes(m: ModelConfig) -> dict[str, int]:
    """The model sizes a tensor degree must divide, by key: the query heads, the key/value heads where they are
    fewer (grouped queries), the dense MLPs' width where a layer has one, and the experts'."""
    sizes = {"model.heads": m.heads}
    sizes |= {"model.kv_heads": m.kv_heads} if m.kv_heads != m.heads else {}
    sizes |= {"model.d_ff": m.d_ff} if m.moe is None or m.moe_layers < m.layers else {}
    sizes |= {"model.moe.d_ff": m.moe.d_ff} if m.moe is not None else {}
    return sizes


def untried(cfg: Config, devices: int, where: dict[str, Any]) -> str | None:
    """Why :func:`strategies` on ``devices`` devices never has ``where`` 's tensor or context degree (the sizes
    it must divide, as they are), or None."""
    m = cfg.model
    tensor, context = where.get("parallel.tensor"), where.get("parallel.context")
    if isinstance(tensor, int) and tensor > 0:
        sizes = {"devices": devices, **tensor_sizes(m)}
        bad = [f"{k}={v}" if k != "devices" else f"the {v} devices" for k, v in sizes.items() if v % tensor]
        if bad:
            return f"parallel.tensor={tensor} must divide {', '.join(bad)}"
    if isinstance(context, int) and context > 0:
        if context > MAX_CONTEXT:
            return f"parallel.context={context}: the search tries context splits of {MAX_CONTEXT} or fewer"
        left = devices // tensor if isinstance(tensor, int) and tensor > 0 and devices % tensor == 0 else devices
        sizes = {"devices": left, "model.seq_len": m.seq_len}
        bad = [f"{k}={v}" if k != "devices" else f"the {v} devices" for k, v in sizes.items() if v % context]
        if bad and left != devices:
            bad[0] = bad[0].replace(" devices", f" devices parallel.tensor={tensor} leaves")
        if bad:
            return f"parallel.context={context} must divide {', '.join(bad)}"
    return None


def micro_batches(cfg: Config, combo: dict[str, Any]) -> tuple[int, int]:
    """``(rows, count)``: the rows of each micro-batch a candidate of :func:`strategies` runs, and how many a
    replica runs a step (one stage without ``train.micro_batch`` runs all its rows at once: one)."""
    dp = combo["parallel.data"] * combo["parallel.fsdp"] * combo.get("parallel.expert", 1)
    per_replica = cfg.train.global_batch // dp
    rows = combo["train.micro_batch"] or per_replica
    return rows, per_replica // rows


def submesh_strategies(cfg: Config, hardware: Hardware, devices: int) -> Iterator[dict[str, Any]]:
    """The MPMD splits of a vision-language model: the encoder on ``n`` devices (whole groups of the
    machine's first tier when there are several), the language model on the rest, each with a tensor
    degree that divides its heads and stays inside the first tier, and its weights and optimizer state
    whole on each of its data ranks or sharded (FSDP) over as many of them as its model width divides."""
    m = cfg.model
    node = hardware.tiers[0].group_size or devices
    step = node if node < devices else 1
    names = [sub.name for sub in cfg.mpmd.submeshes] or ["encoder", "language_model"]
    sharded = lambda rest, width: sorted({1, math.gcd(rest, width)})  # whole, or over the ranks the width divides
    schedule = cfg.parallel.schedule if cfg.parallel.schedule != "interleaved" else "1f1b"
    lm_tensors = lambda rest: (d for d in divisors(rest) if d <= node and math.gcd(m.heads, m.kv_heads) % d == 0)
    for n in range(step, devices, step):
        for t_enc in (d for d in divisors(n) if d <= node and m.vision.heads % d == 0):
            for t_lm in lm_tensors(devices - n):
                for f_enc, f_lm in itertools.product(
                    sharded(n // t_enc, m.vision.d_model), sharded((devices - n) // t_lm, m.d_model)
                ):
                    encoder = SubmeshConfig(name=names[0], modules=("encoder",), devices=n, tensor=t_enc, fsdp=f_enc)
                    lm = SubmeshConfig(
                        name=names[1], modules=("language_model",), devices=devices - n, tensor=t_lm, fsdp=f_lm
                    )
                    yield {
                        "mpmd.submeshes": (encoder, lm),
                        "parallel.pipeline": 1,
                        "parallel.virtual_stages": 1,
                        "parallel.schedule": schedule,
                        "train.micro_batch": None,
                        "train.microbatches": cfg.train.microbatches,
                    }
