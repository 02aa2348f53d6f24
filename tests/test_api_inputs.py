"""A call into the public API with an argument of the wrong kind, or a setting it cannot honour, is refused
with a hyperjax error naming the argument and what to pass: never an exception from deep inside, never a
setting ignored."""

import re
from pathlib import Path

import jax
import pytest

import hyperjax
from hyperjax import ConfigError, EmulationError, MeshError, PresetError, ShardingError

CONFIGS = Path(__file__).parents[1] / "configs"
QUICK = hyperjax.load_config(CONFIGS / "quickstart.yaml")
RL = hyperjax.load_config(CONFIGS / "grpo-tiny.yaml")
HW = hyperjax.load_hardware("cloudmatrix384")


class Writer:
    """A stream that writes but cannot flush."""

    def write(self, text: str) -> int:
        return len(text)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        # a value of another stage of the flow: each names what to pass instead
        (lambda: hyperjax.resolve("configs/quickstart.yaml"), ConfigError, r"config is a str, not a Config; pass "),
        (lambda: hyperjax.resolve_rl(None), ConfigError, r"resolve_rl\(config\): config is None, not a Config"),
        (lambda: hyperjax.estimate(QUICK), ConfigError, r"estimate\(run\) takes a resolved Run, not a Config"),
        (lambda: hyperjax.estimate(hyperjax.resolve_rl(RL)), ConfigError, r"not an RLRun; .* hyperjax.estimate_rl"),
        (lambda: hyperjax.estimate_rl(hyperjax.resolve(QUICK)), ConfigError, r"rl is a Run, not an RLRun"),
        (lambda: hyperjax.offload_pass(QUICK), ConfigError, r"offload_pass\(run\) takes a resolved Run"),
        (lambda: hyperjax.train(QUICK), ConfigError, r"train\(run\) takes a resolved Run, not a Config"),
        (lambda: hyperjax.train_rl(RL), ConfigError, r"train_rl\(rl\): rl is a Config, not an RLRun"),
        (lambda: hyperjax.plan(hyperjax.resolve(QUICK), 8), ConfigError, r"plan\(cfg\): cfg is a Run, not a Config"),
        (lambda: hyperjax.load_config(3), ConfigError, r"path 3 is an int; give a file's path or None"),
        (lambda: hyperjax.load_config(None, "parallel.tensor=2"), ConfigError, r"give a list of 'key=value' strings"),
        (lambda: hyperjax.load_hardware(None), PresetError, r"hardware preset None is None, not a str or Path"),
        # an rl: config's run is not trained, priced or searched as supervised training
        (lambda: hyperjax.train(hyperjax.resolve(RL)), ConfigError, r"has an rl: section, which train would run"),
        (lambda: hyperjax.estimate(hyperjax.resolve(RL)), ConfigError, r"use hyperjax.estimate_rl"),
        (lambda: hyperjax.plan(RL, 8), ConfigError, r"has an rl: section; plan its phases with hyperjax.plan_rl"),
        (lambda: hyperjax.plan_rl(QUICK, 8), ConfigError, r"has no rl: section; plan its training with hyperjax.plan"),
        # counts and keys of the search
        (lambda: hyperjax.plan(QUICK, 0), ConfigError, r"devices=0 must be a positive integer"),
        (lambda: hyperjax.plan(QUICK, True), ConfigError, r"devices=True must be a positive integer"),
        (lambda: hyperjax.plan(QUICK, 8, keep=0), ConfigError, r"plan\(keep=\)=0 must be a positive integer"),
        (
            lambda: hyperjax.plan(QUICK, 8, where={"parallel.tensr": 2}),
            ConfigError,
            r"plan\(where=\): unknown config key parallel.tensr; did you mean parallel.tensor\?",
        ),
        (lambda: hyperjax.plan(QUICK, 8, where={"parallel": 2}), ConfigError, r"parallel is a section; give one of"),
        (
            lambda: hyperjax.plan(QUICK, 8, where={"train.lr.x": 2}),
            ConfigError,
            r"train.lr is a value, not a section",
        ),
        (
            lambda: hyperjax.plan_rl(RL, 8, held={"rl.rollout.devicez": 2}),
            ConfigError,
            r"plan_rl\(held=\): unknown config key rl.rollout.devicez; did you mean rl.rollout.devices\?",
        ),
        (
            lambda: hyperjax.plan(QUICK, 8, where={"parallel.tensor": "2"}),
            ConfigError,
            r"plan\(where=\): parallel.tensor='2' has the wrong type: expected int, got str",
        ),
        (
            lambda: hyperjax.plan(QUICK, 8, where={"train.recompute": "ful"}),
            ConfigError,
            r"plan\(where=\): train.recompute='ful' is not one of .*; did you mean 'full'\?",
        ),
        (
            lambda: hyperjax.plan_rl(RL, 8, held={"rl.rollout.devices": 2.0}),
            ConfigError,
            r"plan_rl\(held=\): rl.rollout.devices=2.0 has the wrong type",
        ),
        # meshes and devices
        (lambda: hyperjax.default_axes(HW, 0), MeshError, r"devices=0 must be a positive integer"),
        (lambda: hyperjax.mesh_axes_for(devices=-8), ShardingError, r"devices=-8 must be a positive integer"),
        (lambda: hyperjax.make_mesh(HW, "data=2,tensor=4"), MeshError, r"are text; read them with hyperjax.parse_axes"),
        (lambda: hyperjax.make_mesh(HW, [("data", 8)]), MeshError, r"must be a mapping of axis name to size"),
        (lambda: hyperjax.make_mesh(HW, {"a b": 8}), MeshError, r"mesh axis name 'a b' is not an identifier"),
        (lambda: hyperjax.make_mesh(3, {"data": 8}), PresetError, r"hardware preset 3 is an int"),
        (lambda: hyperjax.make_mesh(HW, {"data": 2}, devices=[0, 1]), MeshError, r"devices holds 0, not a jax.Device"),
        (lambda: hyperjax.make_mesh(HW, {"data": 1}, devices=[]), MeshError, r"devices is empty"),
        (
            lambda: hyperjax.make_mesh(HW, {"data": 2}, devices=[jax.devices()[0]] * 2),
            MeshError,
            rf"devices holds {re.escape(str(jax.devices()[0]))} twice; give each device once",
        ),
        (
            lambda: hyperjax.axis_spans(HW, {"data": 8}, groups={"g": ("data", "data")}),
            MeshError,
            r"group 'g' names a mesh axis twice",
        ),
        (lambda: hyperjax.start_devices(8, platform="CPU"), EmulationError, r"platform='CPU' must be 'cpu'"),
        (lambda: hyperjax.start_devices(True), EmulationError, r"devices=True must be a positive integer"),
        # the standard strategy's overrides name its logical axes
        (lambda: hyperjax.strategy_for(overrides={"mlpp": "tensor"}), ShardingError, r"did you mean 'mlp'\?"),
        (lambda: hyperjax.strategy_for(overrides={"mlp": 3}), ShardingError, r"shard.mlp=3: give a mesh axis"),
        # arguments of other kinds, and values the rest of the call would take otherwise
        (lambda: hyperjax.parse_axes(None), MeshError, r"parse_axes\(text\): text is None, not a str"),
        (lambda: hyperjax.parse_axes({"data": 2}), MeshError, r"not a str; .* \(a mapping is parsed already\)"),
        (lambda: hyperjax.parse_axes("data=1_0"), MeshError, r"size '1_0' of axis 'data' is not an integer"),
        (lambda: hyperjax.parse_axes("data=\u0663"), MeshError, r"of axis 'data' is not an integer"),
        (
            lambda: hyperjax.make_mesh(HW, {"data": 1}, devices=jax.devices()[0]),
            MeshError,
            r"devices=.* is not a sequence of devices; pass a list",
        ),
        (
            lambda: hyperjax.make_mesh(HW, {"data": 1}, devices=jax.devices()[:1], axis_types=["auto"]),
            MeshError,
            r"axis_types=\['auto'\] must give one jax.sharding.AxisType per mesh axis \(1: data\)",
        ),
        (
            lambda: hyperjax.make_mesh(
                HW, {"data": 2, "tensor": 4}, devices=jax.devices()[:8], axis_types=[jax.sharding.AxisType.Explicit]
            ),
            MeshError,
            r"one jax.sharding.AxisType per mesh axis \(2: data, tensor\)",
        ),
        (
            lambda: hyperjax.axis_spans(HW, {"data": 2, "tensor": 4}, groups={"data": ("data", "tensor")}),
            MeshError,
            r"group 'data' has the name of a mesh axis, whose span it would replace",
        ),
        (lambda: hyperjax.axis_spans(HW, {"data": 8}, groups={"g": ()}), MeshError, r"group 'g' names no mesh axes"),
        (lambda: hyperjax.estimate(hyperjax.resolve(QUICK), cores=[]), ConfigError, r"estimate\(cores=\): cores is"),
        (lambda: hyperjax.plan(QUICK, 8, progress="yes"), ConfigError, r"plan\(progress=\): progress is 'yes'"),
        (
            lambda: hyperjax.plan(QUICK, 8, where=["parallel.tensor=2"]),
            ConfigError,
            r"plan\(where=\): where is \['parallel.tensor=2'\]; pass a mapping",
        ),
        (
            lambda: hyperjax.plan_rl(RL, 8, held=["x"]),
            ConfigError,
            r"plan_rl\(held=\): held is \['x'\]; pass a mapping",
        ),
        (lambda: hyperjax.train(hyperjax.resolve(QUICK), metrics_out=5), ConfigError, r"metrics_out=5 is an int"),
        (lambda: hyperjax.train(hyperjax.resolve(QUICK), log="stdout"), ConfigError, r"train\(log=\): log is"),
        (
            lambda: hyperjax.train(hyperjax.resolve(QUICK), metrics_out=b"m.jsonl"),
            ConfigError,
            r"metrics_out=b'm.jsonl' is a bytes object; give a path",
        ),
        (
            lambda: hyperjax.strategy_for(sequence_parallel="yes"),
            ShardingError,
            r"strategy_for\(sequence_parallel='yes'\): give True or False",
        ),
        (lambda: hyperjax.strategy_for(zero_stage=3), ShardingError, r"strategy_for\(zero_stage=3\): give 0, 1 or 2"),
        (
            lambda: hyperjax.strategy_for(sequence_parallel=1),
            ShardingError,
            r"sequence_parallel=1\): give True or False",
        ),
        (
            lambda: hyperjax.strategy_for(zero_stage=1.0),
            ShardingError,
            r"strategy_for\(zero_stage=1.0\): give 0, 1 or 2",
        ),
        (lambda: hyperjax.train_rl(hyperjax.resolve_rl(RL), log="stdout"), ConfigError, r"train_rl\(log=\): log is"),
        (lambda: hyperjax.train(hyperjax.resolve(QUICK), log=Writer()), ConfigError, r"with write and flush methods"),
        (lambda: hyperjax.load_config(None, ["offload.budget=1"]), ConfigError, r"key offload.budget\. Known keys"),
    ],
)
def test_a_wrong_argument_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_preset_given_by_name_is_loaded():
    by_name = hyperjax.resolve(QUICK, hardware="cloudmatrix384")
    assert by_name.hardware == hyperjax.resolve(QUICK, hardware=HW).hardware
    assert hyperjax.axis_spans("cloudmatrix384", {"data": 8}) == hyperjax.axis_spans(HW, {"data": 8})
    assert hyperjax.default_axes("cloudmatrix384", 8) == hyperjax.default_axes(HW, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metrics_out": "/nonexistent/m.jsonl"}, r"metrics_out='/nonexistent/m.jsonl': folder '/nonexistent' does"),
        ({"out_dir": "FILE"}, r"out_dir='.*a-file' is a file, not a folder"),
        ({"checkpoint_dir": "FILE"}, r"checkpoint_dir='.*a-file' is a file, not a folder"),
        ({"resume": True}, r"resume needs checkpoint_dir"),
    ],
)
def test_train_checks_where_it_writes_before_it_starts(tmp_path, kwargs, message):
    file = tmp_path / "a-file"
    file.write_text("")
    kwargs = {k: str(file) if v == "FILE" else v for k, v in kwargs.items()}
    run = hyperjax.resolve(QUICK)
    with pytest.raises(ConfigError, match=message):
        hyperjax.train(run, **kwargs)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda c: c.ParallelConfig(tensor=2, sequence_parallel="no"), r"parallel.sequence_parallel='no' has the"),
        (lambda c: c.ParallelConfig(zero_stage="1"), r"parallel.zero_stage='1' has the wrong type: expected int"),
        (lambda c: c.ParallelConfig(zero_stage=True), r"parallel.zero_stage=True has the wrong type"),
        (lambda c: c.TrainConfig(lr=float("nan")), r"train.lr=nan must be a finite number"),
        (lambda c: c.TrainConfig(lr="3e-4"), r"train.lr='3e-4' has the wrong type: expected float, got str"),
        (lambda c: c.TrainConfig(seed=1.5), r"train.seed=1.5 has the wrong type: expected int, got float"),
        (lambda c: c.TrainConfig(recompute_modules="qkv"), r"train.recompute_modules='qkv' has the wrong type"),
        (lambda c: c.ModelConfig(norm_eps="1e-5"), r"model.norm_eps='1e-5' has the wrong type"),
        (lambda c: c.ParallelConfig(stage_devices=(4.0, 4.0)), r"parallel.stage_devices=\(4.0, 4.0\) has the wrong"),
        (lambda c: c.Config(model={"layers": 2}), r"^model=\{'layers': 2\} has the wrong type: expected .*ModelConfig"),
        (lambda c: c.Config(train=None), r"^train=None has the wrong type"),
        (lambda c: c.Config(hardware=3), r"^hardware=3 has the wrong type: expected str, got int"),
        (lambda c: c.Config(shard=[("mlp", None)]), r"^shard=\[\('mlp', None\)\] has the wrong type"),
    ],
)
def test_a_config_built_in_python_is_checked_as_yaml_is(build, message):
    from hyperjax import config

    with pytest.raises(ConfigError, match=message):
        build(config)


def test_a_list_for_a_tuple_is_kept_as_a_tuple():
    from hyperjax.config import ParallelConfig

    p = ParallelConfig(pipeline=2, stage_layers=[1, 1])
    assert p.stage_layers == (1, 1) and hash(p) == hash(ParallelConfig(pipeline=2, stage_layers=(1, 1)))


def test_counts_and_overrides_in_other_forms_are_read():
    np = pytest.importorskip("numpy")
    assert hyperjax.default_axes(HW, np.int64(8)) == hyperjax.default_axes(HW, 8)
    assert hyperjax.mesh_axes_for(devices=np.int64(8))["data"] == 8
    assert hyperjax.mesh_axes_for(devices=8, tensor=np.int64(2)) == hyperjax.mesh_axes_for(devices=8, tensor=2)
    assert hyperjax.make_schedule("1f1b", np.int64(4), np.int64(8)) == hyperjax.make_schedule("1f1b", 4, 8)
    assert hyperjax.resolve(QUICK, np.int64(8)) == hyperjax.resolve(QUICK, 8)
    assert hyperjax.strategy_for(sequence_parallel=np.bool_(True)) == hyperjax.strategy_for(sequence_parallel=True)
    assert hyperjax.strategy_for(zero_stage=np.int64(1)) == hyperjax.strategy_for(zero_stage=1)
    grid = hyperjax.make_schedule("interleaved", np.int64(2), np.int64(4), np.int64(2))
    assert {type(v) for v in (grid.stages, grid.microbatches, grid.virtual_stages)} == {int}  # cached for later calls
    model = hyperjax.build_model(QUICK.model, seed=np.int64(0))  # as flax's generator takes a Python int
    assert type(model) is type(hyperjax.build_model(QUICK.model, seed=0))
    held = hyperjax.plan(QUICK, 8, keep=50, where={"parallel.tensor": np.int64(4)}).best
    assert held and {c.overrides["parallel.tensor"] for c in held} == {4}
    overrides = iter(["parallel.tensor=4"])  # an iterator is read whole, once
    assert hyperjax.load_config(CONFIGS / "quickstart.yaml", overrides).parallel.tensor == 4
    assert hyperjax.load_config(CONFIGS / "quickstart.yaml", None) == QUICK
    with pytest.raises(ConfigError, match=r"devices=0 must be a positive integer"):
        hyperjax.resolve_rl(RL, 0)
    with pytest.raises(ConfigError, match=r"shard.mlpp: 'mlpp' is not a logical axis .*did you mean 'mlp'"):
        hyperjax.resolve(hyperjax.load_config(CONFIGS / "quickstart.yaml", ["shard.mlpp=tensor"]))


def test_a_preset_file_may_be_given_as_a_path():
    path = CONFIGS / "hardware" / "cloudmatrix384.yaml"
    cfg = hyperjax.config.Config(hardware=path)
    assert cfg.hardware == str(path) and hyperjax.resolve(cfg).hardware.name == HW.name
