"""The published config.json files of configs/hf/ import as the models the hand-written configs describe:
every architectural field equal (the run settings a config.json lacks, such as the training sequence length
or the attention kernel, are the hand-written config's)."""

import dataclasses
from pathlib import Path

import pytest

from hyperjax import load_config

CONFIGS = Path(__file__).parents[2] / "configs"
PAIRS = {
    "llama3-70b": "llama3-70b",
    "mixtral-8x7b": "mixtral-8x7b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
    "deepseek-v3": "deepseek-v3-671b",
}
RUN_SETTINGS = ("seq_len", "attention_kernel", "attention_impl")
MOE_RUN_SETTINGS = ("capacity_factor", "load_imbalance", "bias_update_rate", "aux_loss_weight")


@pytest.mark.parametrize("name", list(PAIRS))
def test_hand_written_configs_equal_the_published_ones(name):
    by_hand = load_config(CONFIGS / f"{PAIRS[name]}.yaml").model
    imported = load_config(CONFIGS / "hf" / f"{name}.json").model
    if imported.moe is not None:
        keep = {k: getattr(by_hand.moe, k) for k in MOE_RUN_SETTINGS}
        if by_hand.moe.balance == "aux_loss":
            keep.pop("aux_loss_weight")  # a published router_aux_loss_coef is the model's own
        imported = dataclasses.replace(imported, moe=dataclasses.replace(imported.moe, **keep))
    imported = dataclasses.replace(imported, **{k: getattr(by_hand, k) for k in RUN_SETTINGS})
    assert imported == by_hand


@pytest.mark.parametrize("name", ["llama3-8b", "llama3.1-405b"])
def test_other_published_configs_import(name):
    m = load_config(CONFIGS / "hf" / f"{name}.json").model
    assert m.kv_heads == 8 and m.vocab == 128256 and m.norm_eps == 1e-5
    assert (m.rope_scaling is not None) == (name == "llama3.1-405b")
