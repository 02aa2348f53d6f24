"""Reinforcement learning on the emulated mesh: every iteration a rollout, its rewards, the learner's updates
and the hand-over of the new weights to the rollout.

One iteration, in order (``rl.max_staleness: 0``):

1. **rollout**: ``prompts_per_step`` windows of the corpus, each repeated ``group_size`` times, continued
   by ``max_new_tokens`` sampled tokens on the rollout's submesh;
2. **rewards** of each completion (:mod:`hyperjax.rl.rewards`) and their group-relative advantages;
3. **learning**: the learner scores every sampled token under its weights (the ratio's denominator) and
   under the frozen reference, then takes ``rl.updates`` optimizer steps on the algorithm's loss;
4. **hand-over** of the learner's new weights to the rollout's layout.

With ``rl.max_staleness: 1`` the next iteration's rollout runs beside the learning, with the weights of the
iteration before: the phases overlap, and a completion is learned one iteration after it was sampled.
Prompts and sampling keys are functions of ``(seed, iteration)``, so any layout, either placement and a
resumed view all see the same iterations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

from hyperjax.config import RLRun
from hyperjax.errors import expect
from hyperjax.rl.losses import group_advantages
from hyperjax.rl.phases import Learner, Rollout, build_learner, build_rollout, hand_over
from hyperjax.rl.rewards import load_reward, score
from hyperjax.train.data import Batches
from hyperjax.train.generate import decode_text
from hyperjax.train.loop import save_figure
from hyperjax.train.prepare import check_log, check_outputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLResult:
    """What a reinforcement-learning run measured.

    Attributes:
      records: every iteration's metrics (``iteration``, ``reward_mean``, ``reward_std``, ``kl``,
        ``clip_fraction``, ``loss``, ``grad_norm``, ``rollout_s``, ``learn_s``, ``handover_s``,
        ``iteration_s``, ``tokens``), as written to ``metrics_out``.
      completions: the last iteration's completions, as text.
      params: the learner's parameters at the end (on its mesh).
    """

    records: list[dict[str, Any]]
    completions: list[str]
    params: Any

    @property
    def rewards(self) -> list[float]:
        return [r["reward_mean"] for r in self.records]


def prompts_of(rl: RLRun, iteration: int) -> np.ndarray:
    """The prompts of ``iteration``, ``(prompts_per_step x group_size, prompt_len)``: windows of the corpus
    (``train.data``), each repeated for its group."""
    cfg, r = rl.config, rl.rl
    data = Batches(
        source=cfg.train.data,
        global_batch=r.prompts_per_step,
        seq_len=rl.prompt_len,
        vocab=cfg.model.vocab,
        seed=seed_of(rl),
    )
    inputs, _ = data.rows(iteration, slice(None))
    return np.repeat(inputs.astype(np.int32), r.group_size, axis=0)


def seed_of(rl: RLRun) -> int:
    return rl.rl.seed if rl.rl.seed is not None else rl.config.train.seed


def learner_batch(rl: RLRun, prompts: np.ndarray, completions: np.ndarray, advantages: np.ndarray) -> dict[str, Any]:
    """The learner's batch: each sequence (prompt then completion) as ``model.seq_len`` inputs and their next
    tokens, ``mask`` 1 where the target is a sampled token, and the advantages."""
    seq_len = rl.config.model.seq_len
    full = np.concatenate([prompts, completions], axis=1)
    b, n = full.shape
    inputs = np.zeros((b, seq_len), np.int32)
    targets = np.zeros((b, seq_len), np.int32)
    mask = np.zeros((b, seq_len), np.float32)
    inputs[:, :n] = full
    targets[:, : n - 1] = full[:, 1:]
    mask[:, prompts.shape[1] - 1 : n - 1] = 1.0
    return {"inputs": inputs, "targets": targets, "mask": mask, "advantages": advantages.astype(np.float32)}


def texts(tokens: np.ndarray) -> list[str]:
    return [decode_text(row) for row in np.asarray(tokens)]


def train_rl(
    rl: RLRun,
    *,
    metrics_out: str | None = None,
    out_dir: str | None = None,
    log: TextIO | None = None,
    init_checkpoint: str | None = None,
    learner: Learner | None = None,
    rollout: Rollout | None = None,
) -> RLResult:
    """Run ``rl``'s ``train.steps`` iterations on the devices already started.

    Args:
      rl: from :func:`hyperjax.resolve_rl`.
      metrics_out: a JSON-lines file, one object per iteration.
      out_dir: where ``loss.png`` (loss and reward per iteration) goes.
      log: where progress lines go (default stdout).
      init_checkpoint: start the policy and the reference from the newest checkpoint's parameters there.
      learner, rollout: the phases, when already built (tests).

    Raises:
      ConfigError: a reward that cannot be loaded or returns bad values, or an unreadable checkpoint.
    """
    expect(rl, RLRun, "train_rl(rl): rl", "pass hyperjax.resolve_rl(config) of a config with an rl: section")
    check_outputs(metrics_out, out_dir)
    check_log(log, "train_rl")
    r = rl.rl
    log = sys.stdout if log is None else log
    reward = load_reward(r.reward)
    rollout = rollout or build_rollout(rl)
    learner = learner or build_learner(rl, init_checkpoint=init_checkpoint)
    key = jax.random.key(seed_of(rl))
    steps = rl.config.train.steps
    start = time.perf_counter()
    weights = hand_over(learner.state["params"], rollout.shardings)
    if r.offload_optimizer:
        learner.park()
    first_handover = time.perf_counter() - start
    sink = None  # opened with the first record: a run that fails before one leaves no empty file
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1) if r.max_staleness else None
    records: list[dict[str, Any]] = []
    last: list[str] = []

    def sampled(i: int, params: Any) -> tuple[np.ndarray, np.ndarray, float]:
        began = time.perf_counter()
        prompts = prompts_of(rl, i)
        out = np.asarray(rollout.generate(params, prompts, jax.random.fold_in(key, i)))
        return prompts, out, time.perf_counter() - began

    try:
        pending = None
        for i in range(steps):
            began = time.perf_counter()
            if pending is None:
                prompts, completions, rollout_s = sampled(i, weights)
            else:
                prompts, completions, rollout_s = pending.result()
            if pool is not None and i + 1 < steps:  # the next rollout, with these weights, beside the learning
                pending = pool.submit(sampled, i + 1, weights)
            else:
                weights = None  # the rollout's copy is not kept through the learning (colocated: its room)
            last = texts(completions)
            rewards = score(reward, r.reward, texts(prompts), last)
            batch = learner.place_batch(
                learner_batch(rl, prompts, completions, group_advantages(rewards, r.group_size))
            )
            learn_start = time.perf_counter()
            if r.offload_optimizer:
                learner.unpark()
            batch["old_logp"] = learner.score(learner.state["params"], batch["inputs"], batch["targets"])
            if learner.reference is not None:
                batch["ref_logp"] = learner.score(learner.reference, batch["inputs"], batch["targets"])
            else:  # no KL penalty, no reference: the estimate then reads the drift from the iteration's start
                batch["ref_logp"] = batch["old_logp"]
            measured = [learner.update(batch) for _ in range(r.updates)]
            measured = jax.device_get(measured)
            if r.offload_optimizer:
                learner.park()
            learn_s = time.perf_counter() - learn_start
            moved = time.perf_counter()
            weights = hand_over(learner.state["params"], rollout.shardings)
            handover_s = time.perf_counter() - moved + (first_handover if i == 0 else 0.0)
            record = {
                "iteration": i + 1,
                "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std()),
                # against the reference, before this iteration's updates; without one (kl_coef 0), the drift
                # from the iteration's start that its earlier updates made
                "kl": float(measured[0 if learner.reference is not None else -1]["kl"]),
                "clip_fraction": float(np.mean([m["clip_fraction"] for m in measured])),
                "loss": float(np.mean([m["loss"] for m in measured])),
                "grad_norm": float(measured[-1]["grad_norm"]),
                "rollout_s": rollout_s,
                "learn_s": learn_s,
                "handover_s": handover_s,
                "iteration_s": time.perf_counter() - began,
                "tokens": int(completions.size),
            }
            records.append(record)
            if metrics_out:
                sink = sink or open(metrics_out, "w")  # noqa: SIM115 (closed below)
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            log.write(  # every iteration: iterations are few, each a rollout and a learning step
                f"iteration {i + 1:>3}/{steps}  reward {record['reward_mean']:.3f} ± {record['reward_std']:.3f}  "
                f"kl {record['kl']:.4f}  clip {record['clip_fraction']:.1%}  rollout {rollout_s:.2f} s  "
                f"learn {learn_s:.2f} s  hand-over {handover_s * 1e3:.1f} ms\n"
            )
            log.flush()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        if sink is not None:
            sink.close()
    if out_dir is not None:
        plot_rl(records, Path(out_dir) / "loss.png", title=rl.describe())
    return RLResult(records=records, completions=last, params=learner.state["params"])


def plot_rl(records: list[dict[str, Any]], path: Path, *, title: str) -> None:
    """The loss and the mean reward per iteration, one panel each, to ``path`` (PNG, written whole)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["iteration"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 5), dpi=100, sharex=True)
    top.plot(x, [r["loss"] for r in records])
    top.set(ylabel="policy loss", title=title)
    mean = np.array([r["reward_mean"] for r in records])
    std = np.array([r["reward_std"] for r in records])
    bottom.plot(x, mean, color="tab:green")
    bottom.fill_between(x, mean - std, mean + std, color="tab:green", alpha=0.2)
    bottom.set(xlabel="iteration", ylabel="reward (mean ± std)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.title.set_fontsize(8)
    save_figure(fig, path)
