"""Policy-gradient losses over sampled completions, one function per algorithm.

A loss takes the learner's batch: ``inputs`` and ``targets`` (each sequence, prompt and completion, shifted by
one), ``mask`` (1 where a target is a sampled token), ``advantages`` (one per sequence), ``old_logp`` (each
target's log-probability under the weights that started the iteration) and ``ref_logp`` (under the frozen
reference). It is a :data:`hyperjax.train.step.LossFn`, so the training step's every layout, ZeRO stage and
micro-batching carry it unchanged. Another algorithm (REINFORCE, PPO with a value head) is a function beside
these, named in :data:`LOSSES` and ``rl.algorithm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyperjax.models.layers import cross_entropy
from hyperjax.models.moe import aux_term


def token_logp(model: Any, inputs: jax.Array, targets: jax.Array, constrain: Any, temperature: float) -> tuple:
    """Each target's log-probability under ``model`` sampling at ``temperature``, ``(batch, seq)``, and the
    router stats."""
    logits, stats = model.forward(inputs, constrain)
    return -cross_entropy(logits.astype(jnp.float32) / temperature, targets), stats


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """GRPO's advantages: each reward less its group's mean, over the group's standard deviation (``ddof=1``,
    plus 1e-4, so a group of equal rewards gets advantage 0). Groups are consecutive."""
    r = rewards.reshape(-1, group_size)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def grpo_loss(*, clip: float, kl_coef: float, temperature: float) -> Callable[..., Any]:
    """GRPO's loss (Shao et al., 2024, eq. 3): per sampled token, the clipped policy-ratio objective
    ``min(r A, clip(r, 1 - clip, 1 + clip) A)`` less ``kl_coef`` times the unbiased KL estimate
    ``exp(ref - logp) - (ref - logp) - 1``, averaged over each completion's tokens, then over completions;
    the loss is its negation (plus a mixture of experts' balancing term).

    Reported: ``loss``, ``kl`` (the estimate's mean over sampled tokens) and ``clip_fraction`` (the share of
    sampled tokens whose ratio the clip holds back)."""

    def loss(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], constrain: Any) -> Any:
        model = nnx.merge(graphdef, params)
        logp, stats = token_logp(model, batch["inputs"], batch["targets"], constrain, temperature)
        mask, adv = batch["mask"], batch["advantages"][:, None]
        ratio = jnp.exp(logp - batch["old_logp"])
        clipped = jnp.clip(ratio, 1 - clip, 1 + clip)
        objective = jnp.minimum(ratio * adv, clipped * adv)
        delta = batch["ref_logp"] - logp
        kl = jnp.exp(delta) - delta - 1
        held = ((ratio < 1 - clip) & (adv < 0)) | ((ratio > 1 + clip) & (adv > 0))
        per_row = lambda x: (x * mask).sum(1) / mask.sum(1)
        policy = -per_row(objective - kl_coef * kl).mean()
        measured = {"loss": policy, "kl": per_row(kl).mean(), "clip_fraction": per_row(held.astype(jnp.float32)).mean()}
        return policy + aux_term(model.cfg.moe, stats), (measured, stats)

    return loss


LOSSES: dict[str, Callable[..., Any]] = {"grpo": grpo_loss}
"""The loss of each ``rl.algorithm``."""

FEEDS = {"mask": 2, "advantages": 1, "old_logp": 2, "ref_logp": 2}
"""The learner batch's entries beyond the tokens, by rank (split over the batch axes)."""
