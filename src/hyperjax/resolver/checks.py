"""Every tensor and activation of a run checked against its stage's mesh before anything compiles, and
what the config asks of the preset's device (:func:`check_preset`).

The tensors are the model's parameters as :mod:`hyperjax.cost.counts` lists them (exactly the NNX
models' own, path, shape and logical axes), so a dimension that a degree cannot split fails here, in
``predict``, ``plan`` and ``train`` alike, naming the tensor path, the logical axis, the sizes and the fix.
"""

from __future__ import annotations

import jax

from hyperjax.config import Config, ModelConfig, ParallelConfig, Stage
from hyperjax.config.parallel import EXCHANGE_KEYS, idle_exchange, shards_weights
from hyperjax.cost.counts import Tensor, decoder_tensors, encoder_tensors, tensors_by_axes
from hyperjax.errors import ConfigError, ShardingError, written
from hyperjax.shard import Strategy
from hyperjax.topology import Hardware


def stage_tensors(m: ModelConfig, stage: Stage) -> list[Tensor]:
    """The parameters a stage holds (one block of each kind stands for all of its kind: they share shapes)."""
    kinds = {m.is_moe(i): i for i in reversed(range(m.layers))}  # the first dense block and the first MoE block
    out: list[Tensor] = []
    if "encoder" in stage.modules:
        out += encoder_tensors(m.vision, m.d_model)
    if "language_model" in stage.modules:
        out += decoder_tensors(m, "language_model", sorted(kinds.values()))
    if "decoder" in stage.modules:
        out += decoder_tensors(m, "", sorted(kinds.values()))
    return out


def activations(m: ModelConfig, stage: Stage, rows: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """The activations of one micro-batch of ``rows`` sequences on ``stage``, with their logical axes."""
    acts: dict[str, tuple[tuple[int, ...], tuple]] = {}
    if "encoder" in stage.modules:
        v = m.vision
        acts["encoder residual"] = ((rows, v.patches, v.d_model), ("batch", "res_seq", "act_embed"))
    if {"decoder", "language_model"} & set(stage.modules):
        s = m.seq_len + (m.vision.patches if m.vision is not None else 0)
        acts |= {
            "tokens": ((rows, m.seq_len), ("batch", "seq")),
            "residual": ((rows, s, m.d_model), ("batch", "res_seq", "act_embed")),
            "queries": ((rows, s, m.heads, m.head_dim), ("batch", "seq", "act_heads", None)),
            "keys": ((rows, s, m.kv_heads, m.head_dim), ("batch", None, "act_kv_heads", None)),
            "mlp_hidden": ((rows, s, m.d_ff), ("batch", "seq", "act_mlp")),
            "logits": ((rows, m.seq_len, m.vocab), ("batch", "seq", "act_vocab")),
        }
    return acts


def check_stage(m: ModelConfig, strategy: Strategy, stage: Stage, rows: int) -> None:
    """``strategy`` places every parameter of ``stage`` (and its ZeRO-sharded state) and every activation of a
    micro-batch on its mesh.

    Raises:
      ShardingError: the first tensor it cannot place.
    """
    mesh = jax.sharding.AbstractMesh(tuple(stage.axes.values()), tuple(stage.axes))
    zero = strategy.zero_for("optimizer")  # the widest ZeRO split: the gradients' is the same axes or none
    for axes, shape, path in tensors_by_axes(stage_tensors(m, stage)):
        strategy.check(path, shape, axes, mesh, zero=zero)
    for name, (shape, logical) in activations(m, stage, rows).items():
        try:
            strategy.check(f"activation {name}", shape, logical, mesh)
        except ShardingError as e:
            raise ShardingError(f"{e} (batch per micro-batch {rows}, model.seq_len={m.seq_len})") from None


def check_preset(config: Config, hw: Hardware) -> None:
    """What ``config`` asks of the preset's device, it has: FP8 products for ``train.fp8``, the fused
    attention kernel ``model.attention_impl`` names, the compute units ``parallel.dispatcher_sms`` takes.
    ``resolve`` and the planner both check it first, so either names the key rather than failing later.

    Raises:
      ConfigError: naming the key, what the preset has and the fix.
    """
    fp8 = config.train.fp8
    if fp8 is not None and "fp8" not in hw.device.peak_flops:
        raise ConfigError(
            f"train.fp8 (recipe {fp8.recipe}) multiplies in FP8, but preset {hw.name}'s device {hw.device.name} "
            f"has no FP8 products: it multiplies {', '.join(hw.device.peak_flops)}; set train.fp8: null, or choose "
            "a preset whose device lists fp8 in peak_flops (dgx-h100)"
        )
    check_attention_impl(config, hw)
    check_dispatcher_sms(config, hw)


def check_attention_impl(config: Config, hw: Hardware) -> None:
    """``model.attention_impl`` names a fused attention kernel the preset's device measures.

    Raises:
      ConfigError: naming the key, the preset, the kernels it lists and the fix.
    """
    impl, kernels = config.model.attention_impl, hw.device.attention_kernels
    if impl is None or impl in kernels:
        return
    fix = (
        f"choose one of those, or remove model.attention_impl (the preset's default, {hw.device.fused_attention})"
        if kernels
        else "remove model.attention_impl (a fused kernel is priced at the device's matmul_efficiency there), or "
        "choose a preset that measures its kernels (dgx-h100)"
    )
    raise ConfigError(
        f"model.attention_impl={impl!r} is not a fused attention kernel of preset {hw.name}'s device "
        f"{hw.device.name}: it lists {sorted(kernels) or 'none'} in device.attention_kernels; {fix}"
    )


def check_dispatcher_sms(config: Config, hw: Hardware) -> None:
    """``parallel.dispatcher`` and ``parallel.dispatcher_sms`` can be honoured: a mixture of experts to exchange
    tokens for, and DeepEP-style kernels on a device whose compute units the preset counts, fewer than it has.

    Raises:
      ConfigError: naming the key, the sizes and the fix.
    """
    sms, p = config.parallel.dispatcher_sms, config.parallel
    if config.model.moe is None and p.dispatcher != "deepep":  # the default, which no dense run reads
        raise ConfigError(
            f"parallel.dispatcher={p.dispatcher!r} chooses how a mixture of experts exchanges its tokens, but the "
            "model has no MoE layers (model.moe is null); drop it"
        )
    if sms is None:
        return
    if config.model.moe is None:
        raise ConfigError(
            f"parallel.dispatcher_sms={sms}: the SMs of a mixture of experts' dispatch and combine kernels, but "
            "the model has no MoE layers (model.moe is null); remove parallel.dispatcher_sms"
        )
    if p.dispatcher != "deepep":
        raise ConfigError(
            f"parallel.dispatcher_sms={sms} sizes DeepEP-style dispatch kernels (parallel.dispatcher: deepep), "
            f"but parallel.dispatcher={p.dispatcher!r} exchanges through NCCL, whose channels are not set here; "
            "set parallel.dispatcher: deepep or remove parallel.dispatcher_sms"
        )
    units = hw.device.compute_units
    if not units:
        raise ConfigError(
            f"parallel.dispatcher_sms={sms}: preset {hw.name}'s device {hw.device.name} does not count its compute "
            "units (device.compute_units); remove parallel.dispatcher_sms (its device.comm_compute_share "
            f"{hw.device.comm_compute_share} prices the exchange's share of the device), or choose a preset that "
            "counts them (dgx-h100)"
        )
    if sms >= units:
        raise ConfigError(
            f"parallel.dispatcher_sms={sms} leaves no compute: preset {hw.name}'s device has {units} SMs "
            f"(device.compute_units); set it below {units} (DeepEP runs on 20, HybridEP's benchmarks on 32)"
        )


IDLE_DEFAULTS: dict[str, object] = {
    **{f"parallel.{k}": getattr(ParallelConfig(), k) for k in EXCHANGE_KEYS},
    "train.fp8.all_gather": False,
}
"""The settings that say how a feature runs outside ``parallel.*``'s modifiers, each at the value that turns it
off: a run without the feature refuses them set (:func:`check_idle_settings`), and a planner's candidate or
an elastic restart without it resets them (:func:`idle_settings`)."""


def set_settings(config: Config) -> dict[str, object]:
    """The keys of :data:`IDLE_DEFAULTS` that ``config`` sets away from the value that turns them off, each with
    its value."""
    out = {f"parallel.{k}": getattr(config.parallel, k) for k in EXCHANGE_KEYS}
    if config.train.fp8 is not None:
        out["train.fp8.all_gather"] = config.train.fp8.all_gather
    return {k: v for k, v in out.items() if v != IDLE_DEFAULTS[k]}


def idle_settings(config: Config) -> dict[str, object]:
    """The keys of :data:`IDLE_DEFAULTS` that ``config`` sets while its layout lacks their feature, each with
    its value: the dispatcher of a mixture of experts whose stages exchange no tokens, and FP8 gathers of
    weights that no stage shards (``train.fp8.all_gather`` without FSDP)."""
    p, subs, fp8 = config.parallel, config.mpmd.submeshes, config.train.fp8
    out: dict[str, object] = {}
    if config.model.moe is not None:
        out |= {f"parallel.{k}": v for k, v in idle_exchange(p, subs).items()}
    if fp8 is not None and fp8.all_gather and not shards_weights(p, subs):
        out["train.fp8.all_gather"] = True
    return out


def check_idle_settings(config: Config) -> None:
    """``config`` sets no key of :data:`IDLE_DEFAULTS` whose feature its layout lacks.

    Raises:
      ConfigError: naming the key, its value, the degrees that leave it nothing to act on and the fix.
    """
    idle = idle_settings(config)
    if not idle:
        return
    key, value = next(iter(idle.items()))
    p, subs = config.parallel, config.mpmd.submeshes
    if key == "train.fp8.all_gather":
        where = (
            f"no mpmd.submeshes item has fsdp > 1 (their fsdp: {', '.join(str(s.fsdp) for s in subs)})"
            if subs
            else f"parallel.fsdp={p.fsdp} shards no weights"
        )
        fix = (
            "give an mpmd.submeshes item fsdp > 1"
            if subs
            else "set parallel.fsdp > 1 (or parallel.context > 1 with parallel.fsdp_context: true)"
        )
        raise ConfigError(
            f"train.fp8.all_gather=true gathers FSDP's weight shards in FP8, but {where}; remove "
            f"train.fp8.all_gather, or {fix}"
        )
    if subs:
        where, fix = "an mpmd submesh holds every expert (it splits their hidden width over its tensor axis)", ""
    else:
        where = f"with parallel.expert={p.expert} every device holds every expert"
        where += f" (parallel.tensor={p.tensor} splits their hidden width)" if p.tensor > 1 else ""
        fix = ", or set parallel.expert > 1"
        fix += " (or parallel.expert_tensor: 1 to spread the experts over the tensor axis)" if p.tensor > 1 else ""
    raise ConfigError(
        f"{key}={written(value)} says how a mixture of experts exchanges its tokens, but no stage exchanges "
        f"any: {where}; remove {key}{fix}"
    )
