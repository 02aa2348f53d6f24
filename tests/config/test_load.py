from pathlib import Path

import pytest

from hyperjax import ConfigError, load_config
from hyperjax.config import ModelConfig, TrainConfig

CONFIGS = Path(__file__).parents[2] / "configs"


def test_overrides_are_read_as_yaml():
    cfg = load_config(CONFIGS / "quickstart.yaml", ["parallel.tensor=4", "train.lr=3e-4", "parallel.data=null"])
    assert cfg.parallel.tensor == 4 and cfg.train.lr == 3e-4 and cfg.parallel.data is None


def test_a_moe_key_on_a_model_without_experts_is_refused_unless_it_gives_the_count():
    quick = CONFIGS / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"--set 'model.moe.top_k=1': this model has no experts .* a mixture of "
                       r"8 experts \(the default count\).*--set 'model.moe=\{experts: N, top_k: 1\}'"):  # fmt: skip
        load_config(quick, ["model.moe.top_k=1"])
    from hyperjax.cli.main import main

    assert main(["predict", str(quick), "--set", "model.moe.top_k=1"]) == 2  # the command line exits 2
    # the count first, or the section whole, says it: later keys refine it
    counted = load_config(quick, ["model.moe.experts=4", "model.moe.top_k=1"]).model.moe
    assert (counted.experts, counted.top_k) == (4, 1)
    assert load_config(quick, ["model.moe={top_k: 1}"]).model.moe.top_k == 1
    # a model with experts takes the key; null removes the section
    assert load_config(CONFIGS / "moe-tiny.yaml", ["model.moe.top_k=1"]).model.moe.top_k == 1
    with pytest.raises(ConfigError, match=r"no experts \(no model.moe section\)"):
        load_config(CONFIGS / "moe-tiny.yaml", ["model.moe=null", "model.moe.top_k=1"])
    with pytest.raises(ConfigError, match=r"did you mean model.moe.experts\?"):  # a misspelt key: named as such
        load_config(quick, ["model.moe.expert=8"])


def test_vocabularies_are_checked_when_read_and_when_built():
    with pytest.raises(ConfigError, match=r"train.recompute='ful' is not one of .*did you mean 'full'"):
        load_config(None, ["train.recompute=ful"])
    with pytest.raises(ConfigError, match=r"train.dtype='fp8' is not one of"):
        TrainConfig(dtype="fp8")
    with pytest.raises(ConfigError, match=r"model.positions='alibi' is not one of"):
        ModelConfig(positions="alibi")


def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(tmp_path: Path):
    """YAML itself keeps the last of two equal keys: a config that sets a key twice is refused instead."""
    path = tmp_path / "twice.yaml"
    path.write_text("model:\n  layers: 2\n  d_model: 64\n  layers: 4\n")
    with pytest.raises(
        ConfigError, match=r"twice.yaml' is not valid YAML(.|\n)*key 'layers' is given twice \(first on line 2\)"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"--set 'model=\{layers: 2, layers: 3\}'.*key 'layers' is given twice"):
        load_config(None, ["model={layers: 2, layers: 3}"])
    path.write_text("model: {layers: 2}\ntrain: {lr: 0.001}\nparallel: {tensor: 1}\n")  # equal keys, other mappings
    assert load_config(path).model.layers == 2
    path.write_text("base: &m {layers: 2, d_model: 64}\nmodel: {<<: *m, layers: 3}\n")  # a merge overridden
    with pytest.raises(ConfigError, match="unknown config key base"):  # merged fine; the extra section is the error
        load_config(path)


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


def test_an_fp8_key_of_another_recipe_is_an_error():
    with pytest.raises(ConfigError, match=r"train.fp8.amax_history=16 sets its scales for recipe delayed only, but "):
        load_config(None, ["train.fp8={recipe: tensorwise, amax_history: 16}"])
    with pytest.raises(ConfigError, match=r"train.fp8.block=64 .* recipe blockwise only, .*recipe: blockwise"):
        load_config(None, ["train.fp8={recipe: delayed, block: 64}"])
    assert load_config(None, ["train.fp8={recipe: delayed, amax_history: 16}"]).train.fp8.amax_history == 16
    assert load_config(None, ["train.fp8={recipe: blockwise, block: 64}"]).train.fp8.block == 64
