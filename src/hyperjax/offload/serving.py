"""HyperOffload for serving: the KV cache and the weights placed between device and host for decode.

A decode step runs the layers in turn, each reading its weights and its whole KV cache. The placeable groups
are each layer's weights (``layers.{i}.params``) and its cache in blocks of ``block_tokens`` tokens
(``layers.{i}.kv.{j}``). A group on the host is fetched over the preset's host link once per step, during
the ``prefetch`` layers computed before its own (the previous token's last layers for the first ones: decode
steps follow each other), into staging buffers on the device (``prefetch + 1`` layers of weights and of
cache); whatever a fetch takes beyond that window's compute is exposed. The same problem form and solvers
as training's placement pass (:mod:`hyperjax.offload.problem`, :mod:`hyperjax.offload.solve`) answer it:
the exact pass (HiGHS) the fastest placement under the budget, the greedy pass the baseline.

:func:`longest_context` searches the longest context (prompt and generated tokens together) a budget holds
under a placement policy, optionally within a per-token time limit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from hyperjax.cost.inference import InferenceEstimate
from hyperjax.errors import ConfigError
from hyperjax.offload.problem import Choice, Priced, Problem
from hyperjax.offload.solve import greedy, minimum_memory, solve_exact

Policy = Literal["none", "greedy", "exact"]
GAP = 1e-3
TIME_LIMIT_S = 20.0
"""The exact pass stops once its placement is proved within GAP (relative) of the fastest, or after
TIME_LIMIT_S seconds with the best placement found (HiGHS); symmetric instances can be slow to prove."""


def serve_problem(
    est: InferenceEstimate, *, context: int, budget_bytes: float, prefetch: int = 1, block_tokens: int = 8192
) -> Problem:
    """The placement problem of a decode step at ``context`` cached tokens per sequence, on the stage of
    ``est`` that holds the most memory.

    Raises:
      ConfigError: an estimate with no decoder layers, or a non-positive context, block or prefetch.
    """
    if not est.layers:
        raise ConfigError("the serving offload pass places decoder layers; this stage has none")
    if context < 1 or block_tokens < 1 or prefetch < 1:
        raise ConfigError(
            f"context={context}, block_tokens={block_tokens} and prefetch={prefetch} must be positive integers"
        )
    hw = est.run.hardware
    link, lat = hw.host.bandwidth, hw.host.latency
    n = len(est.layers)
    windows = [(f"layer {i}", x.rest_s + x.kv_read_s(context, hw)) for i, x in enumerate(est.layers)]
    windows.append(("other stages, head and hand-overs", est.other_s))
    w = len(windows)

    def before(i: int) -> tuple[int, ...]:  # the windows computed just before layer i's, wrapping to the last step
        return tuple((i - j) % w for j in range(1, prefetch + 1))

    def host(nbytes: float, i: int, buffer: str) -> Choice:
        seconds = nbytes / link + lat
        where = before(i)
        return Choice(
            memory=(0.0, 0.0),
            loads=tuple((v, 0, seconds / len(where)) for v in where),
            buffers=(buffer,),
            host_bytes=nbytes,
        )

    groups: dict[str, dict[str, Choice]] = {}
    blocks = [min(block_tokens, context - start) for start in range(0, context, block_tokens)]
    for i, x in enumerate(est.layers):
        groups[f"layers.{i}.params"] = {
            "device": Choice(memory=(x.weight_bytes, 0.0)),
            "host": host(x.weight_bytes, i, "weights"),
        }
        for j, tokens in enumerate(blocks):
            nbytes = x.kv_bytes_per_token * tokens
            groups[f"layers.{i}.kv.{j}"] = {"device": Choice(memory=(nbytes, 0.0)), "host": host(nbytes, i, "kv")}
    widest = max(est.layers, key=lambda x: x.weight_bytes)
    deepest = max(est.layers, key=lambda x: x.kv_bytes_per_token)
    return Problem(
        groups=groups,
        windows=tuple(windows),
        buffers={
            "weights": (0, (prefetch + 1) * widest.weight_bytes),
            "kv": (0, (prefetch + 1) * deepest.kv_bytes_per_token * context),
        },
        fixed=(est.fixed_bytes, 0.0),
        fixed_terms={"embeddings, head and activations": est.fixed_bytes},
        base_step_s=sum(c for _, c in windows),
        budget_bytes=budget_bytes,
        allocator=hw.device.allocator_factor,
        host_bytes=hw.host.bytes_per_device,
        layers=n,
        # a layer's full blocks are alike: the older goes first (the last, partial block stays free)
        ordered=tuple(
            (f"layers.{i}.kv.{j}", f"layers.{i}.kv.{j + 1}")
            for i in range(n)
            for j in range(len(blocks) - 1)
            if blocks[j + 1] == block_tokens
        ),
    )


def serve_greedy(problem: Problem) -> Priced | None:
    """The greedy pass for a decode step: every group is read once per step, so the largest go first."""
    return greedy(problem, distance=lambda group: 1)


def place(problem: Problem, policy: Policy) -> Priced | None:
    """The placement ``policy`` gives ``problem`` (``None``: it does not fit): ``none`` keeps everything on
    the device, ``greedy`` evicts the largest groups first, ``exact`` is the fastest that fits."""
    if policy == "exact":
        return solve_exact(problem, gap=GAP, time_limit_s=TIME_LIMIT_S, fallback=serve_greedy)
    if policy == "greedy":
        return serve_greedy(problem)
    from hyperjax.offload.placement import Placement
    from hyperjax.offload.problem import evaluate

    priced = evaluate(problem, Placement(()))
    return priced if priced.fits else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Longest:
    """The longest context a policy serves.

    Attributes:
      policy: ``none``, ``greedy`` or ``exact``.
      context: tokens per sequence (0: not even one block fits).
      decode_s_per_token: the decode step at that context under the policy's placement.
      device_only_s_per_token: the same step with everything on the device (memory aside).
      host_gib: what the placement puts on the host.
      peak_gib: device memory at its peak.
    """

    policy: str
    context: int
    decode_s_per_token: float
    device_only_s_per_token: float
    host_gib: float
    peak_gib: float

    @property
    def slowdown(self) -> float:
        """Per-token time over the device-only step at the same context, minus one."""
        return self.decode_s_per_token / self.device_only_s_per_token - 1 if self.context else 0.0


def longest_context(
    est: InferenceEstimate,
    *,
    budget_bytes: float,
    policy: Policy,
    max_slowdown: float | None = None,
    prefetch: int = 1,
    block_tokens: int = 8192,
    limit: int = 1 << 21,
) -> Longest:
    """The longest context (a multiple of ``block_tokens``, up to ``limit``) whose decode step ``policy``
    fits in ``budget_bytes``, and, with ``max_slowdown``, runs within that fraction of the device-only step
    at the same context. Doubling from one block, then bisection: a longer context only adds bytes."""

    def attempt(blocks: int) -> tuple[Priced, Problem] | None:
        problem = serve_problem(
            est, context=blocks * block_tokens, budget_bytes=budget_bytes, prefetch=prefetch, block_tokens=block_tokens
        )
        priced = place(problem, policy)
        if priced is None or (
            max_slowdown is not None and priced.step_time_s > (1 + max_slowdown) * problem.base_step_s
        ):
            return None
        return priced, problem

    top = limit // block_tokens
    lo, best = 0, None
    hi = 1
    while hi <= top and (found := attempt(hi)) is not None:
        lo, best, hi = hi, found, 2 * hi
    hi = min(hi - 1, top)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = attempt(mid)
        if found is None:
            hi = mid - 1
        else:
            lo, best = mid, found
    if best is None:
        return Longest(policy=policy, context=0, decode_s_per_token=math.nan, device_only_s_per_token=math.nan,
                       host_gib=0.0, peak_gib=0.0)  # fmt: skip
    priced, problem = best
    return Longest(
        policy=policy,
        context=lo * block_tokens,
        decode_s_per_token=priced.step_time_s,
        device_only_s_per_token=problem.base_step_s,
        host_gib=priced.host_bytes / 2**30,
        peak_gib=priced.peak_bytes / 2**30,
    )


def per_token_curve(
    est: InferenceEstimate,
    contexts: Sequence[int],
    *,
    budget_bytes: float,
    policy: Policy,
    prefetch: int = 1,
    block_tokens: int = 8192,
) -> list[float | None]:
    """The decode step at each context under ``policy``'s placement (``None`` where it does not fit)."""
    out: list[float | None] = []
    for c in contexts:
        problem = serve_problem(est, context=c, budget_bytes=budget_bytes, prefetch=prefetch, block_tokens=block_tokens)
        priced = place(problem, policy)
        out.append(None if priced is None else priced.step_time_s)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingPlacement:
    """What ``offload.policy`` places for a serving estimate at its own context (prompt and new tokens).

    Attributes:
      policy: ``offload.policy`` (``auto``: the exact pass placed it; ``greedy``).
      context: tokens per sequence the decode step caches.
      fits: whether the placement's peak fits the budget.
      budget_gib: the device-memory budget (``offload.device_memory_gib``, else the preset's usable HBM).
      peak_gib: device memory at the placement's peak (when nothing fits, the smallest any placement reaches).
      host_gib: what it puts on the host: ``weights_host_gib`` of weights, ``kv_cache_host_gib`` of cache.
      staging_gib: the device buffers host groups are fetched into.
      decode_s_per_token: the decode step under the placement.
      device_only_s_per_token: the same step with everything on the device (memory aside).
      weights_on_host: layers whose weights live on the host.
      kv_blocks_on_host: KV-cache blocks (of ``block_tokens``) on the host, of ``kv_blocks``.
      proved_gap: under ``auto``, how far (relative) the exact pass proved its step from the fastest
        (``None``: not proved, or the greedy pass).
      time_limited: the exact pass stopped at its time limit (``TIME_LIMIT_S``) before proving ``GAP``.
    """

    policy: str
    context: int
    fits: bool
    budget_gib: float
    peak_gib: float
    host_gib: float
    weights_host_gib: float
    kv_cache_host_gib: float
    staging_gib: float
    decode_s_per_token: float
    device_only_s_per_token: float
    weights_on_host: int
    kv_blocks_on_host: int
    kv_blocks: int
    proved_gap: float | None = None
    time_limited: bool = False

    def to_dict(self) -> dict[str, object]:
        """The placement as plain JSON values."""
        return dataclasses.asdict(self)


def serving_pass(est: InferenceEstimate, *, budget_bytes: float, block_tokens: int = 8192) -> ServingPlacement:
    """Place the weights and KV cache of ``est``'s decode step at its own context by ``offload.policy``
    (``auto``: the exact pass; ``greedy``) within ``budget_bytes``; when nothing fits, the smallest-peak
    placement (:func:`hyperjax.offload.solve.minimum_memory`) is reported with ``fits`` false.

    Raises:
      ConfigError: ``offload.policy: manual`` (its patterns name training's groups) or ``none``, or
        ``offload.prefetch: 0``.
    """
    word = est.run.offload
    if word not in ("auto", "greedy"):
        raise ConfigError(
            f"offload.policy={word!r}: serving places layers.N.params and layers.N.kv.B groups by the auto or "
            "greedy pass; offload.manual names training's groups. Set offload.policy: auto or greedy"
        )
    policy: Policy = "exact" if word == "auto" else "greedy"
    context = est.cached_tokens
    prefetch = est.run.config.offload.prefetch
    if prefetch < 1:
        raise ConfigError(
            f"offload.prefetch={prefetch}: serving fetches a host group during the layers before its own; set "
            "offload.prefetch >= 1"
        )
    block = min(block_tokens, context)
    problem = serve_problem(est, context=context, budget_bytes=budget_bytes, prefetch=prefetch, block_tokens=block)
    priced = place(problem, policy)
    fits = priced is not None
    if priced is None:  # nothing fits: the smallest-peak placement, as training's pass reports
        priced = minimum_memory(problem)
    # every other stage places its own layers by the same pass: the run fits only where each of them fits
    # too, and a token waits for the fetches each stage's placement leaves exposed
    extra = 0.0
    for layers, fixed, peak in est.others if fits else ():
        if peak <= budget_bytes:
            continue
        if not layers:  # nothing of its own to place
            fits = False
            break
        view = dataclasses.replace(est, layers=layers, fixed_bytes=fixed)
        other = serve_problem(view, context=context, budget_bytes=budget_bytes, prefetch=prefetch, block_tokens=block)
        theirs = place(other, policy)
        if theirs is None:
            fits = False
            break
        extra += max(theirs.step_time_s - other.base_step_s, 0.0)
    host = priced.placement.on("host")
    return ServingPlacement(
        policy=word,
        context=context,
        fits=fits,
        budget_gib=budget_bytes / 2**30,
        peak_gib=priced.peak_bytes / 2**30,
        host_gib=priced.host_bytes / 2**30,
        weights_host_gib=priced.moved_bytes.get("params", 0.0) / 2**30,
        kv_cache_host_gib=priced.moved_bytes.get("kv", 0.0) / 2**30,
        staging_gib=priced.staging_bytes / 2**30,
        decode_s_per_token=priced.step_time_s + extra,
        device_only_s_per_token=problem.base_step_s,
        weights_on_host=sum(g.endswith(".params") for g in host),
        kv_blocks_on_host=sum(".kv." in g for g in host),
        kv_blocks=sum(".kv." in g for g in problem.groups),
        proved_gap=priced.proved_gap,
        time_limited=priced.time_limited,
    )


def with_serving(est: InferenceEstimate, placed: ServingPlacement) -> InferenceEstimate:
    """The serving estimate under ``placed``: device memory, verdict, and a decode step that adds the host
    fetches the placement leaves exposed (``exposed_host_fetch``, priced at the fullest cache, the
    placement's context) to the estimate's step (priced at the decode's mean context). The prefill is the
    estimate's: its compute hides the fetches."""
    mem = {k: v for k, v in est.memory_per_device_gib.items() if k != "peak"}
    mem["weights"] -= placed.weights_host_gib
    mem["kv_cache"] -= placed.kv_cache_host_gib
    mem |= {"staging": placed.staging_gib, "host": placed.host_gib, "peak": placed.peak_gib}
    exposed = max(placed.decode_s_per_token - placed.device_only_s_per_token, 0.0)
    step = est.decode_s_per_token + exposed
    return dataclasses.replace(
        est,
        decode_s_per_token=step,
        tokens_per_s_per_device=est.tokens_per_s_per_device * est.decode_s_per_token / step,
        kv_cache_gib_per_device=est.kv_cache_gib_per_device - placed.kv_cache_host_gib,
        memory_per_device_gib=mem,
        fits=placed.fits,
        decode_breakdown_s=est.decode_breakdown_s | {"exposed_host_fetch": exposed},
    )


__all__ = [
    "Longest",
    "Policy",
    "ServingPlacement",
    "longest_context",
    "per_token_curve",
    "place",
    "serve_problem",
    "serving_pass",
    "with_serving",
]
