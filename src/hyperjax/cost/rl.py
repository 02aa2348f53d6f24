"""A reinforcement-learning iteration on real hardware: rollout, learning, the weights' hand-over, idle time.

- **Rollout**: serving ``prompts_per_step x group_size`` completions on the rollout's layout, as
  ``predict --inference`` prices it (:func:`hyperjax.cost.estimate_inference`), in waves of
  ``rl.rollout_batch``: each wave's prefill, then ``max_new_tokens`` decode steps.
- **Learning**: two forward passes over every sequence on the learner's layout (each sampled token's
  log-probability under the learner's weights and under the frozen reference; one when ``rl.kl_coef`` is 0),
  priced as a prefill of the whole sequence, then ``rl.updates`` training steps (:func:`hyperjax.cost.estimate`).
  A reference kept in host memory (``rl.reference: host``) crosses the host link once for its pass.
- **Hand-over**: the rollout's weights, in its compute dtype (what a deployment hands over), reach each
  rollout device. Disaggregated, they cross the tier that joins the two submeshes: each rollout device
  receives its shard, each learner device sends its share of every copy the rollout holds, and the busier
  side bounds the time. Colocated, each device gathers its rollout shard from the learner's shards, an
  all-gather over as many devices as the learner's layout splits a weight.
- **The iteration**: colocated, the phases in turn (and the optimizer's trips to the host); disaggregated,
  in turn too (each submesh idles while the other works), unless ``rl.max_staleness: 1`` runs the next
  rollout beside the learning, when the slower of the rollout and the learning with its hand-over bounds it.
- **Memory**: each phase's peak on its own devices, the reference's parameters (in the compute dtype, split
  as the learner splits its weights) added to the learner's.
  Colocated, the learner's parameters, optimizer state and reference stay resident while the rollout's
  weights, cache and activations come and go: the peak is the larger of learning and rollout on top of them.
  ``rl.offload_optimizer`` moves the optimizer state to host memory for the rollout and back (both ways
  priced on the host link, in the iteration).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyperjax.config import RLRun, Run, ServeConfig
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.counts import count_params
from hyperjax.cost.estimate import GIB, Estimate, estimate, memory_budget
from hyperjax.cost.inference import InferenceEstimate, estimate_inference
from hyperjax.cost.pipeline import boundary_span
from hyperjax.errors import expect
from hyperjax.topology import axis_spans


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLEstimate:
    """A predicted reinforcement-learning iteration (the ``predict --json`` object of an ``rl:`` config).

    Attributes:
      rl: the resolved run it prices.
      iteration_s: seconds per iteration.
      rollout_s: the rollout (each wave's prefill plus ``max_new_tokens`` decode steps).
      learn_s: the learning (``score_s`` plus ``updates`` training steps).
      score_s: the two scoring passes (learner's weights and reference).
      handover_s: the weights' hand-over.
      offload_s: the learner's optimizer state to host memory and back (``rl.offload_optimizer``).
      idle_fraction: device time spent waiting for the other phase, over all device time of an iteration.
      tokens_per_s: completion tokens generated per second of iteration.
      memory_gib: ``rollout`` and ``learner`` peaks per device (colocated: both on the same devices).
      fits: whether every device's peak fits its budget.
      rollout: the rollout's serving estimate.
      learner: the learner's training-step estimate.
    """

    rl: RLRun
    iteration_s: float
    rollout_s: float
    learn_s: float
    score_s: float
    handover_s: float
    offload_s: float
    idle_fraction: float
    tokens_per_s: float
    memory_gib: dict[str, float]
    fits: bool
    rollout: InferenceEstimate
    learner: Estimate

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return {
            "iteration_s": self.iteration_s,
            "rollout_s": self.rollout_s,
            "prefill_s": self.rl.waves * self.rollout.prefill_s,
            "decode_s_per_token": self.rollout.decode_s_per_token,
            "learn_s": self.learn_s,
            "score_s": self.score_s,
            "update_s": self.learner.step_time_s,
            "handover_s": self.handover_s,
            "offload_s": self.offload_s,
            "idle_fraction": self.idle_fraction,
            "tokens_per_s": self.tokens_per_s,
            "memory_per_device_gib": self.memory_gib,
            "fits": self.fits,
            "rl": self.rl.to_dict(),
        }


def estimate_rl(rl: RLRun) -> RLEstimate:
    """Predict one iteration of ``rl`` on its preset's hardware.

    Raises:
      ConfigError: ``rl`` is not a resolved :class:`RLRun`.
    """
    expect(rl, RLRun, "estimate_rl(rl): rl", "pass hyperjax.resolve_rl(config) of a config with an rl: section")
    r, hw = rl.rl, rl.hardware
    out = estimate_inference(rl.rollout)
    rollout_s = rl.waves * (out.prefill_s + r.max_new_tokens * out.decode_s_per_token)
    learner = estimate(rl.learner)
    seq = rl.config.model.seq_len
    scoring = dataclasses.replace(
        rl.learner,
        config=dataclasses.replace(
            rl.learner.config, serve=ServeConfig(batch=rl.sequences, prompt_len=seq - 1, new_tokens=1)
        ),
    )
    e = 2 if rl.learner.dtype == "bfloat16" else 4
    host = hw.host
    has_reference = r.kl_coef > 0  # without the KL penalty no reference is kept or scored
    reference = count_params(rl.config.model) * e / weight_split(rl.learner) / GIB if has_reference else 0.0
    fetch = host.latency + reference * GIB / host.bandwidth if r.reference == "host" else 0.0
    score_s = (1 + has_reference) * estimate_inference(scoring).prefill_s + (fetch if has_reference else 0.0)
    learn_s = score_s + r.updates * learner.step_time_s
    m = learner.memory_per_device_gib
    offload_s = 2 * (host.latency + m["optimizer"] * GIB / host.bandwidth) if r.offload_optimizer else 0.0
    handover_s = _handover(rl, out)
    if r.max_staleness:
        iteration = max(rollout_s, learn_s + handover_s)
        busy = rl.rollout.devices * rollout_s + rl.learner.devices * (learn_s + handover_s)
    else:
        iteration = rollout_s + learn_s + handover_s + offload_s
        busy = rl.rollout.devices * rollout_s + rl.learner.devices * learn_s
        busy = iteration * rl.devices if rl.colocated else busy + rl.devices * handover_s
    idle = max(0.0, 1 - busy / (iteration * rl.devices))
    on_device = reference if r.reference == "device" else 0.0
    learn_peak = m["peak"] + on_device
    serve_peak = out.memory_per_device_gib["peak"]
    if rl.colocated:  # what stays on the devices while the rollout runs
        resident = m["params"] + (0.0 if r.offload_optimizer else m["optimizer"]) + on_device
        memory = {"learner": learn_peak, "rollout": resident + serve_peak}
    else:
        memory = {"learner": learn_peak, "rollout": serve_peak}
    memory["peak"] = max(memory.values())
    fits = memory["learner"] <= memory_budget(rl.learner) / GIB and memory["rollout"] <= memory_budget(rl.rollout) / GIB
    return RLEstimate(
        rl=rl,
        iteration_s=iteration,
        rollout_s=rollout_s,
        learn_s=learn_s,
        score_s=score_s,
        handover_s=handover_s,
        offload_s=offload_s,
        idle_fraction=idle,
        tokens_per_s=rl.sequences * r.max_new_tokens / iteration,
        memory_gib=memory,
        fits=fits,
        rollout=out,
        learner=learner,
    )


def _handover(rl: RLRun, out: InferenceEstimate) -> float:
    """Seconds to hand the learner's weights to the rollout's layout (see the module's docstring)."""
    hw = rl.hardware
    held = out.memory_per_device_gib["weights"] * GIB  # one rollout device's weights
    if rl.colocated:
        split = weight_split(rl.learner)
        if split == 1:
            return 0.0
        span = axis_spans(hw, {"rest": rl.devices // split, "split": split})["split"]
        return collective_time("all_gather", held, span, hw)
    span = boundary_span(hw, rl.rollout_first, rl.learner_first)
    received = held * rl.rollout.devices  # every copy of every shard the rollout holds
    per_sender = received / rl.learner.devices
    return collective_time("send", max(held, per_sender), span, hw)


def weight_split(run: Run) -> int:
    """Ways ``run``'s layout splits a weight: fsdp (with context under ``fsdp_context``) x tensor, and for a
    mixture of experts, whose experts hold most of its weights, x expert."""
    a, p = run.axes, run.config.parallel
    split = a["fsdp"] * (a["context"] if p.fsdp_context else 1) * a["tensor"]
    return split * (a["expert"] if run.config.model.moe is not None else 1)
