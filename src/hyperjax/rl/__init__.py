"""Reinforcement learning with rollouts and learning on their own submeshes (HyperMPMD for agentic models).

Built from what sits below it: the rollout decodes with :mod:`hyperjax.models.decode`, the learner steps with
:mod:`hyperjax.train.step` and a policy-gradient loss, and both phases are resolved runs
(:func:`hyperjax.resolver.resolve_rl`).
"""

from hyperjax.rl.loop import RLResult, learner_batch, prompts_of, train_rl
from hyperjax.rl.losses import LOSSES, group_advantages, grpo_loss
from hyperjax.rl.phases import Learner, Rollout, build_learner, build_rollout, hand_over
from hyperjax.rl.rewards import BUILTIN, load_reward

__all__ = [
    "BUILTIN",
    "LOSSES",
    "Learner",
    "RLResult",
    "Rollout",
    "build_learner",
    "build_rollout",
    "group_advantages",
    "grpo_loss",
    "hand_over",
    "learner_batch",
    "load_reward",
    "prompts_of",
    "train_rl",
]
