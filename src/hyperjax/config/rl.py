"""A resolved reinforcement-learning run (``rl:``): a rollout phase that samples completions and a learning
phase that trains on them, each an ordinary :class:`hyperjax.Run` on its own devices (or both on all of them).

The config asks (:class:`hyperjax.config.RLConfig`); :func:`hyperjax.resolver.resolve_rl` decides every open
value, once, into an :class:`RLRun`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyperjax.config.run import Run
from hyperjax.config.sections import Config, RLConfig
from hyperjax.errors import ConfigError, expect


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLRun:
    """An ``rl:`` config resolved: the two phases as runs of their own, and where they lie.

    Attributes:
      config: the config as read (its ``rl`` section).
      devices: devices of the whole job.
      rollout: the rollout phase's run (its layout generates; ``serve`` holds what it generates).
      learner: the learning phase's run (``train.global_batch`` is ``prompts_per_step x group_size``).
      rollout_first: the first device of the rollout's submesh (0 when colocated).
      learner_first: the first device of the learner's submesh (0 when colocated).
      prompt_len: prompt tokens per completion.
      processes: emulating processes (1; ``None`` when this machine cannot emulate the job).
      emulation_limit: why this machine cannot emulate it, or ``None``.
    """

    config: Config
    devices: int
    rollout: Run
    learner: Run
    rollout_first: int
    learner_first: int
    prompt_len: int
    processes: int | None
    emulation_limit: str | None

    @property
    def rl(self) -> RLConfig:
        return self.config.rl

    @property
    def colocated(self) -> bool:
        return self.rl.placement == "colocated"

    @property
    def hardware(self) -> Any:
        return self.learner.hardware

    @property
    def sequences(self) -> int:
        """Completions per iteration."""
        return self.rl.prompts_per_step * self.rl.group_size

    @property
    def wave(self) -> int:
        """Completions the rollout decodes together (``rl.rollout_batch``, else all of an iteration's padded to
        a multiple of its data-parallel replicas): the rollout's ``serve.batch``."""
        return self.rollout.config.serve.batch

    @property
    def waves(self) -> int:
        """Waves of decoding per iteration (the last one padded when the wave does not divide them)."""
        return -(-self.sequences // self.wave)

    def to_dict(self) -> dict[str, Any]:
        """The ``"rl"`` object of ``predict --json`` and ``train --plan-only --json``."""
        r = self.rl
        phase = lambda run, first: {"first_device": first, **run.to_dict()}
        return {
            "algorithm": r.algorithm,
            "placement": r.placement,
            "devices": self.devices,
            "processes": self.processes,
            "group_size": r.group_size,
            "prompts_per_step": r.prompts_per_step,
            "prompt_len": self.prompt_len,
            "max_new_tokens": r.max_new_tokens,
            "rollout_batch": self.wave,
            "updates": r.updates,
            "max_staleness": r.max_staleness,
            "reference": r.reference if r.kl_coef else None,
            "offload_optimizer": r.offload_optimizer,
            "reward": r.reward,
            "rollout": phase(self.rollout, self.rollout_first),
            "learner": phase(self.learner, self.learner_first),
            "emulation_limit": self.emulation_limit,
        }

    def describe(self) -> str:
        """``grpo disaggregated: rollout 4 devices (tensor=2, data=2) | learner 4 devices (fsdp=4)``."""
        r = self.rl
        stale = ", one update stale" if r.max_staleness else ""
        rollout = f"rollout {self.rollout.devices} devices ({self.rollout.describe(serving=True)})"
        learner = f"learner {self.learner.devices} devices ({self.learner.describe()})"
        return f"{r.algorithm} {r.placement}{stale}: {rollout} | {learner}"


def check_run(run: object, function: str, rl_function: str | None = None) -> None:
    """``run`` is what ``function`` takes: a resolved :class:`Run` of a supervised config.

    Raises:
      ConfigError: a :class:`Config` not yet resolved, an :class:`RLRun`, another value, or a run resolved
        from a config with an ``rl:`` section (``function`` would train or price it as supervised training);
        naming ``rl_function``, what takes those instead.
    """
    instead = f"hyperjax.{rl_function}" if rl_function else "hyperjax.resolve_rl, whose phases are runs of their own"
    if isinstance(run, RLRun):
        raise ConfigError(f"{function}(run) takes a supervised Run, not an RLRun; an rl: config's goes to {instead}")
    if isinstance(run, Config):
        raise ConfigError(f"{function}(run) takes a resolved Run, not a Config; pass hyperjax.resolve(config)")
    expect(run, Run, f"{function}(run): run", "pass hyperjax.resolve(config)")
    if run.config.rl is not None:
        raise ConfigError(
            f"{function}(run): the run's config has an rl: section, which {function} would run as supervised "
            f"training; resolve it with hyperjax.resolve_rl and use {instead}"
        )
