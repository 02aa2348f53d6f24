"""The mixture-of-experts MLP against a direct computation, its capacity drops against a direct count, and
the parameters the cost model counts against the NNX model's own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyperjax.config import GATED, ModelConfig, MoEConfig
from hyperjax.cost.counts import active_params, model_tensors
from hyperjax.models import build_model, count_params
from hyperjax.models.layers import activate, no_constraint
from hyperjax.models.moe import MoE, expert_capacity, update_router_biases

SMALL = {"layers": 3, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 256, "seq_len": 16}


def moe_model(family: str = "llama", **moe) -> ModelConfig:
    spec = {"experts": 8, "top_k": 2, "shared_experts": 1, "d_ff": 24, "first_dense": 1, **moe}
    return ModelConfig(family=family, moe=MoEConfig(**spec), **SMALL)


def direct(layer: MoE, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The MoE's output token by token, expert by expert, without packing or exchange."""
    idx, weights, keep, _ = layer.route(x, no_constraint)
    gated = cfg.mlp in GATED
    out = np.zeros(x.shape, np.float32)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            for k in range(cfg.moe.top_k):
                if not keep[b, s, k]:
                    continue
                e = int(idx[b, s, k])
                h = x[b, s] @ layer.w_in[...][e]
                gate = x[b, s] @ layer.w_gate[...][e] if gated else None
                if cfg.bias:
                    h = h + layer.b_in[...][e]
                    gate = gate + layer.b_gate[...][e] if gated else None
                y = activate(cfg.mlp, h, gate) @ layer.w_out[...][e]
                if cfg.bias:
                    y = y + layer.b_out[...][e]
                out[b, s] += float(weights[b, s, k]) * np.asarray(y)
    if cfg.moe.shared_experts:
        out += np.asarray(layer.shared(x, no_constraint))
    return out


@pytest.mark.parametrize(
    ("family", "moe"),
    [
        ("llama", {}),
        ("gpt", {"router": "sigmoid", "balance": "bias", "shared_experts": 0}),  # biased, GELU, no shared
        ("llama", {"top_k": 1, "normalize_top_k": False, "capacity_factor": 1.0}),  # Switch: top-1, drops
        ("llama", {"top_k": 8}),  # every expert
    ],
)
def test_moe_matches_a_direct_computation(family, moe):
    cfg = moe_model(family, **moe)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    if cfg.moe.balance == "bias":  # a bias that changes the choice, never the weights
        layer.router_bias[...] = jnp.linspace(-0.5, 0.5, cfg.moe.experts)
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model), jnp.float32)
    y, stats = layer(x, no_constraint)
    np.testing.assert_allclose(np.asarray(y), direct(layer, cfg, x), rtol=2e-5, atol=2e-6)
    assert float(stats.routed) == 2 * 16 * cfg.moe.top_k
    assert float(stats.load.sum()) == 2 * 16 * cfg.moe.top_k


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_dropped_copies_match_a_direct_count(factor):
    cfg = moe_model(capacity_factor=factor)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (4, 16, cfg.d_model), jnp.float32) * 3
    idx, _, keep, stats = layer.route(x, no_constraint)
    capacity = expert_capacity(cfg.moe, 4 * 16)
    # every token's first choice before any second choice, then token order
    taken = np.zeros(cfg.moe.experts, int)
    kept = np.zeros(idx.shape, bool)
    flat = np.asarray(idx).reshape(-1, cfg.moe.top_k)
    for k in range(cfg.moe.top_k):
        for t in range(flat.shape[0]):
            e = flat[t, k]
            kept.reshape(-1, cfg.moe.top_k)[t, k] = taken[e] < capacity
            taken[e] += 1
    np.testing.assert_array_equal(np.asarray(keep), kept)
    assert float(stats.dropped) == (~kept).sum()
    assert factor > 0.5 or (~kept).sum() >= kept.size / 2  # half the capacity drops at least half the copies


def test_router_bias_moves_towards_the_mean_load():
    params = {"blocks": {1: {"mlp": {"router_bias": jnp.zeros(4)}}, 2: {"mlp": {"router_bias": jnp.zeros(4)}}}}
    load = jnp.array([[4.0, 0.0, 2.0, 2.0], [1.0, 1.0, 1.0, 5.0]])
    out = update_router_biases(params, load, 0.1)
    np.testing.assert_allclose(out["blocks"][1]["mlp"]["router_bias"], [-0.1, 0.1, 0.0, 0.0])
    np.testing.assert_allclose(out["blocks"][2]["mlp"]["router_bias"], [0.1, 0.1, 0.1, -0.1])


ARCHITECTURES = {
    "moe-llama": moe_model(),
    "moe-gpt-every-2": moe_model("gpt", every=2, first_dense=0, shared_experts=0),
    "moe-sigmoid-bias": moe_model(router="sigmoid", balance="bias"),
    "mla": dataclasses.replace(
        moe_model(), attention="mla", kv_lora_rank=16, q_lora_rank=24, rope_head_dim=4, head_dim=8, moe=None
    ),
    "mla-moe-no-q-latent": dataclasses.replace(
        moe_model(), attention="mla", kv_lora_rank=16, rope_head_dim=4, head_dim=8
    ),
}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_counted_tensors_are_the_models(name):
    cfg = ARCHITECTURES[name]
    model = build_model(cfg)
    state = nnx.state(model, nnx.Param)
    built = {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf.shape
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    }
    counted = {t.path: t.shape for t in model_tensors(cfg)}
    assert built == counted
    assert count_params(model) == sum(np.prod(s) for s in counted.values())


def test_active_parameters():
    cfg = moe_model()  # layers 1 and 2 are MoE: 6 of 8 experts idle per token, 3 matrices each
    idle = 2 * 6 * 3 * cfg.d_model * cfg.moe.d_ff
    assert active_params(cfg) == count_params(build_model(cfg)) - idle


def test_logits_and_router_stats():
    cfg = moe_model()
    model = build_model(cfg)
    tokens = jnp.zeros((2, 16), jnp.int32)
    logits, stats = model.forward(tokens)
    assert logits.shape == (2, 16, 256)
    assert stats.load.shape == (2, 8)  # one row per MoE layer (layers 1 and 2)
    np.testing.assert_allclose(model(tokens), logits)
