"""The RL search: its splits, and answers that are resolved configs priced on the public path."""

import json
from pathlib import Path

import pytest

from hyperjax import ConfigError
from hyperjax.cli.plan import _held_rl
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
    learner's gradient reduction and FSDP) is kept where the phase's layout has the feature, and reset to its
    default where it has not (a run refuses it there), so no learner is lost."""
    sets = ["rl.learner.parallel.dp_overlap=none", "rl.rollout.devices=null", "rl.learner.devices=null"]
    cfg = load_config(GRPO, [*sets, "rl.learner.parallel.fsdp_reshard=false"])
    found = plan_rl(cfg, 16, keep=50)
    for e in found.best:
        rollout, learner = e.rl.config.rl.rollout.parallel, e.rl.config.rl.learner.parallel
        assert learner.dp_overlap == "none" and rollout.dp_overlap == "backward"
        assert learner.fsdp_reshard is (learner.fsdp == 1)
    assert {e.rl.config.rl.learner.parallel.fsdp for e in found.best} == {1, 2}  # learners with FSDP and without
    assert found.priced == plan_rl(load_config(GRPO, sets), 16, keep=50).priced
    plain = plan_rl(load_config(GRPO), 8, keep=1).best[0].rl.config.rl
    assert plain.learner.parallel.dp_overlap == "backward"


def test_a_rollout_modifier_is_refused_by_name():
    """The rollout generates, which reads none of training's modifiers: one set there is an error, in
    resolving and in planning alike, not a setting each rollout drops."""
    sets = ["rl.rollout.parallel.tp_overlap=bulk"]
    words = r"rl.rollout.parallel.tp_overlap=bulk says how training runs tensor parallelism, but the rollout only"
    with pytest.raises(ConfigError, match=words):
        resolve_rl(load_config(GRPO, sets))
    with pytest.raises(ConfigError, match=words):
        plan_rl(load_config(GRPO, sets), 8)
    with pytest.raises(ConfigError, match=r"rl.learner: rl.learner.parallel.fsdp_reshard=false says how FSDP runs"):
        resolve_rl(load_config(GRPO, ["rl.learner.parallel.fsdp=1", "rl.learner.parallel.fsdp_reshard=false"]))


def test_plan_rl_names_what_the_preset_cannot_do_first():
    """train.fp8 on a device without FP8 products is named with its fix, not reported as nothing fitting."""
    import pytest

    from hyperjax.errors import ConfigError

    cfg = load_config(GRPO, ["hardware=dgx-a100-80g", "train.fp8.recipe=tensorwise"])
    with pytest.raises(ConfigError, match=r"train.fp8 \(recipe tensorwise\) multiplies in FP8, .* set train.fp8: null"):
        plan_rl(cfg, 8)


@pytest.mark.parametrize(
    ("sets", "holds"),
    [
        (["rl.learner.parallel.tensor=2"], lambda e: e.rl.learner.axes["tensor"] == 2),
        (["rl.rollout.devices=4"], lambda e: e.rl.rollout.devices == 4),
        (["rl.learner.devices=2"], lambda e: (e.rl.rollout.devices, e.rl.learner.devices) == (6, 2)),
        (["rl.rollout.parallel.tensor=4"], lambda e: e.rl.rollout.axes["tensor"] == 4),
        (["rl.learner.parallel={fsdp: 4}"], lambda e: e.rl.learner.axes["fsdp"] == 4),
        (["rl.rollout={devices: 6}"], lambda e: e.rl.rollout.devices == 6),
        (
            ["rl.rollout.parallel={tensor: 2, data: 2, fsdp: 1}"],  # fsdp at its default: every rollout has it
            lambda e: (e.rl.rollout.axes["tensor"], e.rl.rollout.axes["data"]) == (2, 2),
        ),
    ],
)
def test_plan_holds_a_phases_devices_and_degrees_set_on_the_command_line(capsys, sets, holds):
    from hyperjax.cli.main import main

    assert (
        main(["plan", GRPO, "--devices", "8", "--top", "20", "--json", *(x for s in sets for x in ("--set", s))]) == 0
    )
    assert json.loads(capsys.readouterr().out)["candidates"]
    for e in plan_rl(load_config(GRPO, sets), 8, keep=20, held=_held_rl(sets, load_config(GRPO, sets))).best:
        assert holds(e), e.to_dict()


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["rl.rollout.devices=2", "rl.learner.devices=5"], r"do not split --devices 8 into two phases"),
        (["rl.rollout.parallel.fsdp=2"], r"rl.rollout.parallel.fsdp: .* so fsdp cannot be held; drop it"),
        # what a held degree asks of the model, named before any split is tried (not the last split's refusal)
        (
            ["rl.rollout.parallel.expert=2"],
            r"^rl.rollout: rl.rollout.parallel.expert=2 shards the experts .* model.moe is null",
        ),
        (["rl.learner.parallel.expert=2"], r"^rl.learner: rl.learner.parallel.expert=2 shards the experts"),
        (
            ["rl.rollout.devices=2"],
            r"has rl.rollout.devices=2 \(the last one tried: the learner's 6 devices: no layout of one program",
        ),
        (
            ["rl.rollout.parallel.tensor=3"],
            r"has rl.rollout.parallel.tensor=3 \(the last one tried: rl.rollout: .* not divisible .*\); drop them",
        ),
        # held rollout degrees no split can lay out: named first, by the model's size or the device counts tried
        # (before, the last split's refusal was shown, which named the learner's devices)
        (
            ["rl.rollout.parallel.tensor=8", "rl.rollout.parallel.data=1"],
            r"^no split of 8 devices gives the rollout a layout with rl.rollout.parallel.data=1, "
            r"rl.rollout.parallel.tensor=8: rl.rollout.parallel.tensor=8 splits the heads, and the model has "
            r"model.heads=4; drop them",
        ),
        (
            ["rl.rollout.parallel.data=8"],
            r"rl.rollout.parallel.data = 8 must divide the rollout's devices, searched on 1, 2, 3, 4, 5, 6, 7 \(the "
            r"learner keeps the rest of the 8\); drop them",
        ),
        # a held learner degree no split can lay out: named first, with the sizes it must divide
        (
            ["rl.learner.parallel.tensor=3"],
            r"^no split of 8 devices leaves the learner a layout of one program with rl.learner.parallel.tensor=3: "
            r"rl.learner.parallel.tensor=3 must divide model.heads=4, model.d_ff=512; drop them",
        ),
        (
            ["rl.rollout.devices=5", "rl.learner.parallel.tensor=2"],
            r"with rl.learner.parallel.tensor=2, rl.rollout.devices=5: the learner was searched on 3 devices, which "
            r"rl.learner.parallel.tensor=2 does not divide; drop them",
        ),
        # a held degree the model takes, on a model too large for any split: memory, not the degree
        (
            ["rl.learner.parallel.tensor=2", "model.layers=64", "model.d_model=8192", "model.d_ff=32768"],
            r"^no split of 8 devices fits the learner with rl.learner.parallel.tensor=2: its layouts of one "
            r"program \(on [0-9, ]+ devices\) exceed the device memory",
        ),
        (["rl.learner.parallel.pipeline=2"], r"^rl.learner.parallel.pipeline=2: the learner runs one SPMD program"),
    ],
)
def test_held_settings_no_layout_has_are_named(sets, message):
    cfg = load_config(GRPO, sets)
    with pytest.raises(ConfigError, match=message):
        plan_rl(cfg, 8, held=_held_rl(sets, cfg))


def test_a_learner_no_split_fits_is_named_as_memory():
    """Every split's learner lays out but fits nowhere: said as memory, not as the last split's refusal."""
    cfg = load_config(GRPO, ["model.layers=64", "model.d_model=8192", "model.d_ff=32768"])
    with pytest.raises(ConfigError, match=r"^no split of 8 devices fits the learner: its layouts of one program \(on "):
        plan_rl(cfg, 8)


def test_a_phase_whose_layout_exchanges_no_tokens_resets_its_dispatcher():
    """A mixture of experts' dispatcher holds in each phase whose layout spreads the experts and is reset in
    one whose devices each hold every expert (a run refuses it there), so no layout is lost to it."""
    moe = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=128"]
    sets = [*moe, "rl.rollout.parallel.dispatcher=alltoall", "rl.learner.parallel.dispatcher=alltoall"]
    cfg = load_config(GRPO, sets)
    for rollout, learner in (({"parallel.expert": 2}, {"parallel.fsdp": 4}), ({"parallel.tensor": 4}, {})):
        laid = with_layouts(cfg, (4, rollout), (4, learner))
        r, learned = laid.rl.rollout.parallel, laid.rl.learner.parallel
        assert r.dispatcher == ("alltoall" if r.expert > 1 else "deepep") and learned.dispatcher == "deepep"
        assert estimate_rl(resolve_rl(laid)).iteration_s > 0
    with pytest.raises(ConfigError, match=r"rl.learner: rl.learner.parallel.dispatcher='alltoall' says how a mixture"):
        resolve_rl(cfg)  # the config's own layouts (the learner's fsdp 4) hold every expert on each device


def test_fp8_weight_gathers_are_the_learners_and_leave_the_rollout_as_it_is():
    """train.fp8.all_gather gathers the learner's FSDP shards in FP8; the rollout generates and holds none, so
    an rl: config with it resolves, plans, and keeps it where the learner runs FSDP."""
    sets = ["hardware=dgx-h100", "train.fp8.recipe=tensorwise", "train.fp8.all_gather=true"]
    cfg = load_config(GRPO, sets)  # the learner fsdp 4; the rollout tensor 2 x data 2
    rl = resolve_rl(cfg)
    assert rl.learner.config.train.fp8.all_gather is True and rl.rollout.config.train.fp8.all_gather is False
    found = plan_rl(load_config(GRPO, [*sets, "rl.rollout.devices=null", "rl.learner.devices=null"]), 8, keep=50)
    assert any(e.rl.config.rl.learner.parallel.fsdp > 1 for e in found.best)
    for e in found.best:
        assert e.rl.config.train.fp8.all_gather is (e.rl.config.rl.learner.parallel.fsdp > 1)
