"""A model's filled parts (and its experts') follow the values they are filled from when it is changed."""

import dataclasses
import pickle
from pathlib import Path

import pytest

from hyperjax import ConfigError
from hyperjax.config import ModelConfig, MoEConfig


def test_replace_fills_again_what_the_model_was_not_given():
    m = ModelConfig(family="llama", d_model=512, heads=8)
    wider = m.replace(heads=16)
    assert (wider.kv_heads, wider.head_dim) == (16, 32)
    assert (dataclasses.replace(m, heads=16).kv_heads, dataclasses.replace(m, heads=16).head_dim) == (8, 64)
    assert wider == ModelConfig(family="llama", d_model=512, heads=16)
    gpt = m.replace(family="gpt")
    assert gpt == ModelConfig(family="gpt", d_model=512, heads=8)
    assert (gpt.norm, gpt.positions, gpt.rope_theta, gpt.bias, gpt.qkv_bias) == (
        "layernorm",
        "learned",
        None,
        True,
        True,
    )
    assert pickle.loads(pickle.dumps(m)).replace(heads=4).head_dim == 128


def test_replace_keeps_what_the_model_was_given():
    m = ModelConfig(family="llama", d_model=512, heads=8, kv_heads=2, norm="layernorm", rope_theta=5e5)
    wider = m.replace(heads=16)
    assert (wider.kv_heads, wider.head_dim, wider.norm, wider.rope_theta) == (2, 32, "layernorm", 5e5)
    assert m.replace(kv_heads=None).kv_heads == 8  # None: filled again
    with pytest.raises(ConfigError, match=r"model.kv_heads=2 must divide model.heads=3"):
        m.replace(heads=3, head_dim=64)


def test_replace_of_the_experts_takes_the_new_balance_methods_default():
    moe = MoEConfig(balance="aux_loss")
    assert (moe.aux_loss_weight, moe.bias_update_rate) == (0.01, None)
    bias = moe.replace(balance="bias")
    assert (bias.aux_loss_weight, bias.bias_update_rate) == (None, 0.001)
    with pytest.raises(ConfigError, match=r"model.moe.aux_loss_weight=0.01 applies to model.moe.balance=aux_loss"):
        dataclasses.replace(moe, balance="bias")
    weighted = MoEConfig(aux_loss_weight=0.1)
    with pytest.raises(ConfigError, match=r"model.moe.aux_loss_weight=0.1 applies to"):
        weighted.replace(balance="bias")  # a weight given is kept, and refused under the other method


def test_a_model_deeper_than_the_layer_limit_is_refused_from_the_command_line(capsys):
    """Blocks are counted and priced one by one: ten thousand take seconds, a hundred million ran for hours;
    past the limit the config key, its value and the limit are named, before any work."""
    from hyperjax.cli.main import main
    from hyperjax.config.checks import LAYER_LIMIT
    from hyperjax.config.model import VisionConfig

    ModelConfig(layers=LAYER_LIMIT)
    with pytest.raises(ConfigError, match=r"model.layers=10,001 is more than the 10,000 blocks"):
        ModelConfig(layers=LAYER_LIMIT + 1)
    with pytest.raises(ConfigError, match=r"model.vision.layers=20,000 is more than .*at most 10,000"):
        VisionConfig(layers=20_000)
    quick = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
    assert main(["predict", quick, "--set", "model.layers=100000000"]) == 2
    assert "model.layers=100,000,000 is more than the 10,000 blocks" in capsys.readouterr().err
