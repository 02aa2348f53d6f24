"""The SPMD vs MPMD pricing of a vision-language model is consistent with the per-module estimates."""

from pathlib import Path

import pytest

from hyperjax.cost import estimate
from hyperjax.cost.mpmd import best_module, module_configs, mpmd, spmd
from hyperjax.cost.planner import apply
from hyperjax.errors import ConfigError
from hyperjax.topology import load_hardware
from hyperjax.train import load_config

VLM = Path(__file__).parents[2] / "configs" / "vlm-tiny-mpmd.yaml"


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(VLM, ["train.global_batch=64", "train.dtype=bfloat16"])
    return cfg, load_hardware("cloudmatrix384")


def test_spmd_is_the_sum_of_both_modules_under_one_strategy(setup):
    cfg, hw = setup
    best = spmd(cfg, hw, 32)
    mods = module_configs(cfg)
    again = {k: estimate(apply(c, best["strategy"]), hw).step_time_s for k, c in mods.items()}
    assert best["module_step_s"] == pytest.approx(again)
    assert best["step_time_s"] == pytest.approx(sum(again.values()))


def test_mpmd_pipelines_the_best_submeshes(setup):
    cfg, hw = setup
    split = mpmd(cfg, hw, 32, microbatches=4)
    assert sum(split["devices"].values()) == 32
    a, b = (split["module_step_s"][k] / 4 for k in ("encoder", "language_model"))
    assert split["step_time_s"] >= 4 * max(a, b) + min(a, b)  # plus the hand-over of image tokens
    # each submesh's strategy is the best one for its module on its devices
    for name, n in split["devices"].items():
        assert best_module(module_configs(cfg)[name], hw, n)[1].step_time_s == split["module_step_s"][name]


def test_estimate_refuses_a_vision_model(setup):
    cfg, hw = setup
    with pytest.raises(ConfigError, match=r"hyperjax\.cost\.mpmd"):
        estimate(cfg, hw)
