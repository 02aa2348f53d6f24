"""Serving a resolved run: prefill priced like a forward pass, decode as one memory-bound pass per token.

``serve.batch`` sequences of ``serve.prompt_len`` prompt tokens each generate ``serve.new_tokens`` tokens on
the run's mesh (its stages in turn, each with its tensor, expert and data axes; the batch split over the
data-parallel replicas).

- **Prefill** is the forward pass of the prompt, priced by the same layer model as training
  (:func:`hyperjax.cost.layer.price_layer` at the prompt's length, recomputation off): its products on the
  roofline, its tensor-parallel all-reduces, its experts' dispatch and combine, and FSDP's gathers.
- **Decode** prices one token of every sequence per step. The layer model at one token per sequence
  gives its products (their roofline is bound by reading the weights once per step), its element-wise
  work, its collectives at that size (latency-bound) and, for a mixture of experts, the grouped products
  over the device's experts (a group no copy reaches is skipped, its weights unread:
  :func:`hyperjax.cost.compute.grouped_gemm_time`). The attention core reads the KV cache: at the mean context of the
  decode (``prompt_len + new_tokens / 2``), every cached key and value of every sequence, once per step.
- **KV cache per device**: per layer and token, a key and a value per KV head the device holds (heads split
  over the tensor axis, replicated where it is wider than the KV heads), or DeepSeek's latent attention's
  compressed latent and rotary key (``kv_lora_rank + rope_head_dim``, on every tensor-parallel device);
  over a context axis, each device's share of the positions. A new token is whole on every device of a
  context group, each attending to its share, and the partial outputs are combined over the group.

Stages run one after another for a token (a pipeline serves one batch at a time here), so the prefill and
each decode step are the sums over the stages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hyperjax.config import ModelConfig, Run
from hyperjax.config.parallel import TRAINING_ONLY as PARALLEL_TRAINING_ONLY
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.cost.estimate import GIB, memory_budget
from hyperjax.cost.layer import price_layer
from hyperjax.cost.memory import sharding_axes, sharding_spans
from hyperjax.cost.parts import chunk_starts, part_models
from hyperjax.cost.pipeline import boundary_span
from hyperjax.cost.spans import stage_spans
from hyperjax.errors import ConfigError
from hyperjax.topology import Hardware


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeLayer:
    """One decoder layer's decode step on one device (what the serving offload pass places).

    Attributes:
      weight_bytes: its parameters.
      kv_bytes_per_token: its cached keys and values per token of context, over the device's sequences.
      rest_s: its decode step apart from reading the cache (products, element-wise work, collectives).
    """

    weight_bytes: float
    kv_bytes_per_token: float
    rest_s: float

    def kv_read_s(self, context: float, hardware: Hardware) -> float:
        """Seconds to read ``context`` tokens of its cache from device memory (two kernels)."""
        return stream_time(self.kv_bytes_per_token * context, ops=2, hardware=hardware)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InferenceEstimate:
    """A predicted serving run (the ``predict --inference --json`` object).

    Attributes:
      run: the resolved run it prices.
      batch, prompt_len, new_tokens: what is served.
      image_tokens: a vision-language model's image tokens (its encoder's patches), which prefix each prompt
        in the language model: they are prefilled and cached with it.
      prefill_s: the prompt's forward pass.
      decode_s_per_token: one decode step (a token of every sequence).
      tokens_per_s_per_device: generated tokens per second over every device.
      kv_cache_gib_per_device: the cache at its fullest (prompt and every new token), on the fullest stage.
      memory_per_device_gib: ``weights``, ``kv_cache``, ``activations`` and ``peak`` on the fullest stage.
      fits: whether ``peak`` fits the device memory.
      decode_breakdown_s: one decode step's ``weights_and_compute``, ``kv_cache_read``, ``communication``.
      layers: the fullest stage's decoder layers, in order.
      fixed_bytes: that stage's memory outside its layers' weights and caches (embeddings, head, activations).
      other_s: the decode step outside that stage's layers (the other stages', the head, the hand-overs between
        stages), so that with them the stage's layers make up ``decode_s_per_token``.
      others: each other stage's ``(layers, fixed_bytes, peak bytes)``, in stage order: a placement must fit
        them too.
    """

    run: Run
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_s: float
    decode_s_per_token: float
    tokens_per_s_per_device: float
    kv_cache_gib_per_device: float
    memory_per_device_gib: dict[str, float]
    fits: bool
    decode_breakdown_s: dict[str, float]
    layers: tuple[ServeLayer, ...] = ()
    fixed_bytes: float = 0.0
    other_s: float = 0.0
    others: tuple[tuple[tuple[ServeLayer, ...], float, float], ...] = ()
    image_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """Tokens a sequence's cache holds at its fullest: image tokens, the prompt and every new token."""
        return self.image_tokens + self.prompt_len + self.new_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return {
            "prefill_s": self.prefill_s,
            "decode_s_per_token": self.decode_s_per_token,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "kv_cache_gib_per_device": self.kv_cache_gib_per_device,
            "memory_per_device_gib": self.memory_per_device_gib,
            "fits": self.fits,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "image_tokens": self.image_tokens,
            "decode_breakdown_s": self.decode_breakdown_s,
            "run": self.run.to_dict(),
        }


_TRAIN_ONLY = """steps lr warmup_steps min_lr_ratio weight_decay beta1 beta2 grad_clip grad_dtype optimizer_state
    elementwise cross_entropy fp8 recompute reforward recompute_modules checkpoint_every keep_checkpoints"""
TRAINING_ONLY = tuple([f"train.{k}" for k in _TRAIN_ONLY.split()] + [f"parallel.{k}" for k in PARALLEL_TRAINING_ONLY])
"""Config keys of training that :func:`estimate_inference` does not read (the optimizer, the backward, the
recomputation, the gradient reduction; its products in the compute dtype, its collectives not overlapped):
``predict --inference`` refuses them given with ``--set``. The training batch keys are not among them: the run
is resolved as training resolves it, and a batch its degrees cannot split is fixed with them."""


def kv_bytes_per_token(m: ModelConfig, tensor: int, bytes_per_element: int) -> float:
    """Bytes one layer caches per token of one sequence on one device of a tensor axis of ``tensor``
    (``ModelConfig.cached``, the arrays the generation runtime allocates): the heads split over the tensor
    axis, a device keeping at least one (latent attention's single latent is kept whole)."""
    return sum(max(heads / tensor, 1) * width for heads, width in m.cached) * bytes_per_element


def estimate_inference(run: Run) -> InferenceEstimate:
    """Predict serving ``run.config.serve`` on ``run``'s mesh and hardware.

    Raises:
      ConfigError: a batch the data-parallel replicas cannot split, a prompt longer than ``model.seq_len``,
        a prompt and its new tokens longer than learned positions reach, or a prompt that leaves no new
        tokens of ``model.seq_len`` to a null ``serve.new_tokens``.
    """
    cfg, m, hw = run.config, run.config.model, run.hardware
    serve = cfg.serve
    prompt = serve.prompt_len or max(1, m.seq_len // 2)
    if prompt > m.seq_len:  # as generate refuses it, and vLLM a prompt past the model's length
        raise ConfigError(
            f"serve.prompt_len={prompt} is longer than model.seq_len={m.seq_len}, the longest sequence the model "
            f"takes; give serve.prompt_len of at most {m.seq_len}, or a longer model.seq_len"
        )
    if serve.new_tokens is None and prompt >= m.seq_len:
        raise ConfigError(
            f"serve.new_tokens is null (the rest of model.seq_len={m.seq_len}), but serve.prompt_len={prompt} leaves "
            "none of it; set serve.new_tokens"
        )
    new_tokens = serve.new_tokens or m.seq_len - prompt
    image = m.vision.patches if m.vision is not None else 0  # image tokens prefix the language model's prompt
    total = image + prompt + new_tokens
    if m.positions == "learned" and total > m.seq_len:
        raise ConfigError(
            f"serve.prompt_len={prompt} + serve.new_tokens={new_tokens} = {total} tokens, but learned "
            f"positions reach model.seq_len={m.seq_len}; serve fewer tokens"
        )
    batch = serve.batch or math.lcm(*(stage.data_parallel for stage in run.stages))
    e = 2 if run.dtype == "bfloat16" else 4
    ctx = image + prompt + new_tokens / 2
    prefill = step = kv_read = comm = 0.0
    per_stage: list[tuple[dict[str, float], list[ServeLayer]]] = []  # each stage's memory and layers
    n = len(run.stages)
    starts = chunk_starts(run)
    for stage in run.stages:
        axes, dp = stage.axes, stage.data_parallel
        if batch % dp:
            raise ConfigError(
                f"serve.batch={batch} is split over {dp} data-parallel replicas ({stage.name}: data x fsdp x "
                f"expert); use a multiple of {dp}"
            )
        local = batch // dp
        spans = sharding_spans(run.config.parallel, axes, stage_spans(hw, n, axes))  # weights over fsdp x context
        axes = sharding_axes(run.config.parallel, axes)
        tp, cp = axes["tensor"], axes["context"]
        weights = kv = acts = 0.0
        layers: list[ServeLayer] = []
        stage_s = 0.0  # this stage's part of a decode step
        parts = [p for j, c in enumerate(stage.chunks) for p in part_models(m, stage, j, starts[c])]
        for module, block, count, moe in parts:
            kw = dict(
                axes=axes,
                spans=spans,
                dtype=run.dtype,
                recompute="none",
                sequence_parallel=run.sequence_parallel,
                hardware=hw,
                moe=moe,
                expert_tensor=run.expert_tensor_split,
                dispatcher=run.config.parallel.dispatcher,
                context_impl=run.config.parallel.context_impl,
            )
            if module == "encoder":  # once per image, over its patches, in the prefill: no cache, no decode
                enc = price_layer(block, micro=local, **kw)
                prefill += count * (enc.forward_s + enc.tensor_comm_s / 2 + enc.context_forward_s)
                prefill += count * (enc.fsdp_gather_s if axes["fsdp"] > 1 else 0.0)
                weights += count * enc.params * e
                acts = max(acts, enc.activation_bytes.get("block_in", 0.0) * 6)
                continue
            full = price_layer(dataclasses.replace(block, seq_len=image + prompt), micro=local, **kw)
            prefill += count * (
                full.forward_s + full.tensor_comm_s / 2 + full.context_forward_s + 2 * full.exchange_s
            ) + count * (full.fsdp_gather_s if axes["fsdp"] > 1 else 0.0)
            # a new token is whole on every device of a context group (its products too); the cache is split
            # over the group by position, each device attending to its share, the partial outputs combined
            one = price_layer(
                dataclasses.replace(block, seq_len=1), micro=local, **{**kw, "axes": {**axes, "context": 1}}
            )
            heads = m.heads / tp
            width = m.head_dim + (m.rope_head_dim if m.attention == "mla" else 0)
            per_token_kv = kv_bytes_per_token(m, tp, e) / cp
            # the core reads every cached key and value once: each KV head's group of query heads (all heads
            # over the shared latent for latent attention) is one batched product over the context
            kv_local = 1 if m.attention == "mla" else max(m.kv_heads / tp, 1)
            group, held = heads / kv_local, ctx / cp
            core = gemm_time(
                group, held, width, count=local * kv_local, bytes_per_element=e, dtype=run.dtype, hardware=hw
            )
            core += gemm_time(
                group, m.head_dim, held, count=local * kv_local, bytes_per_element=e, dtype=run.dtype, hardware=hw
            )
            collectives = one.tensor_comm_s / 2 + 2 * one.exchange_s
            if cp > 1:  # the running maxima, then the rescaled float32 partial outputs and sums, summed over it
                partial = local * heads * (m.head_dim + 1) * 4
                collectives += collective_time("all_reduce", local * heads * 4, spans["context"], hw)
                collectives += collective_time("all_reduce", partial, spans["context"], hw)
            collectives += one.fsdp_gather_s if axes["fsdp"] > 1 else 0.0
            rest = one.forward_s - one.core_s + collectives
            stage_s += count * (rest + core)
            layers += [
                ServeLayer(weight_bytes=one.params * e, kv_bytes_per_token=per_token_kv * local, rest_s=rest)
            ] * count
            kv_read += count * core
            comm += count * collectives
            weights += count * one.params * e
            kv += count * per_token_kv * local * total
            acts = max(acts, full.activation_bytes.get("block_in", 0.0) * 6) if count else acts
        if 0 in stage.chunks or (run.chunks - 1) in stage.chunks:
            table = m.vocab * m.d_model / tp * e
            ends = (0 in stage.chunks) + ((run.chunks - 1) in stage.chunks and not m.tie_embeddings)
            weights += table * max(ends, 1)
        if (run.chunks - 1) in stage.chunks:
            head = gemm_time(local, m.vocab / tp, m.d_model, bytes_per_element=e, dtype=run.dtype, hardware=hw)
            stage_s += head
            prefill += head
            acts += local * m.vocab / tp * 4
        # each chunk hands its tokens to the next chunk's stage (interleaved: round the stages again); an
        # encoder alone hands its image tokens over once, in the prefill
        encoder_only = stage.modules == ("encoder",)
        for after in (run.stage_of(c + 1) for c in stage.chunks if c + 1 < run.chunks):
            span = boundary_span(hw, stage.first_device, after.first_device)
            sent = image if encoder_only else image + prompt
            prefill += collective_time("send", local * sent * m.d_model * e, span, hw)
            if not encoder_only:
                hop = collective_time("send", local * m.d_model * e, span, hw)
                stage_s += hop
                comm += hop
        step += stage_s
        memory = {"weights": weights, "kv_cache": kv, "activations": acts}
        memory["peak"] = sum(memory.values()) * hw.device.allocator_factor
        per_stage.append((memory, layers))
    fullest, fullest_layers = max(per_stage, key=lambda held: held[0]["peak"])  # the first of the fullest
    gib = {k: v / GIB for k, v in fullest.items()}
    # memory outside a stage's layers' weights and caches (embeddings, head, activations)
    outside = lambda mem, ls: (
        mem["peak"] / hw.device.allocator_factor - sum(x.weight_bytes + x.kv_bytes_per_token * total for x in ls)
    )
    return InferenceEstimate(
        run=run,
        batch=batch,
        prompt_len=prompt,
        new_tokens=new_tokens,
        image_tokens=image,
        prefill_s=prefill,
        decode_s_per_token=step,
        tokens_per_s_per_device=batch / step / run.devices,
        kv_cache_gib_per_device=gib["kv_cache"],
        memory_per_device_gib=gib,
        fits=fullest["peak"] <= memory_budget(run),
        decode_breakdown_s={
            "weights_and_compute": step - kv_read - comm,
            "kv_cache_read": kv_read,
            "communication": comm,
        },
        layers=tuple(fullest_layers),
        fixed_bytes=outside(fullest, fullest_layers),
        # the rest of the step: the other stages', the head and the hand-overs (a host fetch can run under them)
        other_s=max(step - sum(x.rest_s + x.kv_read_s(ctx, hw) for x in fullest_layers), 0.0),
        others=tuple((tuple(ls), outside(mem, ls), mem["peak"]) for mem, ls in per_stage if mem is not fullest),
    )
