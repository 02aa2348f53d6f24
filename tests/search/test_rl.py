"""The RL search: its splits, and answers that are resolved configs priced on the public path."""

from pathlib import Path

from hyperjax.config import load_config
from hyperjax.cost.rl import estimate_rl
from hyperjax.resolver import resolve_rl
from hyperjax.search.rl import plan_rl, residences, splits, waves, with_layouts

GRPO = str(Path(__file__).parents[2] / "configs" / "grpo-tiny.yaml")


def test_splits_are_blocks_of_a_power_of_two_granule():
    assert splits(384, "disaggregated") == list(range(32, 384, 32))
    assert splits(8, "disaggregated") == list(range(1, 8))
    assert splits(384, "colocated") == [384]


def test_waves_and_where_state_waits():
    cfg = load_config(GRPO)
    assert waves(cfg) == [None, 32, 16, 8, 4, 2, 1]
    assert waves(cfg, replicas=6) == [None, 36, 18, 12, 6]  # rounded up to the replicas; 64 / 2 rounds to 36
    assert waves(load_config(GRPO, ["rl.rollout_batch=16"])) == [16]
    assert residences(cfg) == [
        {"reference": "device", "offload_optimizer": False},
        {"reference": "host", "offload_optimizer": False},
    ]
    together = load_config(GRPO, ["rl.placement=colocated", "rl.rollout.devices=null", "rl.learner.devices=null"])
    assert len(residences(together)) == 4
    assert residences(load_config(GRPO, ["rl.kl_coef=0"])) == [{"reference": "device", "offload_optimizer": False}]


def test_the_answer_is_a_resolved_config_priced_again():
    found = plan_rl(load_config(GRPO), 8, keep=3)
    best = found.best[0]
    again = estimate_rl(resolve_rl(best.rl.config))
    assert again.iteration_s == best.iteration_s and again.fits
    assert [e.iteration_s for e in found.best] == sorted(e.iteration_s for e in found.best)


def test_each_phase_keeps_how_its_framework_runs_through_the_search():
    """The search chooses each phase's degrees; what the config says of how the framework runs them (the
    learner's gradient reduction and FSDP, the rollout's tensor-parallel overlap) is kept where the phase's
    layout has the feature, and reset to its default where it has not (a run refuses it there)."""
    sets = ["rl.learner.parallel.dp_overlap=none", "rl.learner.parallel.fsdp_reshard=false"]
    sets += ["rl.rollout.parallel.tp_overlap=bulk", "rl.rollout.devices=null", "rl.learner.devices=null"]
    cfg = load_config(GRPO, sets)
    found = plan_rl(cfg, 16, keep=50).best
    for e in found:
        rollout, learner = e.rl.config.rl.rollout.parallel, e.rl.config.rl.learner.parallel
        assert learner.dp_overlap == "none" and rollout.dp_overlap == "backward" and learner.tp_overlap == "none"
        assert learner.fsdp_reshard is (learner.fsdp == 1)
        assert rollout.tp_overlap == ("bulk" if rollout.tensor > 1 else "none")
    assert {e.rl.config.rl.learner.parallel.fsdp for e in found} == {1, 2}  # learners with FSDP and without
    laid = with_layouts(cfg, (8, {"parallel.tensor": 2}), (8, {"parallel.fsdp": 1})).rl
    assert laid.rollout.parallel.tp_overlap == "bulk" and laid.learner.parallel.fsdp_reshard is True
    plain = plan_rl(load_config(GRPO), 8, keep=1).best[0].rl.config.rl
    assert plain.learner.parallel.dp_overlap == "backward"


def test_plan_rl_names_what_the_preset_cannot_do_first():
    """train.fp8 on a device without FP8 products is named with its fix, not reported as nothing fitting."""
    import pytest

    from hyperjax.errors import ConfigError

    cfg = load_config(GRPO, ["hardware=dgx-a100-80g", "train.fp8.recipe=tensorwise"])
    with pytest.raises(ConfigError, match=r"train.fp8 \(recipe tensorwise\) multiplies in FP8, .* set train.fp8: null"):
        plan_rl(cfg, 8)
