"""The sections of a run config (``configs/*.yaml``): frozen dataclasses with a comment per field.

A config says what a person asks for; ``null`` means "infer", and :func:`hyperjax.resolve` decides every
inferred value, once, into a :class:`hyperjax.Run`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from hyperjax.config.checks import check_fields, positive
from hyperjax.config.model import ModelConfig
from hyperjax.config.parallel import MPMDConfig, ParallelConfig, check_sequence_parallel
from hyperjax.config.types import (
    ACTIVATIONS,
    Activation,
    CrossEntropy,
    DataSource,
    DType,
    Elementwise,
    Fp8Format,
    Fp8Recipe,
    OffloadOption,
    OffloadPolicy,
    OptimizerState,
    Placement,
    Recompute,
    Reforward,
    Residence,
    RLAlgorithm,
    choices,
)
from hyperjax.errors import ConfigError

SEED_LIMIT = 2**63
"""Seeds are below it: JAX's and NumPy's generators take a 64-bit signed integer."""

STEP_LIMIT = 2**31
"""Steps are below it: the optimizer's step counter is a 32-bit integer inside the compiled step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmulateConfig:
    """The emulated machine (``emulate:``)."""

    devices: int | None = None  # devices of the run; null: the product of the degrees when all are given, else 8
    processes: int | None = None  # processes to emulate them in; null: the fewest that work on this machine

    def __post_init__(self) -> None:
        check_fields(self, "emulate")
        positive(self, "emulate", ("devices", "processes"), optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """FP8 products (``train.fp8``): every linear layer of a block multiplies in FP8; ``train.dtype`` stays the
    precision of everything else (the attention core, norms, the router, the embedding)."""

    recipe: Fp8Recipe = "tensorwise"  # how operands are scaled: tensorwise, delayed, rowwise or blockwise
    format: Fp8Format = "hybrid"  # hybrid: E4M3 forward, E5M2 gradients; e4m3: E4M3 throughout
    output_layer: bool = False  # the output projection (the head) in FP8 too
    all_gather: bool = False  # FSDP / ZeRO-3 gathers weights in FP8, one byte each (torchtitan's float8 all-gather)
    amax_history: int = 1024  # delayed: steps of amax history a scale is taken from (the history's maximum)
    block: int = 128  # blockwise: tile width (1 x block activations and gradients, block x block weights)

    def __post_init__(self) -> None:
        check_fields(self, "train.fp8")
        positive(self, "train.fp8", ("amax_history", "block"))
        defaults = {f.name: f.default for f in dataclasses.fields(Fp8Config)}
        for key, recipe, what in (("amax_history", "delayed", "its scales"), ("block", "blockwise", "its tiles")):
            if self.recipe != recipe and getattr(self, key) != defaults[key]:
                raise ConfigError(
                    f"train.fp8.{key}={getattr(self, key)} sets {what} for recipe {recipe} only, but "
                    f"train.fp8.recipe={self.recipe}; drop train.fp8.{key} or set train.fp8.recipe: {recipe}"
                )
        if self.all_gather and self.recipe == "rowwise":
            raise ConfigError(
                "train.fp8.all_gather=true gathers FSDP weight shards in FP8, but train.fp8.recipe=rowwise scales a "
                "weight by the rows of its whole use, which a shard cannot quantise alone; use recipe tensorwise, "
                "delayed or blockwise, or train.fp8.all_gather: false"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training run (``train:``)."""

    global_batch: int = 32  # sequences per optimizer step
    micro_batch: int | None = None  # sequences per micro-batch per data-parallel replica; null: see microbatches
    microbatches: int | None = None  # micro-batches per step; null: from micro_batch, else 1 (2 x stages piped)
    steps: int = 50  # optimizer steps
    lr: float = 3e-4  # peak learning rate (AdamW)
    warmup_steps: int | None = None  # linear warm-up steps; null: a tenth of the steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW decoupled weight decay, matrices only
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # global gradient-norm clip; 0 turns it off
    dtype: DType = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    grad_dtype: DType = "float32"  # the gradient buffer and its reduction (priced): float32 or bfloat16
    optimizer_state: OptimizerState = "float32"  # AdamW's master and moments (priced): float32, remainders, bfloat16
    elementwise: Elementwise = "fused"  # the blocks' element-wise work (priced): fused (compiled) or eager
    cross_entropy: CrossEntropy = "fused"  # the loss over the logits (priced): fused, jit or eager
    fp8: Fp8Config | None = None  # FP8 products of the blocks' linear layers (null: none); see Fp8Config
    recompute: Recompute = "none"  # activation recomputation per block: none, selective or full
    reforward: Reforward = "needed"  # what a full recomputation re-runs (priced): needed (JAX's) or whole (PyTorch's)
    recompute_modules: tuple[Activation, ...] | None = None  # what selective recomputes; null: attn_core
    seed: int = 0  # parameter initialisation and data order
    data: DataSource = "text"  # text: the shipped corpus, byte-level; synthetic: a learnable token sequence
    checkpoint_every: int = 50  # steps between checkpoints (written only when --checkpoint-dir is given)
    keep_checkpoints: int = 3  # the newest checkpoints kept; older ones are deleted

    def __post_init__(self) -> None:
        check_fields(self, "train")
        positive(self, "train", ("global_batch", "steps", "checkpoint_every", "keep_checkpoints"))
        positive(self, "train", ("micro_batch", "microbatches"), optional=True)
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"train.seed={self.seed} must be in [0, 2**63) (it seeds JAX's and NumPy's generators)")
        if self.steps >= STEP_LIMIT:
            raise ConfigError(f"train.steps={self.steps} must be below 2**31 (the step counter is a 32-bit integer)")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps={self.steps}]")
        for key in ("min_lr_ratio", "beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1 + (key == "min_lr_ratio"):
                raise ConfigError(f"train.{key}={getattr(self, key)} is out of range [0, 1]")
        unknown = sorted(set(self.recompute_modules or ()) - set(ACTIVATIONS))
        if unknown or self.recompute_modules == ():
            raise ConfigError(
                f"train.recompute_modules={list(self.recompute_modules or ())} must name one or more of "
                f"{list(ACTIVATIONS)} (unknown: {unknown}); null recomputes the attention core"
            )
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ConfigError(
                f"train.recompute_modules={list(self.recompute_modules)} names what selective recomputation "
                f"recomputes, but train.recompute={self.recompute!r}; set train.recompute: selective or drop the key"
            )
        if self.dtype == "float32" and self.optimizer_state != "float32":
            raise ConfigError(
                f"train.optimizer_state={self.optimizer_state!r} keeps 16-bit weights beside the optimizer state, "
                "but train.dtype=float32 keeps float32 weights; set train.dtype: bfloat16 or "
                "train.optimizer_state: float32"
            )
        for key in ("weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 0 (0 turns it off)")

    @property
    def warmup(self) -> int:
        """Warm-up steps actually used."""
        return self.steps // 10 if self.warmup_steps is None else self.warmup_steps


MIN_TEMPERATURE = 1e-6
"""The least positive sampling temperature: below it sampling is greedy's argmax wherever two logits differ by
more than 1e-4 (their ratio of probabilities under ``exp`` underflows float32), and far below it ``logits / T``
itself overflows float32 into NaN; 0 asks for greedy decoding."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where each tensor group lives during a step (``offload:``; see :mod:`hyperjax.offload`)."""

    policy: OffloadPolicy = "none"  # none: train.recompute decides; auto: the exact pass; greedy; manual
    device_memory_gib: float | None = None  # the device-memory budget; null: the HBM less reserved_bytes
    prefetch: int = 1  # layers of compute a host transfer may overlap (0: fetched when needed)
    manual: Mapping[str, OffloadOption] = dataclasses.field(default_factory=dict)  # group pattern -> option

    def __post_init__(self) -> None:
        check_fields(self, "offload")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ConfigError(f"offload.device_memory_gib={self.device_memory_gib} must be > 0 (GiB per device)")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ConfigError(f"offload.prefetch={self.prefetch!r} must be an integer >= 0 (layers)")
        for pattern, option in self.manual.items():
            if not isinstance(pattern, str):
                raise ConfigError(
                    f"offload.manual key {pattern!r} must be a group pattern (a string), e.g. layers.*.optimizer"
                )
            if option not in choices(OffloadOption):
                raise ConfigError(f"offload.manual[{pattern!r}]={option!r} is not one of {choices(OffloadOption)}")
        if self.manual and self.policy != "manual":
            raise ConfigError(f"offload.manual is given but offload.policy={self.policy!r}; set offload.policy: manual")
        if self.policy == "none" and self.prefetch != OffloadConfig.prefetch:
            raise ConfigError(
                f"offload.prefetch={self.prefetch} sets the layers a host transfer of the placement pass may overlap, "
                "but offload.policy='none' places nothing on the host; remove offload.prefetch, or set "
                "offload.policy: auto, greedy or manual"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What a serving deployment is sized for (``serve:``), read by ``predict --inference``."""

    batch: int | None = None  # sequences decoded together over all data-parallel replicas; null: one per replica
    prompt_len: int | None = None  # prompt tokens per sequence; null: half of model.seq_len
    new_tokens: int | None = None  # tokens generated per sequence; null: the rest of model.seq_len

    def __post_init__(self) -> None:
        check_fields(self, "serve")
        positive(self, "serve", ("batch", "prompt_len", "new_tokens"), optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseConfig:
    """One phase's devices and layout (``rl.rollout`` or ``rl.learner``)."""

    devices: int | None = None  # its devices; null: all (colocated), or what the other phase leaves
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)  # its degrees, as parallel: has them

    def __post_init__(self) -> None:
        check_fields(self, "rl.rollout or rl.learner")
        positive(self, "rl.rollout or rl.learner", ("devices",), optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """Reinforcement learning of the model (``rl:``): ``train.steps`` iterations, each a rollout of
    ``prompts_per_step x group_size`` sampled completions, their rewards, and ``updates`` optimizer steps on
    them."""

    algorithm: RLAlgorithm = "grpo"  # grpo: group-relative advantages, clipped ratio, KL to a frozen reference
    group_size: int = 8  # completions sampled per prompt (the group its advantages are relative to)
    prompts_per_step: int = 8  # prompts per iteration (train.global_batch is prompts_per_step x group_size)
    prompt_len: int | None = None  # prompt tokens (windows of the shipped corpus); null: seq_len - max_new_tokens
    max_new_tokens: int = 16  # tokens sampled per completion
    temperature: float = 1.0  # sampling temperature (the policy's log-probabilities are taken at it too)
    top_k: int | None = None  # sample from the top_k likeliest tokens; null: all
    rollout_batch: int | None = None  # completions decoded together (a wave); null: all of an iteration's at once
    reward: str = "letters"  # a built-in reward (hyperjax.rl.rewards.BUILTIN) or module:function
    kl_coef: float = 0.04  # weight of the KL penalty against the frozen reference model
    clip: float = 0.2  # the policy ratio is clipped to [1 - clip, 1 + clip]
    updates: int = 1  # optimizer steps on each iteration's rollouts (the ratio departs from 1 after the first)
    placement: Placement = "disaggregated"  # colocated: both phases on all devices; disaggregated: each on its own
    reference: Residence = "device"  # the frozen reference's weights: device, or host (fetched for its pass)
    offload_optimizer: bool = False  # colocated: the learner's optimizer state waits in host memory during rollouts
    max_staleness: int = 0  # 1: the next rollout runs beside learning with weights one update behind
    seed: int | None = None  # prompts and sampling; null: train.seed
    init_checkpoint: str | None = None  # start policy and reference from the newest checkpoint here; null: seed
    rollout: PhaseConfig = dataclasses.field(default_factory=PhaseConfig)
    learner: PhaseConfig = dataclasses.field(default_factory=PhaseConfig)

    def __post_init__(self) -> None:
        check_fields(self, "rl")
        positive(self, "rl", ("group_size", "prompts_per_step", "max_new_tokens", "updates"))
        positive(self, "rl", ("prompt_len", "top_k", "rollout_batch"), optional=True)
        if self.group_size < 2:
            raise ConfigError(
                f"rl.group_size={self.group_size}: GRPO's advantage is a completion's reward against its group's "
                "mean and spread, which one completion does not have; set rl.group_size: 2 or more (8 to 64 is usual)"
            )
        if not self.temperature >= MIN_TEMPERATURE or not math.isfinite(self.temperature):
            raise ConfigError(
                f"rl.temperature={self.temperature} must be a finite number >= {MIN_TEMPERATURE:g}: reinforcement "
                "learning samples, and below that float32 sampling is greedy's argmax or overflows"
            )
        if not self.kl_coef >= 0 or not 0 < self.clip < 1:
            raise ConfigError(f"rl.kl_coef={self.kl_coef} must be >= 0 and rl.clip={self.clip} in (0, 1)")
        if self.kl_coef == 0 and self.reference != "device":
            raise ConfigError(
                f"rl.reference={self.reference} places the frozen reference model, but rl.kl_coef=0 keeps none; "
                "remove rl.reference, or set rl.kl_coef > 0"
            )
        if self.max_staleness not in (0, 1):
            raise ConfigError(
                f"rl.max_staleness={self.max_staleness} must be 0 (rollouts with the newest weights) or 1 (the next "
                "rollout beside learning, one update behind)"
            )
        if self.max_staleness and self.placement == "colocated":
            raise ConfigError(
                "rl.max_staleness=1 runs the next rollout beside learning on devices of its own, but "
                "rl.placement=colocated time-shares the same devices; set rl.placement: disaggregated or "
                "rl.max_staleness: 0"
            )
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ConfigError(f"rl.seed={self.seed} must be in [0, 2**63) (or null: train.seed)")
        if self.offload_optimizer and self.placement != "colocated":
            raise ConfigError(
                "rl.offload_optimizer=true frees the learner's devices for the rollout, but rl.placement="
                f"{self.placement} gives the rollout devices of its own; set rl.placement: colocated or drop the key"
            )
        for name in ("rollout", "learner"):
            p = getattr(self, name).parallel
            where = f"rl.{name}.parallel"
            check_sequence_parallel(p, f"{where}.sequence_parallel", p.tensor, f"{where}.tensor > 1")
        if ":" not in self.reward and not self.reward:
            raise ConfigError("rl.reward is empty; name a built-in reward or give module:function")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run, as asked for."""

    hardware: str = "cloudmatrix384"  # hardware preset name or YAML path
    emulate: EmulateConfig = dataclasses.field(default_factory=EmulateConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    shard: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # logical axis -> mesh axes overrides
    mpmd: MPMDConfig = dataclasses.field(default_factory=MPMDConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    rl: RLConfig | None = None  # reinforcement learning of the model (null: supervised training)

    def check_rl_batch(self) -> None:
        """An ``rl:`` config's ``train.global_batch``, where given, is the batch its ``rl:`` section makes.

        Raises:
          ConfigError: another batch, naming the two and the fix.
        """
        if self.rl is None:
            return
        batch = self.rl.prompts_per_step * self.rl.group_size
        if self.train.global_batch != batch:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch}: an rl: config learns from rl.prompts_per_step x "
                f"rl.group_size = {self.rl.prompts_per_step} x {self.rl.group_size} = {batch} sequences a step; "
                "drop train.global_batch and set those"
            )

    def __post_init__(self) -> None:
        if isinstance(self.hardware, os.PathLike):  # a preset file's path, kept as text
            object.__setattr__(self, "hardware", os.fspath(self.hardware))
        check_fields(self, "")
        for logical, target in self.shard.items():
            if not isinstance(logical, str):
                raise ConfigError(f"shard key {logical!r} must be a logical axis name (a string), e.g. shard.mlp")
            names = [target] if isinstance(target, str) else target if isinstance(target, list | tuple) else None
            if target is not None and (names is None or not all(isinstance(a, str) for a in names)):
                raise ConfigError(
                    f"shard.{logical}={target!r} must be a mesh axis, a list of mesh axes, or null (replicated), "
                    "e.g. shard.mlp: tensor or shard.embed: [fsdp, context]"
                )
        if self.rl is not None and (self.parallel != ParallelConfig() or self.mpmd.submeshes):
            raise ConfigError(
                "an rl: config lays out each phase apart: move the parallel: section's degrees to "
                "rl.learner.parallel (and choose rl.rollout.parallel), and drop parallel: and mpmd:"
            )
        if self.train.global_batch != TrainConfig.global_batch:  # (load_config checks one given as the default)
            self.check_rl_batch()
        subs = self.mpmd.submeshes
        check_sequence_parallel(
            self.parallel,
            "parallel.sequence_parallel",
            max((sub.tensor for sub in subs), default=self.parallel.tensor),
            "an mpmd.submeshes item with tensor > 1" if subs else "parallel.tensor > 1",
        )
        moe, ep = self.model.moe, self.parallel.expert
        if ep > 1 and moe is None:
            raise ConfigError(
                f"parallel.expert={ep} shards the experts of a mixture-of-experts model, but model.moe is null; "
                "set model.moe, or parallel.expert: 1 (use parallel.data for more data parallelism)"
            )
        p = self.parallel
        if p.expert_tensor is not None and moe is None:
            raise ConfigError(
                f"parallel.expert_tensor={p.expert_tensor} lays out the experts of model.moe, which is null; remove "
                "parallel.expert_tensor"
            )
        if p.expert_tensor is not None and p.expert_tensor not in (1, p.tensor):
            raise ConfigError(
                f"parallel.expert_tensor={p.expert_tensor} must be null (experts split over the tensor axis, "
                f"{p.tensor} ways) or 1 (the tensor axis joins the expert axis inside MoE layers)"
            )
        if p.expert_tensor == 1 and p.tensor > 1:
            if not p.sequence_parallel:
                raise ConfigError(
                    f"parallel.expert_tensor=1 with parallel.tensor={p.tensor}: the tensor axis carries experts only "
                    "if each of its devices holds its own tokens; set parallel.sequence_parallel: true"
                )
            if moe.experts % (ep * p.tensor):
                raise ConfigError(
                    f"model.moe.experts={moe.experts} is not divisible by parallel.expert x parallel.tensor = "
                    f"{ep * p.tensor} (parallel.expert_tensor=1 spreads experts over both); choose degrees that "
                    f"divide {moe.experts}"
                )
        if p.context_impl == "ring" and p.context > 1 and self.model.attention_kernel != "flash":
            raise ConfigError(
                f"parallel.context_impl=ring runs a fused attention kernel per block of keys, but "
                f"model.attention_kernel={self.model.attention_kernel!r} materialises the scores; set "
                "model.attention_kernel: flash, or parallel.context_impl: allgather"
            )
        if moe is not None and moe.experts % ep:
            raise ConfigError(
                f"model.moe.experts={moe.experts} is not divisible by parallel.expert={ep}; choose an expert "
                f"degree that divides {moe.experts}"
            )
        if self.train.data == "text" and self.model.vocab < 256:
            raise ConfigError(
                f"train.data=text reads bytes (256 symbols) but model.vocab={self.model.vocab}; set model.vocab: 256 "
                "or train.data: synthetic"
            )
