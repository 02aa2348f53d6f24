"""A model's filled parts follow the values they are filled from when the model is changed."""

import dataclasses
import pickle

import pytest

from hyperjax import ConfigError
from hyperjax.config import ModelConfig


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
