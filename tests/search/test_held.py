"""What ``plan`` keeps of the config and what its overrides say it changed: a candidate's overrides over the
config are the run it priced, so ``train --set`` of them starts that run."""

import json
from pathlib import Path

import pytest

from hyperjax import ConfigError, estimate, load_config, plan, resolve

QUICK = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def fed_back(sets: list[str], overrides: dict) -> list[str]:
    """``sets`` and a candidate's overrides, as ``--set`` items after them (the last of a key wins)."""
    return [*sets, *(f"{k}={json.dumps(v)}" for k, v in overrides.items() if "." in k)]


@pytest.mark.parametrize(
    ("sets", "changed"),
    [
        (["parallel.gradient_buckets=true"], {}),  # held: every candidate sums gradients in buckets
        (["parallel.pipeline=1", "parallel.stage_layers=[2,2]"], {"parallel.stage_layers": None}),
        (["train.microbatches=4", "train.micro_batch=1"], {"train.microbatches": None}),
    ],
)
def test_a_candidates_overrides_over_the_config_are_the_run_it_priced(sets, changed):
    cfg = load_config(QUICK, sets)
    found = plan(cfg, 8, keep=20)
    assert found.best
    for c in found.best:
        assert cfg.parallel.gradient_buckets is None or c.run.config.parallel.gradient_buckets is True
        run = resolve(load_config(QUICK, fed_back(sets, c.overrides)), 8)
        assert run.describe() == c.run.describe()
        assert estimate(run).step_time_s == pytest.approx(c.estimate.step_time_s)
    assert all(c.overrides.get(k, "kept") == v for c in found.best for k, v in changed.items())


def test_gradient_buckets_no_strategy_can_honour_are_named():
    with pytest.raises(ConfigError, match=r"no strategy on 1 devices honours parallel.gradient_buckets=true"):
        plan(load_config(QUICK, ["parallel.gradient_buckets=true"]), 1)
