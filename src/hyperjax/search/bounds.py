"""A lower bound on a strategy's predicted step, cheap enough to order and prune a search.

For a decoder-only model whose stages are equal in devices and mesh (every candidate of a search), the
slowest stage does at least the work of the stage with the most layers, ``n``: each micro-batch costs
it at least ``n`` blocks' forward, backward and on-path communication (a mixture of experts' all-to-all
left out: an overlap schedule may hide it). Over equal stages every schedule
idles at least a third of ``p - 1`` such micro-batches per chunk (GPipe, 1F1B and interleaved idle
``(p - 1)(F + B)``; ZB-H1's ``(p - 1)(F + B) - min(m - 1, p - 1) W`` is at least a third of that, since
``W <= min(F, B)`` in this model). Data-parallel exposure, the optimizer and the head only add.

Recomputation is bounded too: the first stage keeps at least its blocks' parameters (under ZeRO-2, the
leanest), their gradients and optimizer state, and the activations of the micro-batches it holds; where
that cannot fit the budget without recomputing, no variant of the strategy runs without it, and the bound
prices the lightest recomputation that could fit. So the bound never exceeds the estimate, and a candidate
whose bound exceeds the time to beat cannot win.
"""

from __future__ import annotations

import math
from typing import Any

from hyperjax.config import Config, ParallelConfig
from hyperjax.config.parallel import exchanges_tokens
from hyperjax.cost import (
    grad_bytes,
    optimizer_bytes,
    price_layer,
    replica_axes,
    shard_weight_bytes,
    sharding_axes,
    sharding_spans,
    stage_spans,
    zero_share,
)
from hyperjax.resolver import balance_layers
from hyperjax.search.strategies import RECOMPUTE
from hyperjax.topology import Hardware


def lower_bound(cfg: Config, overrides: dict[str, Any], hardware: Hardware, budget_bytes: float) -> float:
    """A lower bound on the step time of the decoder-only candidate ``overrides`` selects (seconds);
    infinite where no recomputation setting can fit ``budget_bytes`` per device."""
    m = cfg.model
    data, fsdp, expert = overrides["parallel.data"], overrides["parallel.fsdp"], overrides.get("parallel.expert", 1)
    axes = {
        "data": data,
        "fsdp": fsdp,
        "expert": expert,
        "context": overrides["parallel.context"],
        "tensor": overrides["parallel.tensor"],
    }
    p, v = overrides["parallel.pipeline"], overrides["parallel.virtual_stages"]
    dp = data * fsdp * expert
    micro = overrides["train.micro_batch"] or cfg.train.global_batch // dp
    microbatches = cfg.train.global_batch // (micro * dp)
    spans = sharding_spans(cfg.parallel, axes, stage_spans(hardware, p, axes))  # FSDP over fsdp x context
    replicas = replica_axes(cfg.parallel, axes)
    axes = sharding_axes(cfg.parallel, axes)
    chunks = balance_layers(m, [1] * (p * v)) if p > 1 else [m.layers]  # equal stages: devices cancel
    starts = [sum(chunks[:c]) for c in range(len(chunks))]
    # each stage's blocks of each kind (a mixture of experts' dense and MoE blocks differ)
    kinds = [False, True] if m.moe is not None and m.moe_layers < m.layers else [m.moe is not None]
    count = [
        [
            sum(m.is_moe(i) == kind for c in range(s, p * v, p) for i in range(starts[c], starts[c] + chunks[c]))
            for kind in kinds
        ]
        if m.moe is not None
        else [sum(chunks[c] for c in range(s, p * v, p))]  # one kind: the stage's blocks
        for s in range(p)
    ]
    held = 1 if p == 1 else min(microbatches, math.ceil(p * (1 + (p - 1) / (p * v) if v > 1 else 1)))
    if overrides["parallel.schedule"] == "gpipe":
        held = microbatches
    e = 2 if cfg.train.dtype == "bfloat16" else 4
    g, (master, moments) = grad_bytes(cfg.train), optimizer_bytes(cfg.train)
    expert_tensor = overrides.get("parallel.expert_tensor") in (None, axes["tensor"]) or axes["tensor"] == 1
    # the dispatcher the candidate runs: the config's where its experts exchange tokens, else reset
    spread = ParallelConfig(expert=expert, tensor=axes["tensor"], expert_tensor=overrides.get("parallel.expert_tensor"))
    dispatcher = cfg.parallel.dispatcher if exchanges_tokens(spread) else ParallelConfig().dispatcher
    for recompute in RECOMPUTE:
        layers = [
            price_layer(
                m,
                micro=micro,
                axes=axes,
                spans=spans,
                dtype=cfg.train.dtype,
                recompute=recompute,
                sequence_parallel=overrides["parallel.sequence_parallel"],
                hardware=hardware,
                moe=moe,
                expert_tensor=expert_tensor,
                fp8=cfg.train.fp8,
                modules=cfg.train.recompute_modules,
                tp_overlap=cfg.parallel.tp_overlap,
                fsdp_reshard=cfg.parallel.fsdp_reshard,
                grad_dtype=cfg.train.grad_dtype,
                elementwise=cfg.train.elementwise,
                dispatcher=dispatcher,
                context_impl=cfg.parallel.context_impl,
                reforward=cfg.train.reforward,
            )
            for moe in kinds
        ]
        # the first stage keeps its blocks' state (ZeRO-2: the leanest, with 16-bit compute the float32
        # master sharded beside the moments and gradients) and activations
        lean = e == 2 and axes["fsdp"] == 1  # 16-bit weights whole, the float32 master sharded
        state = [
            x.params * (2 if lean else shard_weight_bytes(cfg.train))
            + (master * lean + moments + g) * zero_share(x.params, x.expert_params, replicas)
            for x in layers
        ]
        kept = sum(n * (st + held * x.stored_bytes) for n, st, x in zip(count[0], state, layers, strict=True))
        if kept * hardware.device.allocator_factor <= budget_bytes:
            break
    else:
        return math.inf
    # an overlap schedule may hide every all-to-all, so the bound counts none of it
    per_kind = [x.forward_s + x.backward_s + x.recompute_s + x.on_path_comm_s - x.expert_comm_s for x in layers]
    work = [sum(n * t for n, t in zip(c, per_kind, strict=True)) for c in count]
    busy = microbatches * max(work)
    # every schedule idles at least a third of (p - 1) micro-batches of its chunks' work (equal chunks)
    idle = (p - 1) * min(work) / (3 * v) if p > 1 and len(set(chunks)) == 1 else 0.0
    return busy + idle
