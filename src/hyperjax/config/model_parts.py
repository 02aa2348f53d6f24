"""Two sections inside ``model:``: rotary scaling for long contexts (``model.rope_scaling``) and a mixture of
experts (``model.moe``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

from hyperjax.config.checks import Filled, check_fields, positive
from hyperjax.config.types import Balance, RopeType, Router
from hyperjax.errors import ConfigError

BALANCE_DEFAULTS: Mapping[str, float] = {"aux_loss_weight": 0.01, "bias_update_rate": 0.001}
"""Each balance method's setting left null: Switch Transformer's auxiliary-loss weight (1e-2); DeepSeek-V3's
bias update speed (1e-3, its report's gamma)."""


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
class MoEConfig(Filled):
    """Mixture-of-experts MLPs (``model.moe:``): each token goes to ``top_k`` of ``experts`` routed experts,
    plus ``shared_experts`` every token uses, in the layers ``first_dense`` and ``every`` pick. Change one with
    :meth:`replace` (a ``balance`` change then takes the new method's default setting)."""

    FILLED: ClassVar[frozenset[str]] = frozenset({"aux_loss_weight", "bias_update_rate"})  # the balance's own

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
        self.note_open()
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
