"""Generation with a KV cache on one device: the first step's logits are the training model's for the prompt
(1e-5 relative, fp32), and greedy decoding gives the tokens of re-running the whole sequence every step."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyperjax import build_model, load_config
from hyperjax.models.decode import generate
from tests.parts import DEEPSEEK_PARTS
from tests.tiers import sweep

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize(
    ("name", "sets"),
    [
        ("quickstart", []),  # GPT: learned positions, tied head
        ("quickstart", ["model.family=llama", "model.kv_heads=2"]),  # RoPE, grouped KV heads
        pytest.param("moe-tiny", ["model.layers=2"], marks=pytest.mark.slow),  # experts (mla-grouped has them too)
        # a cache of the latent and one rotary key
        pytest.param("moe-tiny", ["model.layers=2", *DEEPSEEK_PARTS], marks=pytest.mark.slow),
    ],
    ids=["gpt", "llama-gqa", "moe", "mla-grouped"],
)
def test_cached_greedy_decoding_matches_the_training_model(name, sets):
    cfg = load_config(CONFIGS / f"{name}.yaml", sets)
    model = build_model(cfg.model, seed=0)
    prompt = jnp.array(np.random.default_rng(0).integers(0, cfg.model.vocab, (2, 10)), jnp.int32)
    new, first = generate(model, prompt, 8)[:2]
    last = nnx.jit(lambda m, s: m(s)[:, -1])  # the whole sequence, compiled (eager, each op dispatches alone)
    full = last(model, prompt)
    np.testing.assert_allclose(first, full, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(full))))
    seq, ref = prompt, []
    for _ in range(8):
        token = jnp.argmax(last(model, seq), -1).astype(jnp.int32)
        ref.append(token)
        seq = jnp.concatenate([seq, token[:, None]], 1)
    np.testing.assert_array_equal(new, jnp.stack(ref, 1))


def test_sampling_is_seeded_and_top_k_keeps_to_the_likeliest():
    cfg = load_config(CONFIGS / "quickstart.yaml")
    model = build_model(cfg.model, seed=0)
    prompt = jnp.zeros((1, 4), jnp.int32)
    a, first = generate(model, prompt, 6, temperature=1.0, top_k=3, seed=1)[:2]
    b = generate(model, prompt, 6, temperature=1.0, top_k=3, seed=1).tokens
    np.testing.assert_array_equal(a, b)
    assert int(a[0, 0]) in set(np.argsort(np.asarray(first[0]))[-3:].tolist())


LAYOUTS = [
    ["parallel.tensor=2"],
    ["parallel.tensor=4"],
    ["parallel.data=2", "parallel.tensor=4"],
    ["parallel.fsdp=8"],
    ["parallel.expert=4"],  # the MoE layers' experts spread over 4 devices
]


@pytest.mark.parametrize("sets", sweep(LAYOUTS, fast={0, 3, 4}), ids=lambda s: ",".join(x.split(".")[-1] for x in s))
def test_greedy_tokens_are_the_same_on_every_layout(sets):
    """The inference oracle: the tokens of one device under tensor 2 and 4, data x tensor and fsdp, the KV
    cache split like the activations (heads over tensor, batch over data)."""
    from hyperjax import resolve
    from hyperjax.train.generate import generate_on_mesh

    base = ["model.layers=2", "parallel.expert=1"]
    cfg = load_config(CONFIGS / "moe-tiny.yaml", base)
    prompt = np.random.default_rng(0).integers(0, cfg.model.vocab, (8, 10)).astype(np.int32)
    ref, first = generate(build_model(cfg.model, seed=0), jnp.asarray(prompt), 8)[:2]
    cfg = load_config(CONFIGS / "moe-tiny.yaml", [*base, *sets])
    new, got = generate_on_mesh(resolve(cfg, 8), build_model(cfg.model, seed=0), prompt, 8)[:2]
    np.testing.assert_array_equal(np.asarray(new), np.asarray(ref))
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(first), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(first)))
    )
