from pathlib import Path

import pytest

from hyperjax import ConfigError, ShardingError
from hyperjax.train import load_config, plan_run

CONFIGS = Path(__file__).parents[2] / "configs"


def test_shipped_configs_plan():
    quick = plan_run(load_config(CONFIGS / "quickstart.yaml"))
    assert quick.devices == 8 and quick.processes == 1
    big = load_config(CONFIGS / "gpt-tiny-cm384.yaml")
    plan = plan_run(big)
    assert plan.devices == 384 and plan.axes["data"] > 1 and plan.axes["tensor"] > 1
    assert plan.processes > 1


def test_overrides_and_yaml_values():
    cfg = load_config(
        CONFIGS / "quickstart.yaml",
        ["parallel.tensor=4", "train.lr=3e-4", "parallel.data=null", "parallel.sequence_parallel=true"],
    )
    assert cfg.parallel.tensor == 4 and cfg.train.lr == 3e-4 and cfg.parallel.sequence_parallel
    assert plan_run(cfg).axes == {"data": 2, "fsdp": 1, "context": 1, "tensor": 4}


@pytest.mark.parametrize(
    ("sets", "error", "pattern"),
    [
        (["paralel.tensor=2"], ConfigError, r"unknown config key paralel; did you mean parallel\?"),
        (["train.stesp=3"], ConfigError, r"unknown config key train.stesp; did you mean train.steps\?"),
        (["train.steps=many"], ConfigError, r"train.steps='many' has the wrong type: expected int"),
        (["train.steps=0"], ConfigError, r"train.steps=0 must be a positive integer"),
        (["train.dtype=float16"], ConfigError, r"train.dtype='float16' is not one of"),
        (["train.lr=-1"], ConfigError, r"train.lr=-1.0 must be > 0"),
        (["model.heads=6"], ConfigError, r"model.d_model=256 is not divisible by model.heads=6"),
        (["model.vocab=100"], ConfigError, r"train.data=text reads bytes .* model.vocab=100"),
        (["parallel.zero_stage=3"], ConfigError, r"zero_stage=3 must be 0, 1 or 2; for stage 3 set parallel.fsdp"),
        (
            ["parallel.tensor=1", "parallel.sequence_parallel=true"],
            ConfigError,
            r"sequence_parallel=true needs parallel.tensor > 1",
        ),
        (
            ["parallel.data=3"],
            ShardingError,
            r"data=3 x fsdp=1 x context=1 x tensor=2 x pipeline=1 = 6, but there are 8 devices",
        ),
        (["parallel.tensor=16"], ShardingError, r"do not divide the 8 devices"),
        (
            ["parallel.tensor=8", "model.heads=4"],
            ShardingError,
            r"dimension '(kv_)?heads' of size 4 is not divisible by mesh axes \('tensor',\) of total size 8",
        ),
        (
            ["parallel.tensor=1", "parallel.context=8", "model.seq_len=100"],
            ShardingError,
            r"activation tokens': dimension 'seq' of size 100 is not divisible",
        ),
        (["train.micro_batch=3"], ConfigError, r"train.global_batch=32 is not a multiple of train.micro_batch=3 x 4"),
        (
            ["parallel.pipeline=2", "parallel.tensor=1", "train.microbatches=3"],
            ConfigError,
            r"train.global_batch=32 in train.microbatches=3 micro-batches",
        ),
        (["shard.vocab=tensr"], ShardingError, r"shard.vocab: mesh axis 'tensr' does not exist"),
        (["hardware=cm384"], Exception, r"unknown hardware preset 'cm384'"),
        (
            ["emulate.devices=384", "emulate.processes=1", "train.global_batch=384"],
            Exception,
            r"384 devices per process .* 256-device limit",
        ),
        (["model=3"], ConfigError, r"model must be a mapping of keys"),
    ],
)
def test_bad_configs(sets, error, pattern):
    with pytest.raises(error, match=pattern):
        plan_run(load_config(CONFIGS / "quickstart.yaml", sets))


def test_bad_files(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"config file '.*missing.yaml' does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {layers: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"--set 'tensor' is not KEY=VALUE"):
        load_config(None, ["tensor"])
