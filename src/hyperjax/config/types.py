"""The closed vocabularies of a run, each defined once as a ``Literal`` and checked when a config is read.

A word outside its vocabulary (``train.recompute: ful``) fails in the loader with the key, the word and
the choices, not minutes into a run. Code that branches on one of these words takes the ``Literal``.
"""

from __future__ import annotations

import typing
from typing import Literal

DType = Literal["float32", "bfloat16"]
"""Compute dtype; parameters stay float32."""

Fp8Recipe = Literal["tensorwise", "delayed", "rowwise", "blockwise"]
"""How an FP8 product scales its operands: one scale per tensor from its current amax (Transformer Engine's
current scaling, torchao's tensorwise), one per tensor from an amax history (TE's delayed scaling), one per
row of each operand (torchao's rowwise), or 1x128 tiles of activations and gradients with 128x128 blocks of
weights (DeepSeek-V3)."""

Fp8Format = Literal["hybrid", "e4m3"]
"""FP8 formats: ``hybrid`` is E4M3 forward and E5M2 for gradients; ``e4m3`` is E4M3 throughout."""

Recompute = Literal["none", "selective", "full"]
"""Activation recomputation per block: nothing, the activations ``train.recompute_modules`` names (the
attention core unless it names others), or the whole block."""

ScheduleName = Literal["gpipe", "1f1b", "interleaved", "zero-bubble"]
"""Pipeline schedules (:mod:`hyperjax.mpmd.schedules`)."""

Overlap = Literal["none", "two-microbatch", "fb-pair"]
"""How a mixture of experts' all-to-all meets compute (:mod:`hyperjax.mpmd.lanes`): not at all (each dispatch
and combine waits), two halves of every micro-batch whose exchanges hide behind each other's compute
(DeepSeek-V3's two-micro-batch overlap), or a forward and a backward of different micro-batches paired so
that each one's exchanges hide behind the other's compute: on a pipeline (DualPipe's F-B pairing), or on one
stage under gradient accumulation (Megatron-Core's EP overlap without pipelining)."""

TpOverlap = Literal["none", "bulk", "pipelined"]
"""How tensor-parallel collectives meet the products beside them (priced; the emulated mesh leaves the
schedule to XLA): not at all (Megatron's and torchtitan's default), in the backward behind the
weight-gradient products (Megatron's bulk ``tp_comm_overlap``), or split into chunks that run beside the
chunks of their products in every pass (Transformer Engine's pipelined userbuffers, torchtitan's async
TP, XLA's collective matmul on TPU)."""

ContextImpl = Literal["allgather", "ring"]
"""How context parallelism meets keys and values (priced; the emulated step gathers them): gathered whole
before one attention kernel over the local queries (hyperjax's own step, MaxText; Transformer Engine's
``all_gather``), or passed round a ring, one block a step beside the attention of the block before, over
two chunks a device for causal balance (Transformer Engine's ``p2p``, Megatron-Core's default
``cp_comm_type``): ``context`` shorter kernels a pass."""

DpOverlap = Literal["none", "backward", "full"]
"""How the data-parallel gradient reduction (and ZeRO's parameter gather) meets compute (priced): after
the backward, exposed; beside the last micro-batch's backward as its gradients are ready (PyTorch DDP,
Megatron's ``overlap_grad_reduce``, XLA's async collectives: the default); or that, with the parameter
all-gather beside the next step's first forward too (Megatron's ``overlap_param_gather``)."""

FsdpUnit = Literal["tensor", "layer"]
"""What FSDP gathers and reduce-scatters at once: one tensor (XLA's SPMD partitioner: hyperjax, MaxText; each
weight gathered before its product, its gradient reduce-scattered as soon as it is produced) or a whole block
(PyTorch FSDP2's unit, torchtitan: the block's gradients reduced together in float32)."""

Dispatcher = Literal["deepep", "alltoall", "allgather"]
"""How a mixture of experts' tokens reach their experts (priced; the emulated step runs its own all-to-all of
padded buffers): DeepEP's kernels (DeepSeek-V3; Megatron's ``flex`` dispatcher), each token sent once to each
device and across the slow tier once to each node holding any of its experts, then forwarded inside the node;
NCCL's all-to-all (Megatron's ``alltoall`` dispatcher), each of a token's ``top_k`` routed copies sent to its
expert's device; or an all-gather of the group's tokens to every device and a reduce-scatter back
(Megatron's ``allgather`` dispatcher, its default)."""

Elementwise = Literal["fused", "eager"]
"""How a block's element-wise work (norms, rotary embedding, activation, residual adds) runs (priced; the
emulated step is compiled by XLA): fused into few kernels that read and write each activation once (XLA,
``torch.compile``), or one kernel per operation through HBM, in float32 where the model upcasts (eager
PyTorch: torchtitan's ``compile = false``)."""

Reforward = Literal["needed", "whole"]
"""What a recomputation re-runs in the backward (priced; the emulated step is JAX's): the forward ops whose
outputs the backward reads, which is what JAX's rematerialisation keeps after dead-code elimination (under
``train.recompute: full`` every product but the MLP's output projection, in a parallel block the attention's
output projection too, and the collective after them; a materialized attention core's probabilities its
scores' product, its output its values' product); or the whole checkpointed region, as PyTorch's activation
checkpointing re-runs it from the region's input, which it keeps (the whole forward: Megatron's
``--recompute-granularity full``; a materialized core whole for its probabilities: its ``core_attn``
checkpoint; the norms alone from their inputs, the mid-block residual among them, which JAX rebuilds with the
attention's output product: its ``layernorm`` checkpoint)."""

CrossEntropy = Literal["fused", "jit", "eager"]
"""How the loss's element-wise work over the logits runs (priced; the emulated step is compiled by XLA): one
fused loss (XLA; Transformer Engine's cross-entropy kernels, Megatron's ``cross_entropy_fusion_impl: te``), a
few jit-fused functions over float32 logits (Megatron's ``cross_entropy_loss_fusion`` with its ``native``
implementation), or one kernel per operation in float32 (Megatron's vocab-parallel cross entropy unfused;
PyTorch's ``cross_entropy`` of upcast logits, torchtitan's)."""

OptimizerState = Literal["float32", "remainders", "bfloat16"]
"""What AdamW keeps per parameter beside the weights (priced; the emulated step keeps float32): a float32
master copy and float32 moments (Megatron's distributed optimizer, PyTorch's AdamW); the master's low 16
bits beside 16-bit weights and float32 moments (NeMo's distributed Adam, ``store_param_remainders``, with
bfloat16 weights); or bfloat16 moments and no master, the 16-bit weights updated in place (NeMo's
``optim.dtype: bf16``)."""

TaskKind = Literal["F", "B", "W"]
"""Pipeline tasks: forward, backward (input gradient when split), weight gradient (split backward only)."""

OffloadPolicy = Literal["none", "auto", "greedy", "manual"]
"""How the placement of tensor groups is chosen (:mod:`hyperjax.offload`)."""

OffloadOption = Literal["device", "host", "recompute"]
"""Where one tensor group lives during a step."""

Activation = Literal["norms", "qkv", "attn_core", "attn_out", "mlp_hidden", "mlp_act"]
"""The activations a block keeps for its backward, by the ``checkpoint_name`` the models tag them with:
the norms' inputs and outputs, the queries, keys and values, the attention core's probabilities (its
softmax statistics with a fused kernel), the output projection's input, the MLP's input projections'
outputs (with a mixture of experts' dispatched rows and expert outputs) and its activation function's
output. The block input (``block_in``) is the rematerialisation boundary: never recomputed, it is placed on
the device or the host only (:mod:`hyperjax.offload.placement`).
Megatron-Core's ``--recompute-modules`` map onto them: ``core_attn`` is ``attn_core``, ``layernorm`` is
``norms``, ``moe_act`` and the MLP's activation are ``mlp_act``, ``mla_up_proj`` is ``qkv``."""

ModuleName = Literal["decoder", "encoder", "language_model"]
"""The modules a stage runs: a language model alone, or a vision-language model's encoder and language model."""

DataSource = Literal["text", "synthetic"]
"""Training data: the shipped corpus as bytes, or a learnable synthetic token sequence."""

Family = Literal["gpt", "llama"]
"""Model presets: each fills the architecture fields it is known by (see :class:`hyperjax.config.ModelConfig`)."""

Norm = Literal["layernorm", "rmsnorm"]
MLPKind = Literal["gelu", "relu", "swiglu", "geglu"]
"""``swiglu`` and ``geglu`` are gated: three matrices (input, gate, output) instead of two."""

Positions = Literal["learned", "rope"]

RopeType = Literal["linear", "llama3", "yarn"]
"""How ``model.rope_scaling`` stretches rotary frequencies."""
AttentionKind = Literal["mha", "mla"]
"""``mha``: multi-head (or grouped-query) attention; ``mla``: DeepSeek's multi-head latent attention."""

AttentionKernel = Literal["materialized", "flash"]
"""How the attention core runs: ``materialized`` computes and keeps every score and softmax probability
(``s x s`` per head and sequence: Megatron before fused attention, and Korthikanti et al.'s accounting);
``flash`` is one fused kernel (FlashAttention, cuDNN's fused attention, TPU splash attention) that keeps
nothing quadratic, skips the blocks a causal mask hides and recomputes the scores in its backward."""

Router = Literal["softmax", "sigmoid"]
"""How an MoE router scores experts: softmax over all of them (Mixtral, Qwen3, Switch), or a sigmoid per
expert (DeepSeek-V3); either way the top-k weights are normalised over the k chosen."""

Balance = Literal["aux_loss", "bias"]
"""How an MoE router is kept balanced: an auxiliary loss (Switch/GShard), or DeepSeek-V3's
auxiliary-loss-free per-expert bias, nudged after every step towards the mean load."""
Placement = Literal["colocated", "disaggregated"]
"""Where reinforcement learning's two phases run: ``colocated``, in turn on all devices (the weights resharded
from the learner's layout to the rollout's each iteration); ``disaggregated``, each on devices of its own."""
Residence = Literal["device", "host"]
"""Where a tensor group waits between its uses: device memory, or host memory (fetched over the host link)."""
RLAlgorithm = Literal["grpo"]
"""The policy-gradient loss of reinforcement learning (:mod:`hyperjax.rl.losses`)."""
BlockLayout = Literal["sequential", "parallel"]
"""``sequential``: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; ``parallel`` (GPT-J, PaLM): one norm,
``x + attn(norm(x)) + mlp(norm(x))``."""

ACTIVATIONS: tuple[Activation, ...] = typing.get_args(Activation)


def recomputed(recompute: Recompute, modules: tuple[Activation, ...] | None = None) -> tuple[Activation, ...]:
    """The activations a block recomputes under ``recompute``: none; ``modules`` (the attention core when
    ``None``) for ``selective``; all of them for ``full``."""
    if recompute == "none":
        return ()
    if recompute == "full":
        return ACTIVATIONS
    return ("attn_core",) if modules is None else tuple(a for a in ACTIVATIONS if a in modules)


GATED: tuple[MLPKind, ...] = ("swiglu", "geglu")


def choices(vocabulary: object) -> tuple[str, ...]:
    """The words of a ``Literal`` vocabulary, in order."""
    return typing.get_args(vocabulary)
