"""The reinforcement-learning oracle: rollouts are the same ids on any rollout layout, the learner's updates on
a fixed batch are one device's (fp32, 1e-4), colocated and disaggregated placements give the same
iterations, and a hand-over delivers the learner's weights bit for bit."""

import io
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from hyperjax.config import load_config
from hyperjax.models import build_model
from hyperjax.resolver import resolve_rl
from hyperjax.rl import (
    build_learner,
    build_rollout,
    group_advantages,
    hand_over,
    learner_batch,
    load_reward,
    prompts_of,
    train_rl,
)
from hyperjax.rl.loop import seed_of, texts
from hyperjax.rl.rewards import score
from tests.tiers import sweep

GRPO = str(Path(__file__).parents[2] / "configs" / "grpo-tiny.yaml")
MOE = [  # the quick start's mixture of experts, small: 4 experts top-2, one shared
    "model.family=llama",
    "model.moe={experts: 4, top_k: 2, shared_experts: 1, d_ff: 64, capacity_factor: null}",
]


def resolved(*sets: str):
    return resolve_rl(load_config(GRPO, ["train.steps=3", *sets]))


def phases(rollout: int, rollout_parallel: str, learner: int, learner_parallel: str, *more: str) -> list[str]:
    """Overrides putting the rollout on ``rollout`` devices and the learner on ``learner`` after it."""
    out = [f"emulate.devices={rollout + learner}", f"rl.rollout.devices={rollout}", f"rl.learner.devices={learner}"]
    out += [f"rl.rollout.parallel={rollout_parallel}", f"rl.learner.parallel={learner_parallel}"]
    return out + list(more)


def initial_params(rl):
    return nnx.to_pure_dict(nnx.state(build_model(rl.config.model, seed=rl.config.train.seed)))


def sample(rl, params, iteration: int = 0) -> np.ndarray:
    rollout = build_rollout(rl)
    key = jax.random.fold_in(jax.random.key(seed_of(rl)), iteration)
    return rollout.generate(hand_over(params, rollout.shardings), prompts_of(rl, iteration), key)


ROLLOUTS = [
    (4, "{tensor: 2, data: 2}", ()),
    (4, "{fsdp: 4}", ()),
    (4, "{expert: 4}", tuple(MOE)),
    (4, "{tensor: 4}", ()),
    (2, "{data: 2}", ()),
    (4, "{expert: 2, tensor: 2}", tuple(MOE)),
]


@pytest.mark.parametrize(("devices", "parallel", "more"), sweep(ROLLOUTS, fast={2}))
def test_rollouts_are_the_same_ids_on_any_layout(devices: int, parallel: str, more: tuple[str, ...]):
    reference = resolved(*phases(1, "{}", 1, "{}", *more))
    params = initial_params(reference)
    want = sample(reference, params)
    got = sample(resolved(*phases(devices, parallel, 1, "{}", *more)), params)
    assert want.shape == (64, 16)
    np.testing.assert_array_equal(got, want)


def test_rollouts_do_not_depend_on_the_waves():
    rl = resolved(*phases(2, "{data: 2}", 1, "{}"))
    params = initial_params(rl)
    np.testing.assert_array_equal(
        sample(resolved(*phases(2, "{data: 2}", 1, "{}"), "rl.rollout_batch=24"), params), sample(rl, params)
    )


def fixed_batch(rl):
    """A batch of rollouts (sampled on one device), its rewards and advantages."""
    completions = sample(rl, initial_params(rl))
    prompts = prompts_of(rl, 0)
    rewards = score(load_reward("letters"), "letters", texts(prompts), texts(completions))
    return learner_batch(rl, prompts, completions, group_advantages(rewards, rl.rl.group_size))


def updates(rl, batch, n: int = 3) -> list[dict[str, float]]:
    learner = build_learner(rl)
    placed = learner.place_batch(batch)
    placed["old_logp"] = learner.score(learner.state["params"], placed["inputs"], placed["targets"])
    placed["ref_logp"] = learner.score(learner.reference, placed["inputs"], placed["targets"])
    keys = ("loss", "kl", "clip_fraction", "grad_norm")
    return [{k: float(v) for k, v in jax.device_get(learner.update(placed)).items() if k in keys} for _ in range(n)]


LEARNERS = [
    ("{fsdp: 4}", ()),
    ("{tensor: 2, data: 2}", ()),
    ("{data: 4, zero_stage: 1}", ("train.microbatches=2",)),
    ("{fsdp: 2, tensor: 2}", ("train.microbatches=4",)),
    ("{expert: 2, data: 2}", tuple(MOE)),
    ("{expert: 4, tensor: 1}", tuple(MOE)),
]


@pytest.mark.parametrize(("parallel", "more"), sweep(LEARNERS, fast={0}))
def test_learner_updates_match_one_device(parallel: str, more: tuple[str, ...]):
    one = resolved(*phases(1, "{}", 1, "{}", *more))
    batch = fixed_batch(one)
    want = updates(one, batch)
    got = updates(resolved(*phases(1, "{}", 4, parallel, *more)), batch)
    assert want[0]["kl"] == pytest.approx(0.0, abs=1e-7) and want[1]["clip_fraction"] > 0  # the ratio moves
    for w, g in zip(want, got, strict=True):
        for key in ("loss", "kl", "clip_fraction", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow  # two whole iterations each way
def test_colocated_and_disaggregated_give_the_same_iterations():
    apart = train_rl(resolved(), log=io.StringIO())
    together = train_rl(
        resolved("emulate.devices=4", "rl.placement=colocated", "rl.rollout.devices=null", "rl.learner.devices=null"),
        log=io.StringIO(),
    )
    assert len(apart.records) == 3
    for a, b in zip(apart.records, together.records, strict=True):
        for key in ("reward_mean", "reward_std", "loss", "kl", "clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert apart.completions == together.completions


@pytest.mark.slow
def test_where_state_waits_leaves_the_iterations_unchanged():
    together = ("emulate.devices=4", "rl.placement=colocated", "rl.rollout.devices=null", "rl.learner.devices=null")
    plain = train_rl(resolved(*together, "train.steps=2"), log=io.StringIO())
    moved = train_rl(
        resolved(*together, "train.steps=2", "rl.reference=host", "rl.offload_optimizer=true"), log=io.StringIO()
    )
    for a, b in zip(plain.records, moved.records, strict=True):
        for key in ("reward_mean", "loss", "kl", "clip_fraction", "grad_norm"):
            assert b[key] == a[key], key


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_hand_over_delivers_the_weights_bit_for_bit(placement: str):
    sets = (
        []
        if placement == "disaggregated"
        else [
            "rl.placement=colocated",
            "rl.rollout.devices=null",
            "rl.learner.devices=null",
            "rl.learner.parallel.fsdp=8",
            "rl.rollout.parallel={tensor: 2, data: 4}",
        ]
    )
    rl = resolved(*sets)
    learner, rollout = build_learner(rl), build_rollout(rl)
    given = hand_over(learner.state["params"], rollout.shardings)
    sent, got = jax.tree.leaves(learner.state["params"]), jax.tree.leaves(given)
    rollout_devices = set(rollout.mesh.devices.flat)
    for s, g in zip(sent, got, strict=True):
        assert set(g.sharding.device_set) == rollout_devices
        np.testing.assert_array_equal(np.asarray(g), np.asarray(s))
    kept = [np.asarray(g) for g in got]
    batch = learner.place_batch(fixed_batch(rl))
    batch["old_logp"] = batch["ref_logp"] = learner.score(learner.state["params"], batch["inputs"], batch["targets"])
    learner.update(batch)  # donates the learner's state: the rollout's copy must outlive it
    for g, k in zip(got, kept, strict=True):
        assert not g.is_deleted()
        np.testing.assert_array_equal(np.asarray(g), k)


def test_stale_rollouts_are_sampled_one_update_behind():
    fresh = train_rl(resolved("train.steps=2"), log=io.StringIO())
    stale_rl = resolved("train.steps=2", "rl.max_staleness=1")
    stale = train_rl(stale_rl, log=io.StringIO())
    assert stale.records[0]["reward_mean"] == fresh.records[0]["reward_mean"]
    # iteration 2's rollout ran beside iteration 1's learning, with the weights it started from
    behind = sample(stale_rl, initial_params(stale_rl), iteration=1)
    rewards = score(load_reward("letters"), "letters", texts(prompts_of(stale_rl, 1)), texts(behind))
    assert stale.records[1]["reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-12)
    assert stale.completions == texts(behind)
