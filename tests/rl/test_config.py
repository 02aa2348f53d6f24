"""The rl: section resolved: phases, devices, and the errors of a bad section (each naming its key)."""

from pathlib import Path

import pytest

from hyperjax.config import load_config
from hyperjax.errors import ConfigError, HyperjaxError
from hyperjax.resolver import resolve_rl
from hyperjax.rl.rewards import load_reward, score

GRPO = str(Path(__file__).parents[2] / "configs" / "grpo-tiny.yaml")


def resolved(*sets: str):
    return resolve_rl(load_config(GRPO, list(sets)))


def test_grpo_tiny_resolves_into_two_submeshes():
    rl = resolved()
    assert (rl.devices, rl.rollout.devices, rl.learner.devices) == (8, 4, 4)
    assert (rl.rollout_first, rl.learner_first) == (0, 4)
    assert dict(rl.rollout.axes) == {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    assert rl.learner.axes["fsdp"] == 4
    assert rl.learner.global_batch == 64 and rl.wave == 64 and rl.waves == 1
    assert rl.learner.config.train.steps == 30 * 2  # iterations x updates: the learning-rate schedule's steps
    assert rl.prompt_len == 16 and rl.rollout.config.serve.new_tokens == 16
    assert rl.to_dict()["rollout"]["first_device"] == 0 and rl.to_dict()["learner"]["first_device"] == 4


def test_colocated_puts_both_phases_on_every_device():
    rl = resolved(
        "rl.placement=colocated",
        "rl.rollout.devices=null",
        "rl.learner.devices=null",
        "rl.rollout.parallel.data=4",
        "rl.learner.parallel.fsdp=8",
    )
    assert (rl.rollout.devices, rl.learner.devices, rl.learner_first) == (8, 8, 0)


def test_missing_devices_are_what_the_other_phase_leaves():
    rl = resolved(
        "rl.learner.devices=null",
        "rl.learner.parallel.fsdp=2",
        "rl.rollout.devices=6",
        "rl.rollout.parallel.data=null",
        "rl.rollout.parallel.tensor=2",
        "rl.rollout_batch=48",
    )
    assert (rl.rollout.devices, rl.learner.devices) == (6, 2)


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (["rl.rollout.devices=3"], r"rl.rollout.devices=3 \+ rl.learner.devices=4 = 7, but the job has 8 devices"),
        (["rl.group_size=1"], r"rl.group_size=1: .* set rl.group_size: 2 or more"),
        (["rl.rollout.parallel.pipeline=2", "rl.rollout.parallel.data=1"], r"rl.rollout.parallel.pipeline=2: rollouts"),
        # named before the degrees are resolved, not as a product that misses the devices
        (["rl.rollout.parallel.pipeline=2"], r"^rl.rollout.parallel.pipeline=2: rollouts"),
        (["rl.rollout.parallel.context=2"], r"^rl.rollout.parallel.context=2: rollouts"),
        (["rl.rollout.parallel.expert=2"], r"^rl.rollout: rl.rollout.parallel.expert=2 shards the experts"),
        (
            ["rl.learner.parallel.sequence_parallel=true"],
            r"rl.learner.parallel.sequence_parallel=true needs rl.learner",
        ),
        (["rl.rollout.parallel.context=2", "rl.rollout.parallel.data=1"], r"rl.rollout.parallel.context=2: rollouts"),
        (
            ["rl.rollout.parallel.sequence_parallel=true", "rl.rollout.parallel.tensor=2"],
            r"rl.rollout.parallel.sequence_parallel=true: rollouts",
        ),
        (
            ["rl.learner.parallel.pipeline=2", "rl.learner.parallel.fsdp=2"],
            r"rl.learner.parallel.pipeline=2: the learner",
        ),
        (["rl.learner.parallel.pipeline=3"], r"^rl.learner.parallel.pipeline=3: the learner runs one SPMD program"),
        (
            [
                "model.moe={experts: 4, top_k: 2, d_ff: 64}",
                "rl.learner.parallel.expert=2",
                "rl.learner.parallel.fsdp=2",
                "rl.learner.parallel.overlap=fb-pair",
                "train.microbatches=2",
            ],
            r"rl.learner.parallel.overlap=fb-pair: the learner runs one SPMD program",
        ),
        (["rl.learner.parallel.fsdp=3"], r"rl.learner: .*rl.learner.parallel.data cannot take the rest"),
        (["rl.placement=colocated"], r"rl.rollout.devices=4, but rl.placement=colocated"),
        (["rl.max_staleness=2"], r"rl.max_staleness=2 must be 0"),
        (["rl.placement=colocated", "rl.max_staleness=1"], r"rl.max_staleness=1 .* rl.placement=colocated"),
        (["rl.max_new_tokens=40"], r"rl.prompt_len=16 \+ rl.max_new_tokens=40 = 56 tokens must fit model.seq_len=32"),
        (
            ["rl.rollout_batch=5"],
            r"rl.rollout_batch=5 completions .* the rollout's 2 data-parallel replicas",
        ),
        (["rl.rollout_batch=128"], r"rl.rollout_batch=128 is more than the 64 completions"),
        (
            [
                "model.moe={experts: 4, top_k: 2, d_ff: 64, capacity_factor: 1.0}",
                *("rl.rollout.devices=6", "rl.learner.devices=2", "rl.learner.parallel={fsdp: 2}"),
                "rl.rollout.parallel={data: 3, tensor: 2}",
            ],
            r"capacity_factor=1.0: .* 64 completions .* padded to 66 .* set rl.rollout_batch to a multiple of 3",
        ),
        (["parallel.tensor=2"], r"an rl: config lays out each phase apart"),
        (["offload.policy=auto"], r"offload.policy='auto': an rl: config"),
        (["rl.algorithm=ppo"], r"rl.algorithm='ppo' is not one of \('grpo',\)"),
        (["rl.temperature=0"], r"rl.temperature=0.0 must be a finite number >= 1e-06: reinforcement learning samples"),
        (["rl.temperature=1.0e-46"], r"rl.temperature=1e-46 must be a finite number >= 1e-06"),
        (["rl.kl_coef=0", "rl.reference=host"], r"rl.reference=host places the frozen reference model, but rl.kl"),
        (["rl.top_k=300"], r"rl.top_k=300 is more than model.vocab=256"),
        (["rl.seed=-1"], r"rl.seed=-1 must be in \[0, 2\*\*63\)"),
        (["rl.kl_coef=.nan"], r"rl.kl_coef=nan must be a finite number"),
        (["rl.offload_optimizer=true"], r"rl.offload_optimizer=true frees the learner's devices"),
        (["train.global_batch=16"], r"train.global_batch=16: .* 8 x 8 = 64 sequences a step; drop train.global_batch"),
        (["train.global_batch=32"], r"train.global_batch=32: .* = 64 sequences"),  # given, though it is the default
        # training's settings the rollout never reads (before, accepted and shown, with no effect on the price)
        *(
            ([f"rl.rollout.parallel.{k}"], rf"^rl.rollout.parallel.{k.split('=')[0]}=.* is a training setting")
            for k in ("zero_stage=1", "gradient_buckets=true", "dp_overlap=none", "overlap=two-microbatch")
        ),
        # a phase's own checks name the phase's keys (before: "rl.rollout or rl.learner.devices", "parallel.tensor")
        (["rl.rollout.devices=0"], r"^rl.rollout.devices=0 must be a positive integer or null"),
        (["rl.learner.parallel.data=0"], r"^rl.learner.parallel.data=0 must be a positive integer or null"),
        (["rl.rollout.parallel.zero_stage=3"], r"^rl.rollout.parallel.zero_stage=3 .* set rl.rollout.parallel.fsdp"),
    ],
)
def test_bad_rl_section_names_the_key(sets, pattern):
    with pytest.raises(HyperjaxError, match=pattern):
        resolved(*sets)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("nonsense", r"rl.reward='nonsense' is not a built-in reward \(letters, word:VALUE, match:VALUE\)"),
        ("word", r"the built-in 'word' takes an argument"),
        ("letters:x", r"the built-in 'letters' takes no argument"),
        ("match:(", r"'\(' is not a regular expression"),
        ("no_such_module_here:f", r"module 'no_such_module_here' cannot be imported"),
        ("json:no_such_function", r"module 'json' has no function 'no_such_function'"),
    ],
)
def test_bad_reward_names_rl_reward(spec, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_reward(spec)


def test_builtin_rewards():
    assert load_reward("letters")([""], ["ab 1"]) == [0.75]
    assert load_reward("word:LORD")([""] * 2, ["the LORD said LORD", "LORDS"]) == [2.0, 0.0]
    assert load_reward("match:^a+$")([""] * 2, ["aaa", "ab"]) == [1.0, 0.0]


def test_a_reward_returning_bad_values_is_an_error():
    with pytest.raises(ConfigError, match=r"returned 1 values for 2 completions"):
        score(lambda p, c: [1.0], "m:f", ["a", "b"], ["a", "b"])
    with pytest.raises(ConfigError, match=r"returned nan for completion 0"):
        score(lambda p, c: [float("nan")] * 2, "m:f", ["a", "b"], ["a", "b"])
    with pytest.raises(ConfigError, match=r"rl.reward='m:f' raised ZeroDivisionError"):
        score(lambda p, c: [1 / 0], "m:f", ["a"], ["a"])


def test_module_reward_is_loaded_from_the_working_directory(tmp_path: Path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(
        "def short(prompts, completions):\n    return [-len(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_reward("my_reward_mod:short")(["p"], ["abc"]) == [-3]
