"""An RL iteration priced: the hand-over crosses the tier between the submeshes, and where state waits moves
memory against host-link time."""

from pathlib import Path

import pytest

from hyperjax.config import load_config
from hyperjax.cost.rl import estimate_rl, weight_split
from hyperjax.resolver import resolve_rl

GRPO = str(Path(__file__).parents[2] / "configs" / "grpo-tiny.yaml")
APART = ["emulate.devices=64", "rl.rollout.devices=32", "rl.learner.devices=32", "rl.prompts_per_step=64"]
APART += ["rl.rollout.parallel={tensor: 2}", "rl.learner.parallel={fsdp: 4}"]


def priced(*sets: str):
    return estimate_rl(resolve_rl(load_config(GRPO, [*APART, *sets])))


def test_the_hand_over_crosses_the_tier_between_the_submeshes():
    bus = priced("hardware=cloudmatrix384")
    network = priced("hardware=ascend910c-cluster")
    # the same NPUs: on the supernode the 32 + 32 devices meet on the unified bus, on the cluster over RoCE
    assert network.handover_s > 3 * bus.handover_s
    assert network.rollout.decode_s_per_token == pytest.approx(bus.rollout.decode_s_per_token, rel=0.5)


def test_the_learners_weight_split():
    rl = resolve_rl(load_config(GRPO, [*APART, "rl.learner.parallel={fsdp: 4, tensor: 2}"]))
    assert weight_split(rl.learner) == 8


def test_waves_multiply_the_rollout():
    one = priced()
    four = priced("rl.rollout_batch=128")
    assert four.rl.waves == 4 and one.rl.waves == 1
    assert four.rollout_s == pytest.approx(4 * (four.rollout.prefill_s + 16 * four.rollout.decode_s_per_token))


def test_the_rl_benchmarks_configs_load():
    """``benchmarks/rl.py`` turns the shipped training configs into ``rl:`` configs: each model on each machine and
    placement, and at the published runs' settings, loads (a refused setting stops the benchmark)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import rl

    for file in rl.MODELS.values():
        for machine in rl.MACHINES:
            for placement in ("colocated", "disaggregated"):
                assert rl.rl_config(file, machine, placement).rl.placement == placement
    small = {"group_size": 16, "prompts_per_step": 32, "prompt_len": 256, "max_new_tokens": 512}
    assert rl.rl_config(rl.MODELS["DeepSeek-V3"], "dgx-h100", "colocated", small).rl.prompts_per_step == 32
