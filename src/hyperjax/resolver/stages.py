"""Where the model runs: the submeshes of a run, their mesh axes, and the layers each one holds.

One stage for an SPMD run; ``parallel.pipeline`` stages of consecutive devices for a pipeline (layers
balanced by training FLOPs per device); two submeshes for a vision-language model under ``mpmd:``
(sized by each module's FLOPs per device when not given).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hyperjax.config import Config, ModelConfig, ModuleName, Stage
from hyperjax.config.parallel import mpmd_replaced
from hyperjax.cost.counts import embed_flops_per_token, head_flops_per_token, layer_flops_per_token, module_flops
from hyperjax.errors import ConfigError, ShardingError, rekeyed
from hyperjax.shard import mesh_axes_for

MODULES: tuple[ModuleName, ...] = ("encoder", "language_model")
"""The modules of a vision-language model, in data-flow order."""


def spmd_stage(cfg: Config, devices: int) -> Stage:
    """The whole mesh as one stage."""
    p, m = cfg.parallel, cfg.model
    axes = mesh_axes_for(devices=devices, data=p.data, fsdp=p.fsdp, expert=p.expert, context=p.context, tensor=p.tensor)
    modules = ("decoder",) if m.vision is None else MODULES
    return Stage(
        name="stage 0", devices=devices, first_device=0, axes=axes, chunks=(0,), layers=(m.layers,), modules=modules
    )


def pipeline_sizes(cfg: Config, devices: int) -> list[int]:
    """Devices per pipeline stage: ``parallel.stage_devices``, or equal stages.

    Raises:
      ConfigError: stages that do not divide or sum to the devices.
    """
    p = cfg.parallel
    if p.stage_devices is None and devices % p.pipeline:
        raise ConfigError(
            f"parallel.pipeline={p.pipeline} does not divide the {devices} devices; choose a divisor or give "
            "parallel.stage_devices (one device count per stage)"
        )
    sizes = list(p.stage_devices or (devices // p.pipeline,) * p.pipeline)
    if sum(sizes) != devices:
        raise ConfigError(
            f"parallel.stage_devices={sizes} sum to {sum(sizes)}, but the run has {devices} devices "
            "(emulate.devices); make them sum to it"
        )
    return sizes


def pipeline_axes(cfg: Config, sizes: Sequence[int]) -> list[dict[str, int]]:
    """Each stage's mesh axes: the configured degrees over the stage's devices (``data`` inferred per stage
    when stages differ in size)."""
    p = cfg.parallel
    out = []
    for s, n in enumerate(sizes):
        data = p.data if p.stage_devices is None else None
        try:
            out.append(
                mesh_axes_for(devices=n, data=data, fsdp=p.fsdp, expert=p.expert, context=p.context, tensor=p.tensor)
            )
        except ShardingError as e:
            raise ShardingError(f"pipeline stage {s} ({n} devices): {e}") from None
    return out


def pipeline_stages(cfg: Config, sizes: Sequence[int], axes: Sequence[dict[str, int]]) -> tuple[Stage, ...]:
    """The stages of a pipeline: chunk ``c`` on stage ``c mod p``, layers balanced over the chunks."""
    p = cfg.parallel
    chunks = p.pipeline * p.virtual_stages
    chunk_devices = [sizes[c % p.pipeline] for c in range(chunks)]
    layers = balance_layers(cfg.model, chunk_devices, p.stage_layers, virtual=p.virtual_stages)
    empty = [s for s in range(p.pipeline) if not any(layers[c] for c in range(s, chunks, p.pipeline))]
    if empty:
        raise ConfigError(
            f"parallel.stage_layers={list(layers)} leaves pipeline stage {empty[0]} no block; a chunk may hold "
            "the embedding or the output layer alone only beside another chunk of its stage "
            "(parallel.virtual_stages > 1): give every stage a block"
        )
    offsets = [sum(sizes[:s]) for s in range(p.pipeline)]
    return tuple(
        Stage(
            name=f"stage {s}",
            devices=sizes[s],
            first_device=offsets[s],
            axes=axes[s],
            chunks=tuple(range(s, chunks, p.pipeline)),
            layers=tuple(layers[c] for c in range(s, chunks, p.pipeline)),
            modules=("decoder",),
        )
        for s in range(p.pipeline)
    )


def balance_layers(
    m: ModelConfig, chunk_devices: Sequence[int], stage_layers: Sequence[int] | None = None, *, virtual: int = 1
) -> list[int]:
    """Layers per chunk (model order) minimising the slowest chunk's training FLOPs per device.

    Chunk ``c`` runs on ``chunk_devices[c]`` devices; the first chunk also embeds, the last also computes
    the logits and the loss. Every chunk gets at least one layer, but where ``stage_layers`` gives the
    first or the last none (the embedding or the output layer alone, as Megatron can count them).

    Raises:
      ConfigError: more chunks than layers (naming a ``stage_layers`` that fits where the ``virtual`` chunks of
        a stage let its end chunks hold no block), or ``stage_layers`` that do not fit the model.
    """
    chunks = len(chunk_devices)
    if stage_layers is not None:
        inner = stage_layers[1:-1] if chunks > 1 else stage_layers
        ends = (stage_layers[0], stage_layers[-1]) if chunks > 1 else ()
        if len(stage_layers) != chunks or any(n < 1 for n in inner) or any(n < 0 for n in ends):
            raise ConfigError(
                f"parallel.stage_layers={list(stage_layers)} must give {chunks} layer counts (one per chunk: "
                "pipeline x virtual_stages), positive but for the first and the last chunk, which may hold the "
                "embedding or the output layer alone (Megatron's account_for_embedding_in_pipeline_split and "
                "account_for_loss_in_pipeline_split)"
            )
        if sum(stage_layers) != m.layers:
            raise ConfigError(
                f"parallel.stage_layers={list(stage_layers)} sums to {sum(stage_layers)} layers, but "
                f"model.layers={m.layers}; give counts that sum to model.layers"
            )
        return list(stage_layers)
    if chunks > m.layers:
        split = ""
        if virtual > 1 and chunks - 2 <= m.layers:  # the end chunks may hold the embedding or the output layer alone
            # one chunk too many: only the last holds no block; two: the end chunks hold none
            counts = [1] * m.layers + [0] if chunks == m.layers + 1 else [0] + [1] * m.layers + [0]
            split = f", or give parallel.stage_layers={counts} (the first and last chunks may hold no block)"
        raise ConfigError(
            f"parallel.pipeline x parallel.virtual_stages = {chunks} chunks, but model.layers={m.layers}; "
            f"the balanced split gives every chunk a layer: use at most {m.layers} chunks or a deeper model{split}"
        )
    return list(
        _balance(layer_flops_per_token(m), embed_flops_per_token(m), head_flops_per_token(m), tuple(chunk_devices))
    )


@functools.lru_cache(maxsize=4096)
def _balance(blocks: tuple[float, ...], embed: float, head: float, chunk_devices: tuple[int, ...]) -> tuple[int, ...]:
    """The balancing itself, cached (a search balances the same few shapes thousands of times); ``blocks``
    holds each block's FLOPs in model order (a mixture of experts' dense and MoE blocks differ).

    A dynamic programme over chunks: ``best[c][k]`` is the smallest possible slowest chunk when chunks
    ``0..c`` hold the first ``k`` layers, and chunk ``c`` takes the fewest layers that reach it. Since the
    chunks before it only get slower with more layers and chunk ``c`` only slower with more, the best
    count is where the two cross, found by bisection rather than by trying every count.
    """
    chunks, layers = len(chunk_devices), len(blocks)
    prefix = [0.0]
    for f in blocks:
        prefix.append(prefix[-1] + f)

    uniform = len(set(blocks)) == 1  # n x block exactly, so equal chunks tie exactly

    def cost(c: int, n: int, k: int) -> float:  # chunk c holding the n layers that end at layer k
        extra = (embed if c == 0 else 0.0) + (head if c == chunks - 1 else 0.0)
        work = n * blocks[0] if uniform else prefix[k] - prefix[k - n]
        return (work + extra) / chunk_devices[c]

    def first(lo: int, hi: int, pred) -> int:  # the smallest n in [lo, hi] with pred(n), else hi + 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid - 1
            else:
                lo = mid + 1
        return lo

    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(chunks)]
    cut = [[0] * (layers + 1) for _ in range(chunks)]
    for k in range(1, layers + 1):
        best[0][k] = cost(0, k, k)
    for c in range(1, chunks):
        before = best[c - 1]
        for k in range(c + 1, layers + 1):
            top = k - c  # chunk c takes n layers, 1 <= n <= top; the chunks before it take k - n
            crossing = first(1, top, lambda n, c=c, k=k, before=before: cost(c, n, k) >= before[k - n])
            value, n = inf, 0
            if crossing > 1:  # before the crossing the earlier chunks are the slower: their time decides
                value = before[k - crossing + 1]
                n = first(1, crossing - 1, lambda m, k=k, v=value, before=before: before[k - m] <= v)
            if crossing <= top and cost(c, crossing, k) < value:
                value, n = cost(c, crossing, k), crossing
            best[c][k], cut[c][k] = value, n
    counts, k = [], layers
    for c in range(chunks - 1, 0, -1):
        counts.append(cut[c][k])
        k -= cut[c][k]
    counts.append(k)
    return tuple(counts[::-1])


def mpmd_stages(cfg: Config, devices: int, rows: int) -> tuple[Stage, ...]:
    """The submeshes of a vision-language model under ``mpmd.submeshes``, one module each.

    Raises:
      ConfigError: a module on no submesh or on two, submeshes out of data-flow order, sizes that do not
        sum to the devices, or micro-batches a submesh's data-parallel degree cannot split.
    """
    p, m, subs = cfg.parallel, cfg.model, cfg.mpmd.submeshes
    if m.vision is None:
        raise ConfigError("mpmd.submeshes places the modules of a vision-language model; set model.vision")
    replaced = mpmd_replaced(p)
    if replaced is not None:
        key, value, why = replaced
        raise ConfigError(f"parallel.{key}={value}: {why}")
    placed = [name for sub in subs for name in sub.modules]
    for name in placed:
        if name not in MODULES:
            raise ConfigError(f"mpmd.submeshes: module {name!r} does not exist; the modules are {', '.join(MODULES)}")
    for name in MODULES:
        if placed.count(name) != 1:
            where = "no submesh" if name not in placed else f"{placed.count(name)} submeshes"
            raise ConfigError(f"mpmd.submeshes: module {name!r} is assigned to {where}; assign it to exactly one")
    if [sub.modules for sub in subs] != [(name,) for name in MODULES]:
        raise ConfigError(
            "mpmd.submeshes must list two submeshes in data-flow order, the first running [encoder], the "
            f"second [language_model]; got {[list(sub.modules) for sub in subs]}"
        )
    sizes = submesh_sizes(cfg, devices, rows)
    stages, offset = [], 0
    for c, (sub, n) in enumerate(zip(subs, sizes, strict=True)):
        label = sub.name or sub.modules[0]
        try:
            axes = mesh_axes_for(devices=n, data=sub.data, fsdp=sub.fsdp, tensor=sub.tensor)
        except ShardingError as e:  # the submesh's own keys, not the run's
            said = rekeyed(str(e), "parallel", f"mpmd.submeshes[{c}].")
            raise ShardingError(f"mpmd submesh {label!r} ({n} devices): {said}") from None
        if rows % (axes["data"] * axes["fsdp"]):
            replicas = axes["data"] * axes["fsdp"]
            raise ConfigError(
                f"mpmd submesh {label!r}: micro-batches of {rows} sequences (train.global_batch / "
                f"train.microbatches) do not split over its {replicas} data-parallel replicas (data x fsdp); "
                f"give mpmd.submeshes[{c}] a data x fsdp that divides {rows}, or a train.global_batch / "
                f"train.microbatches that {replicas} divides"
            )
        layers = m.vision.layers if sub.modules == ("encoder",) else m.layers
        stages.append(
            Stage(
                name=label,
                devices=n,
                first_device=offset,
                axes=axes,
                chunks=(c,),
                layers=(layers,),
                modules=sub.modules,
            )
        )
        offset += n
    return tuple(stages)


def submesh_sizes(cfg: Config, devices: int, rows: int) -> list[int]:
    """Devices per submesh: as configured, or (``devices: null``) balanced by training FLOPs per device."""
    subs = cfg.mpmd.submeshes
    given = [sub.devices for sub in subs]
    if None not in given:
        if sum(given) != devices:
            raise ConfigError(
                f"mpmd.submeshes devices {given} sum to {sum(given)}, but the run has {devices} devices "
                "(emulate.devices); make them sum to it, or set a submesh's devices: null to size it automatically"
            )
        return list(given)
    flops = module_flops(cfg.model)
    work = [flops[sub.modules[0]] for sub in subs]
    best: tuple[float, list[int]] | None = None
    free = devices - sum(n for n in given if n is not None)
    open_ = [i for i, n in enumerate(given) if n is None]
    for first in range(1, free) if len(open_) == 2 else [free]:
        sizes = list(given)
        if len(open_) == 2:
            sizes[open_[0]], sizes[open_[1]] = first, free - first
        else:
            sizes[open_[0]] = free
        if any(n is None or n < 1 for n in sizes):
            continue
        ok = all(
            n % (sub.fsdp * sub.tensor) == 0 and rows % (n // sub.tensor) == 0
            for sub, n in zip(subs, sizes, strict=True)
        )
        slowest = max(w / n for w, n in zip(work, sizes, strict=True))
        if ok and (best is None or slowest < best[0]):
            best = (slowest, sizes)
    if best is None:
        raise ConfigError(
            f"mpmd: no split of the {devices} devices fits the submeshes' degrees and micro-batches of {rows} "
            "sequences; give each submesh's devices, or change train.global_batch / train.microbatches"
        )
    return best[1]
