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


@pytest.mark.parametrize(
    ("sets", "spread"),
    [
        (["parallel.expert_tensor=1"], True),  # held over a config of tensor 1: the experts spread over tensor
        (["parallel.tensor=2", "parallel.expert_tensor=2"], False),  # each expert split two ways: null's meaning
    ],
)
def test_plan_holds_a_given_expert_tensor_degree(capsys, sets, spread):
    from hyperjax.cli.main import main

    moe = str(QUICK.parent / "moe-tiny.yaml")  # tensor 1
    args = ["plan", moe, "--devices", "8", "--json", "--top", "5", *(a for s in sets for a in ("--set", s))]
    assert main(args) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    assert found
    for c in found:
        assert c["parallel.tensor"] == 2 or spread
        assert c["parallel.tensor"] > 1 and (c["parallel.expert_tensor"] == 1) is spread


def test_plan_refuses_a_manual_placement_it_would_not_price():
    """A manual placement names one layout's tensors; the search prices other layouts, so it is named, not
    dropped from every candidate unsaid."""
    cfg = load_config(QUICK, ["offload.policy=manual", "offload.manual={layers.*.optimizer: host}"])
    with pytest.raises(ConfigError, match=r"offload.policy=manual places the tensors offload.manual names .* set "):
        plan(cfg, 8)


@pytest.mark.parametrize("policy", ["auto", "greedy"])
def test_under_a_placement_pass_each_candidate_fed_back_prices_as_planned(policy):
    """Under auto or greedy, a strategy that fits as it is says offload.policy: none (the pass would choose its
    recomputation again), and one the pass made fit keeps the policy: each, fed back over the config, is
    priced as plan priced it."""
    from hyperjax.offload import offload_pass, with_offload

    sets = [f"offload.policy={policy}", "offload.device_memory_gib=0.04", "offload.prefetch=2"]
    found = plan(load_config(QUICK, sets), 8, keep=40).best
    assert {c.overrides.get("offload.policy") for c in found} == {"none", policy}
    for c in found:
        run = resolve(load_config(QUICK, fed_back(sets, c.overrides)), 8)
        est = estimate(run) if run.offload == "none" else with_offload(offload_pass(run))
        assert est.step_time_s == pytest.approx(c.estimate.step_time_s, rel=1e-9), c.overrides
