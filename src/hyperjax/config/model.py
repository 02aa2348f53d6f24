"""The model's description: its shape and its parts, one frozen dataclass with a comment per field.

An architecture is described by its parts (norm, MLP kind, positions, block layout, biases, tied
embeddings, head width), which the NNX models and the cost model both read. ``family`` is a preset that
fills the parts not given: ``gpt`` is nanoGPT's GPT-2 (LayerNorm, GELU, learned positions, biases, tied
embeddings), ``llama`` is Llama's (RMSNorm, SwiGLU, rotary positions, no biases, a separate head).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hyperjax.config.checks import check_fields, positive
from hyperjax.config.types import (
    GATED,
    AttentionKernel,
    AttentionKind,
    Balance,
    BlockLayout,
    Family,
    MLPKind,
    Norm,
    Positions,
    RopeType,
    Router,
)
from hyperjax.errors import ConfigError

FAMILY_PARTS: Mapping[str, Mapping[str, Any]] = {
    "gpt": {
        "norm": "layernorm",
        "mlp": "gelu",
        "positions": "learned",
        "tie_embeddings": True,
        "bias": True,
        "norm_eps": 1e-5,
    },
    "llama": {
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "positions": "rope",
        "tie_embeddings": False,
        "bias": False,
        "norm_eps": 1e-6,
    },
}
"""What each family preset fills in (a part given in the config wins)."""

ROPE_THETA = 10000.0
"""``model.rope_theta`` left null under rotary positions: the base of the RoFormer paper, GPT-NeoX and Llama 1-2."""

BALANCE_DEFAULTS: Mapping[str, float] = {"aux_loss_weight": 0.01, "bias_update_rate": 0.001}
"""Each balance method's setting left null: Switch Transformer's auxiliary-loss weight (1e-2); DeepSeek-V3's
bias update speed (1e-3, its report's gamma)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """A ViT image encoder whose patch tokens prefix the language model's input (``model.vision:``)."""

    layers: int = 2  # encoder blocks (bidirectional attention, LayerNorm, GELU MLP)
    d_model: int = 128  # encoder width
    heads: int = 4  # encoder attention heads
    d_ff: int = 512  # encoder MLP hidden width
    image_size: int = 16  # square images of image_size x image_size pixels
    patch: int = 4  # square patches of patch x patch pixels, one token each
    channels: int = 3  # colour channels

    def __post_init__(self) -> None:
        check_fields(self, "model.vision")
        positive(self, "model.vision", ("layers", "d_model", "heads", "d_ff", "image_size", "patch", "channels"))
        if self.d_model % self.heads:
            raise ConfigError(
                f"model.vision.d_model={self.d_model} is not divisible by model.vision.heads={self.heads}"
            )
        if self.image_size % self.patch:
            raise ConfigError(
                f"model.vision.image_size={self.image_size} is not a multiple of model.vision.patch={self.patch}"
            )

    @property
    def patches(self) -> int:
        """Patch tokens per image."""
        return (self.image_size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        """Pixels times channels of one patch."""
        return self.patch * self.patch * self.channels

    def as_model(self, d_out: int = 1) -> ModelConfig:
        """The encoder's blocks as a GPT-style model config over the patch tokens (``vocab``: ``d_out``)."""
        return ModelConfig(
            family="gpt",
            layers=self.layers,
            d_model=self.d_model,
            heads=self.heads,
            d_ff=self.d_ff,
            vocab=d_out,
            seq_len=self.patches,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (``model.rope_scaling:``), as Hugging Face's
    ``rope_scaling`` names them: ``linear`` divides every frequency by ``factor``; ``llama3`` (Llama 3.1)
    divides the low frequencies (wavelengths past ``original_max_position / low_freq_factor``) by
    ``factor``, keeps the high ones (wavelengths under ``original_max_position / high_freq_factor``) and
    blends between them; ``yarn`` (YaRN, DeepSeek-V3) blends divided and kept frequencies over a ramp
    between ``beta_slow`` and ``beta_fast`` rotations of the original context and scales the rotated
    vectors by its attention factor (and, under latent attention with ``mscale_all_dim``, the scores by
    that factor squared, as DeepSeek-V3 does)."""

    type: RopeType = "llama3"  # linear | llama3 | yarn
    factor: float = 8.0  # how much longer the context is than the one trained on
    low_freq_factor: float = 1.0  # llama3: where the stretched band starts
    high_freq_factor: float = 4.0  # llama3: where the kept band starts
    original_max_position: int = 8192  # llama3, yarn: the context length the frequencies were trained for
    beta_fast: float = 32.0  # yarn: rotations over the original context above which frequencies are kept
    beta_slow: float = 1.0  # yarn: rotations below which they are divided by factor
    mscale: float | None = None  # yarn: the attention factor's log-scale weight (null: 1)
    mscale_all_dim: float | None = None  # yarn: the same, over every dimension (DeepSeek-V3: 1.0)

    def __post_init__(self) -> None:
        check_fields(self, "model.rope_scaling")
        positive(self, "model.rope_scaling", ("original_max_position",))
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"model.rope_scaling.{key}={getattr(self, key)} must be > 0")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                f"{self.low_freq_factor} (the blended band lies between them)"
            )

    @staticmethod
    def _log_scale(factor: float, weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """What YaRN multiplies the rotated queries and keys by (1 for the other types)."""
        if self.type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._log_scale(self.factor, self.mscale) / self._log_scale(self.factor, self.mscale_all_dim)
        return self._log_scale(self.factor, 1.0)

    @property
    def latent_score_scale(self) -> float:
        """What latent attention multiplies its scores by (DeepSeek-V3's ``mscale_all_dim`` squared)."""
        if not self.mscale_all_dim:
            return 1.0
        return self._log_scale(self.factor, self.mscale_all_dim) ** 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts MLPs (``model.moe:``): each token goes to ``top_k`` of ``experts`` routed experts,
    plus ``shared_experts`` every token uses, in the layers ``first_dense`` and ``every`` pick."""

    experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # routed experts per token
    shared_experts: int = 0  # experts every token uses (DeepSeek); 0 for none
    d_ff: int = 512  # hidden width of one expert (gated as model.mlp says)
    capacity_factor: float | None = None  # null: dropless; c: an expert takes at most c*tokens*top_k/experts
    router: Router = "softmax"  # softmax | sigmoid (DeepSeek-V3: sigmoid scores, normalised over the top-k)
    balance: Balance = "aux_loss"  # aux_loss (weight aux_loss_weight) | bias (auxiliary-loss-free bias update)
    aux_loss_weight: float | None = None  # weight of the load-balancing loss (balance: aux_loss); null: 0.01
    bias_update_rate: float | None = None  # how far each expert's bias moves per step (balance: bias); null: 0.001
    normalize_top_k: bool = True  # the k routing weights are divided by their sum (Switch's top-1: false)
    load_imbalance: float | None = None  # cost model: busiest device's routed tokens / the mean; null: from balance
    first_dense: int = 0  # leading dense layers (DeepSeek-V3: 3)
    every: int = 1  # an MoE layer every n-th layer after those (GShard/Switch style: 2)
    groups: int = 1  # experts in this many equal groups; a token picks among its group_top_k best groups
    group_top_k: int | None = None  # groups a token may use (a group ranks by its two best scores); null: all
    routed_scaling: float = 1.0  # the routed experts' weights are multiplied by this (DeepSeek-V3: 2.5)

    def __post_init__(self) -> None:
        check_fields(self, "model.moe")
        positive(self, "model.moe", ("experts", "top_k", "d_ff", "every"))
        if self.top_k > self.experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.experts={self.experts}: a token cannot go to more "
                f"experts than there are; choose top_k <= {self.experts}"
            )
        for key in ("shared_experts", "first_dense"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"model.moe.{key}={value!r} must be an integer >= 0")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(
                f"model.moe.capacity_factor={self.capacity_factor} must be > 0 (each expert's share of the tokens, "
                "times this), or null for dropless routing"
            )
        self._check_balance()
        self._check_groups()
        if self.load_imbalance is not None and not self.load_imbalance >= 1:
            raise ConfigError(
                f"model.moe.load_imbalance={self.load_imbalance} must be >= 1 (the busiest device's routed tokens "
                "over the mean), or null for the balance method's default"
            )

    def _check_balance(self) -> None:
        """Each balance method's own setting: given under the other method it would do nothing, so it is refused;
        left null it takes its default (DeepSeek-V3's bias update rate)."""
        if self.balance == "aux_loss":
            own, other, method, lacks = "aux_loss_weight", "bias_update_rate", "bias", "keeps no routing bias"
        else:
            own, other, method, lacks = "bias_update_rate", "aux_loss_weight", "aux_loss", "adds no auxiliary loss"
        if getattr(self, other) is not None:
            raise ConfigError(
                f"model.moe.{other}={getattr(self, other)} applies to model.moe.balance={method}, but "
                f"model.moe.balance={self.balance!r} {lacks}; remove model.moe.{other} (or set it to null), or set "
                f"model.moe.balance: {method}"
            )
        if getattr(self, own) is None:
            object.__setattr__(self, own, BALANCE_DEFAULTS[own])
        if not getattr(self, own) >= 0:
            raise ConfigError(f"model.moe.{own}={getattr(self, own)} must be >= 0")

    def _check_groups(self) -> None:
        positive(self, "model.moe", ("groups",))
        positive(self, "model.moe", ("group_top_k",), optional=True)
        if not self.routed_scaling > 0:
            raise ConfigError(f"model.moe.routed_scaling={self.routed_scaling} must be > 0")
        if self.groups == 1:
            if self.group_top_k not in (None, 1):
                raise ConfigError(
                    f"model.moe.group_top_k={self.group_top_k} keeps that many of model.moe.groups=1 expert group; "
                    "set it to 1 or null, or split the experts into groups with model.moe.groups"
                )
            return
        per = self.experts // self.groups
        if self.experts % self.groups or per < 2:
            raise ConfigError(
                f"model.moe.groups={self.groups} must split model.moe.experts={self.experts} into equal groups of "
                "two or more (a group ranks by its two best scores)"
            )
        kept = self.groups if self.group_top_k is None else self.group_top_k
        if kept > self.groups or self.top_k > kept * per:
            raise ConfigError(
                f"model.moe.group_top_k={self.group_top_k} must be at most model.moe.groups={self.groups} and keep "
                f"at least model.moe.top_k={self.top_k} experts ({per} per group)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer (the ``model:`` section of a config): its shape and its parts.

    Parts left ``null`` are filled by the ``family`` preset when the config is read (:data:`FAMILY_PARTS`),
    so every field of a constructed ``ModelConfig`` is explicit.
    """

    family: Family = "gpt"  # preset for the parts below: gpt (GPT-2 style) or llama
    layers: int = 4  # transformer blocks
    d_model: int = 256  # residual stream width
    heads: int = 8  # query heads
    kv_heads: int | None = None  # key/value heads (grouped-query attention); null: as many as heads
    head_dim: int | None = None  # width of one head (attention's inner width is heads x head_dim); null: d_model/heads
    d_ff: int = 1024  # MLP hidden width
    vocab: int = 256  # vocabulary size (256 for byte-level text)
    seq_len: int = 128  # tokens per sequence (text tokens; a vision model's patch tokens come in front)
    norm: Norm | None = None  # layernorm (scale and, with bias, shift) or rmsnorm (scale); null: the family's
    mlp: MLPKind | None = None  # gelu, relu, or the gated swiglu, geglu (three matrices); null: the family's
    positions: Positions | None = None  # learned (a table of seq_len rows) or rope; null: the family's
    rope_theta: float | None = None  # rotary base frequency (positions: rope); null: 10000
    tie_embeddings: bool | None = None  # the output projection is the embedding table; null: the family's
    bias: bool | None = None  # biases on every projection and LayerNorm shifts; null: the family's
    qkv_bias: bool | None = None  # biases on the query, key and value projections; null: as bias (Qwen2: true)
    qk_norm: bool = False  # queries and keys each normalised per head (model.norm over head_dim) before rotary (Qwen3)
    norm_eps: float | None = None  # the norms' epsilon; null: the family's (gpt 1e-5, llama 1e-6)
    rope_scaling: RopeScaling | None = None  # rotary frequencies stretched for long contexts (Llama 3.1)
    rope_interleave: bool = False  # rotary pairs are neighbours (2i, 2i+1) as in DeepSeek, not halves (i, i+d/2)
    block: BlockLayout = "sequential"  # sequential (pre-norm attention then MLP) or parallel (GPT-J / PaLM)
    attention: AttentionKind = "mha"  # mha (multi-head / grouped-query) or mla (DeepSeek's latent attention)
    attention_kernel: AttentionKernel = "materialized"  # materialized (scores kept) or flash (one fused kernel)
    attention_impl: str | None = None  # flash: the fused kernel priced (a name in the preset's attention_kernels)
    kv_lora_rank: int | None = None  # mla: width of the compressed keys and values (DeepSeek-V3: 512)
    q_lora_rank: int | None = None  # mla: width of the compressed queries; null: queries not compressed
    rope_head_dim: int | None = None  # mla: rotary dimensions per head, apart from head_dim (DeepSeek-V3: 64)
    moe: MoEConfig | None = None  # mixture-of-experts MLPs; null: dense
    vision: VisionConfig | None = None  # an image encoder in front of the language model (positions: rope)

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.attention_impl is not None and self.attention_kernel != "flash":
            raise ConfigError(
                f"model.attention_impl={self.attention_impl!r} names a fused attention kernel, but "
                f"model.attention_kernel={self.attention_kernel!r} keeps its scores; set model.attention_kernel: flash "
                "or remove model.attention_impl"
            )
        positive(self, "model", ("layers", "d_model", "heads", "d_ff", "vocab", "seq_len"))
        positive(self, "model", ("kv_heads", "head_dim"), optional=True)
        for key, value in FAMILY_PARTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)  # the preset fills what the config leaves open
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)
        if not self.norm_eps > 0:
            raise ConfigError(
                f"model.norm_eps={self.norm_eps} must be > 0 (RMSNorm and LayerNorm add it to the variance)"
            )
        if self.rope_interleave and self.positions != "rope":
            raise ConfigError(
                f"model.rope_interleave pairs rotary dimensions, but model.positions={self.positions!r}; set "
                "model.positions: rope or model.rope_interleave: false"
            )
        if self.rope_scaling is not None and self.positions != "rope":
            raise ConfigError(
                f"model.rope_scaling stretches rotary positions, but model.positions={self.positions!r}; "
                "set model.positions: rope or remove model.rope_scaling"
            )
        if self.head_dim is None:
            if self.d_model % self.heads:
                raise ConfigError(
                    f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}; choose heads "
                    "that divide d_model, or give model.head_dim"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.heads)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads} "
                "(each key/value head serves a group of query heads), or be null for multi-head attention"
            )
        if self.positions != "rope" and self.rope_theta is not None:
            raise ConfigError(
                f"model.rope_theta={self.rope_theta} is the rotary base frequency, but model.positions="
                f"{self.positions!r}; remove model.rope_theta (or set it to null), or set model.positions: rope"
            )
        if self.positions == "rope" and self.rope_theta is None:
            object.__setattr__(self, "rope_theta", ROPE_THETA)
        if self.rope_theta is not None and not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0")
        if self.positions == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"model.positions=rope rotates pairs of a head's dimensions, but model.head_dim={self.head_dim} "
                "is odd; use an even head_dim"
            )
        if self.vision is not None and self.positions != "rope":
            raise ConfigError(
                f"model.vision needs model.positions: rope (rotary positions cover the image tokens; "
                f"model.family: llama sets it); got {self.positions!r}"
            )
        self._check_latent_attention()
        if self.moe is not None and self.moe.first_dense >= self.layers:
            raise ConfigError(
                f"model.moe.first_dense={self.moe.first_dense} leaves no MoE layer among model.layers={self.layers}; "
                "lower first_dense, or set model.moe: null for a dense model"
            )
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:  # computed once: the cost model keys its caches by model
        return self._hash

    def _check_latent_attention(self) -> None:
        mla = {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank, "rope_head_dim": self.rope_head_dim}
        positive(self, "model", tuple(mla), optional=True)
        if self.attention == "mha":
            given = [k for k, v in mla.items() if v is not None]
            if given:
                raise ConfigError(f"model.{given[0]} is given but model.attention=mha; set model.attention: mla")
            return
        for key in ("kv_lora_rank", "rope_head_dim"):
            if mla[key] is None:
                raise ConfigError(
                    f"model.attention=mla needs model.{key} (DeepSeek-V3: kv_lora_rank 512, rope_head_dim 64)"
                )
        if self.rope_head_dim % 2 or self.positions != "rope":
            raise ConfigError(
                f"model.attention=mla rotates model.rope_head_dim={self.rope_head_dim} dimensions per head: it must be "
                f"even and model.positions must be rope (got {self.positions!r})"
            )
        if self.bias or self.qkv_bias or self.qk_norm:
            raise ConfigError(
                "model.attention=mla has no biases and no per-head query/key norms (as in DeepSeek-V2/V3); set "
                "model.bias, model.qkv_bias and model.qk_norm to false"
            )
        if self.kv_heads != self.heads:
            raise ConfigError(
                f"model.attention=mla gives every query head its own keys and values from the latent; "
                f"model.kv_heads={self.kv_heads} must be null or model.heads={self.heads}"
            )

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture-of-experts MLP."""
        m = self.moe
        return m is not None and layer >= m.first_dense and (layer - m.first_dense) % m.every == 0

    @property
    def moe_layers(self) -> int:
        """Blocks with a mixture-of-experts MLP."""
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads actually used."""
        return self.kv_heads

    @property
    def attn_width(self) -> int:
        """Attention's inner width: query heads x head width."""
        return self.heads * self.head_dim

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (three matrices)."""
        return self.mlp in GATED
