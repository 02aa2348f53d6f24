"""A model's filled parts (and its experts') follow the values they are filled from when it is changed."""

import dataclasses
import pickle

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
