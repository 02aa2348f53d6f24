import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyperjax import ConfigError
from hyperjax.config import ModelConfig, VisionConfig
from hyperjax.cost.counts import count_params as counted_params
from hyperjax.cost.counts import model_tensors
from hyperjax.models import build_model, count_params
from hyperjax.models.layers import attention_core, softmax_kept

SMALL = {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 128, "vocab": 256, "seq_len": 16}

# architectures described by their parts: the presets and shapes apart from them
ARCHITECTURES = {
    "gpt": {"family": "gpt"},
    "llama": {"family": "llama"},
    "llama-gqa": {"family": "llama", "kv_heads": 2},
    "parallel-block": {"family": "gpt", "block": "parallel", "bias": False},
    "head-dim-apart": {"family": "llama", "head_dim": 24, "kv_heads": 2},
    "relu-untied": {"family": "gpt", "mlp": "relu", "tie_embeddings": False},
    "geglu-rope-bias": {"family": "gpt", "mlp": "geglu", "positions": "rope", "norm": "rmsnorm"},
    "palm": {"family": "llama", "block": "parallel", "tie_embeddings": True, "rope_theta": 500000.0},
}


def expected_params(cfg: ModelConfig) -> int:
    """The parameter count written out by hand for the two presets (GPT-2 and Llama)."""
    d, f, v, s, hd, kv = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.seq_len, cfg.head_dim, cfg.kv_heads
    if cfg.family == "gpt":  # biases, LayerNorm scale+bias, learned positions, tied head
        block = 2 * 2 * d + d * d + 2 * d * kv * hd + d * d + 3 * cfg.heads * hd + d + 2 * d * f + f + d
        return v * d + s * d + cfg.layers * block + 2 * d
    block = 2 * d + 2 * d * d + 2 * d * kv * hd + 3 * d * f
    return v * d + cfg.layers * block + d + d * v


@pytest.mark.parametrize(("family", "kv"), [("gpt", None), ("llama", None), ("llama", 2)])
def test_parameter_count_and_logical_axes(family, kv):
    cfg = ModelConfig(family=family, kv_heads=kv, **SMALL)
    model = build_model(cfg)
    assert count_params(model) == expected_params(cfg) == counted_params(cfg)
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)
    ):
        axes = var.get_metadata()["logical_axes"]
        assert len(axes) == var.get_value().ndim, path


def state_tensors(model: nnx.Module) -> dict[str, tuple]:
    out = {}
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)
    ):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        out[name] = (tuple(var.get_value().shape), tuple(var.get_metadata()["logical_axes"]))
    return out


@pytest.mark.parametrize("name", [*ARCHITECTURES, "vision"])
def test_the_counted_tensors_are_the_models_own(name):
    """The cost model's tensor list (path, shape, logical axes) is exactly the NNX model's state."""
    if name == "vision":
        cfg = ModelConfig(family="llama", kv_heads=2, vision=VisionConfig(), **SMALL)
    else:
        cfg = ModelConfig(**{**SMALL, **ARCHITECTURES[name]})
    model = nnx.eval_shape(lambda: build_model(cfg))
    counted = {t.path: (t.shape, t.axes) for t in model_tensors(cfg)}
    assert counted == state_tensors(model)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_runs(name):
    cfg = ModelConfig(**{**SMALL, **ARCHITECTURES[name]})
    logits = build_model(cfg)(jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 256) and np.isfinite(np.asarray(logits)).all()


def test_family_presets_fill_the_parts():
    gpt, llama = ModelConfig(family="gpt"), ModelConfig(family="llama")
    assert (gpt.norm, gpt.mlp, gpt.positions, gpt.tie_embeddings, gpt.bias) == (
        "layernorm",
        "gelu",
        "learned",
        True,
        True,
    )
    assert (llama.norm, llama.mlp, llama.positions, llama.tie_embeddings, llama.bias) == (
        "rmsnorm",
        "swiglu",
        "rope",
        False,
        False,
    )
    assert ModelConfig(family="llama", mlp="gelu").mlp == "gelu"  # a part given wins over the preset
    assert ModelConfig(d_model=64, heads=4).head_dim == 16 and ModelConfig(heads=4, head_dim=96).attn_width == 384


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_recompute_keeps_outputs_and_gradients(family):
    cfg = ModelConfig(family=family, **SMALL)
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.seq_len), 0, cfg.vocab)

    def loss_and_grads(recompute: str, modules=None):
        model = build_model(cfg, recompute=recompute, recompute_modules=modules)
        if modules is not None:  # the named activations are recomputed, the rest kept
            assert model.policies[0] == (("qkv", "attn_core", "attn_out", "mlp_hidden"), ())
        graphdef, state = nnx.split(model)
        return jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p)(tokens).mean()))(nnx.to_pure_dict(state))

    ref_loss, ref_grads = loss_and_grads("none")
    for mode, modules in (("selective", None), ("full", None), ("selective", ("mlp_act", "norms"))):
        loss, grads = loss_and_grads(mode, modules)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_compute_keeps_fp32_parameters():
    model = build_model(ModelConfig(family="llama", kv_heads=2, **SMALL), dtype="bfloat16")
    logits = model(jnp.zeros((2, 16), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 16, 256)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("name", ["gpt", "parallel-block", "head-dim-apart"])
def test_causal(name):
    model = build_model(ModelConfig(**{**SMALL, **ARCHITECTURES[name]}))
    a = jnp.arange(16)[None] % 256
    b = a.at[0, 10].set(99)
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[0, :10], lb[0, :10], rtol=1e-6)  # the future does not leak back
    assert not np.allclose(la[0, 10:], lb[0, 10:])


@pytest.mark.parametrize(("heads", "kv"), [(8, 8), (8, 2), (8, 1)])
def test_materialized_attention_is_each_heads_softmax_and_transposes_no_score_matrix(heads, kv):
    """Each query head attends to its key head (``h // (heads / kv)``) as a softmax written out per head; the
    program, forward and backward, never transposes an array as large as the scores (the layout
    ``grouped_scores`` keeps: a grouped-query model's scores were moved through memory again)."""
    rng = np.random.default_rng(0)
    b, s, d, dv = 2, 24, 16, 12
    q = rng.standard_normal((b, s, heads, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kv, dv)).astype(np.float32)
    out = np.asarray(attention_core(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, kernel="materialized"))
    for h in range(heads):
        g = h // (heads // kv)
        scores = np.einsum("bqd,bsd->bqs", q[:, :, h], k[:, :, g]) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[:, :, h], np.einsum("bqs,bsd->bqd", probs, v[:, :, g]), rtol=1e-5, atol=1e-6)

    def loss(q, k, v):
        return attention_core(q, k, v, causal=True, kernel="materialized").sum() ** 2

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    moved = [e.outvars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "transpose"]
    assert moved, "the small transposes of queries and outputs are in the program"
    assert all(np.prod(shape) < b * heads * s * s for shape in moved), moved


@pytest.mark.parametrize("seed", [0, 1])
def test_the_attention_softmax_s_gradient_is_jax_s_in_float32_and_reads_rounded_probabilities_in_bfloat16(seed):
    """``softmax_kept``'s derivative, which reads the kept probabilities: in float32 it is
    :func:`jax.nn.softmax`'s; in bfloat16 it reads the bfloat16 probabilities (as PyTorch's softmax backward
    reads its 16-bit output), each element within a few bfloat16 roundings of the float32 gradient
    ``p (w - sum p w)``, bounded by ``p (|w| + sum p |w|)``; masked scores get a gradient of exactly 0."""
    rng = np.random.default_rng(seed)
    causal = jnp.tril(jnp.ones((16, 16), bool))
    scores = jnp.where(causal, jnp.asarray(3 * rng.standard_normal((2, 3, 16, 16)), jnp.float32), -jnp.inf)
    w = jnp.asarray(rng.standard_normal((2, 3, 16, 16)), jnp.float32)
    want = jax.grad(lambda s: (w * jax.nn.softmax(s, axis=-1)).sum())(scores)
    got = jax.grad(lambda s: (w * softmax_kept(s, jnp.float32)).sum())(scores)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    half = jax.grad(lambda s: (w * softmax_kept(s, jnp.bfloat16).astype(jnp.float32)).sum())(scores)
    assert half.dtype == jnp.float32 and np.isfinite(half).all() and not np.asarray(half)[:, :, ~causal].any()
    p = jax.nn.softmax(scores, axis=-1)
    bound = p * (jnp.abs(w) + (p * jnp.abs(w)).sum(-1, keepdims=True))
    assert (np.abs(half - want) <= 2**-6 * bound).all()  # a bfloat16 rounding is 2**-8 relative
    assert np.abs(half - want).mean() > 1e-4 * np.abs(want).mean()  # float32's gradient would be within 1e-6


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"family": "bert"}, r"model.family='bert' is not one of"),
        ({"mlp": "swigelu"}, r"model.mlp='swigelu' is not one of .*; did you mean 'swiglu'\?"),
        ({"norm": "batchnorm"}, r"model.norm='batchnorm' is not one of"),
        ({"block": "parralel"}, r"model.block='parralel' is not one of .*did you mean 'parallel'"),
        ({"heads": 5}, r"model.d_model=64 is not divisible by model.heads=5; .* or give model.head_dim"),
        ({"kv_heads": 3}, r"model.kv_heads=3 must divide model.heads=4"),
        ({"layers": 0}, r"model.layers=0 must be a positive integer"),
        ({"head_dim": 0}, r"model.head_dim=0 must be a positive integer or null"),
        ({"family": "llama", "head_dim": 15}, r"model.positions=rope .* model.head_dim=15 is odd"),
        ({"family": "llama", "rope_theta": 0.0}, r"model.rope_theta=0.0 must be > 0"),
        ({"rope_theta": 5e5}, r"model.rope_theta=500000.0 is the rotary base frequency, but model.positions='learned'"),
        ({"family": "gpt", "vision": VisionConfig()}, r"model.vision needs model.positions: rope"),
    ],
)
def test_config_errors(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig(**{**SMALL, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"recompute": "some"}, r"recompute='some' is not one of"),
        ({"dtype": "float16"}, r"dtype='float16' is not one of"),
        ({"overlap": "two_microbatch"}, r"overlap='two_microbatch' is not one of \('none', 'two-microbatch'"),
        ({"recompute": "selective", "recompute_modules": ("foo",)}, r"recompute_modules=\('foo',\) must be a tuple"),
        ({"recompute": "selective", "recompute_modules": "qkv"}, r"recompute_modules='qkv' must be a tuple of one"),
        ({"recompute_modules": ("qkv",)}, r"recompute_modules=\('qkv',\) names .* but recompute='none'"),
        ({"seed": "0"}, r"seed='0' must be an integer"),
        ({"policies": ()}, r"policies has 0 entries; give one per layer \(model.layers=2\)"),
    ],
)
def test_build_errors(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_model(ModelConfig(**SMALL), **kwargs)


def test_build_takes_a_model_config():
    with pytest.raises(ConfigError, match=r"cfg is a dict, not a ModelConfig; pass a config's model"):
        build_model({"layers": 1})


def test_queries_from_a_start_position_see_the_keys_up_to_their_own():
    """A decode step's queries at ``start ..`` over a cache of keys from position 0 attend as the same rows of
    causal attention over the whole sequence do; keys past a query's position (the cache's unwritten tail)
    change nothing."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 6, 4, 8))  # (b, s, heads, d); grouped over 2 KV heads
    k, v = k[:, :, :2], v[:, :, :2]
    whole = attention_core(q, k, v, causal=True, kernel="materialized")
    part = attention_core(q[:, 3:5], k, v.at[:, 5:].set(1e3), causal=True, kernel="materialized", start=jnp.int32(3))
    np.testing.assert_allclose(part, whole[:, 3:5], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="start=None"):
        attention_core(q[:, 3:5], k, v, causal=True, kernel="flash", start=jnp.int32(3))
    with pytest.raises(ValueError, match="2 queries over 6 keys"):  # a start left out is not taken as 0
        attention_core(q[:, 3:5], k, v, causal=True, kernel="materialized")
