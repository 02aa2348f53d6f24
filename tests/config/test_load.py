from pathlib import Path

import pytest

from hyperjax import ConfigError, load_config
from hyperjax.config import ModelConfig, TrainConfig

CONFIGS = Path(__file__).parents[2] / "configs"


def test_overrides_are_read_as_yaml():
    cfg = load_config(CONFIGS / "quickstart.yaml", ["parallel.tensor=4", "train.lr=3e-4", "parallel.data=null"])
    assert cfg.parallel.tensor == 4 and cfg.train.lr == 3e-4 and cfg.parallel.data is None


def test_vocabularies_are_checked_when_read_and_when_built():
    with pytest.raises(ConfigError, match=r"train.recompute='ful' is not one of .*did you mean 'full'"):
        load_config(None, ["train.recompute=ful"])
    with pytest.raises(ConfigError, match=r"train.dtype='fp8' is not one of"):
        TrainConfig(dtype="fp8")
    with pytest.raises(ConfigError, match=r"model.positions='alibi' is not one of"):
        ModelConfig(positions="alibi")


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
    for text in ("", "  \n\t\n", "# only a comment\n"):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=r"config file '.*bad.yaml' is empty"):
            load_config(bad)
