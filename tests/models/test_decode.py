"""Generation with a KV cache on one device: the first step's logits are the training model's for the prompt
(1e-5 relative, fp32), and greedy decoding gives the tokens of re-running the whole sequence every step."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyperjax import build_model, load_config
from hyperjax.models.decode import CACHE_LAYOUTS, cache_bytes, generate, init_cache
from hyperjax.resolver import resolve
from hyperjax.shard import Constrainer
from hyperjax.train.generate import device_cache_bytes, params_like
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


def test_a_padded_batch_is_refused_under_a_capacity_factor():
    """Copies of the last prompt pad a batch the data axes do not divide; under a capacity factor they would
    take the experts' capacity from the prompts' own tokens, and the tokens would change with the layout."""
    from hyperjax import ConfigError, resolve
    from hyperjax.train.generate import generate_on_mesh

    sets = ["model.layers=2", "model.moe.capacity_factor=1.0", "parallel.expert=2", "parallel.tensor=1"]
    cfg = load_config(CONFIGS / "moe-tiny.yaml", sets)
    prompt = np.random.default_rng(0).integers(0, cfg.model.vocab, (3, 5)).astype(np.int32)
    with pytest.raises(ConfigError, match=r"capacity_factor=1.0: .* 3 prompt\(s\) padded to 8 .* multiple of 8"):
        generate_on_mesh(resolve(cfg, 8), build_model(cfg.model, seed=0), prompt, 2)


@pytest.mark.parametrize(
    ("sets", "dtype"),
    [(["model.family=llama", "model.kv_heads=2"], "float32"), (["model.layers=2", *DEEPSEEK_PARTS], "bfloat16")],
    ids=["gqa-fp32", "mla-bf16"],
)
def test_cache_bytes_are_the_bytes_init_cache_allocates(sets, dtype):
    """What ``generate`` checks against memory before it allocates is what the cache it allocates holds."""
    cfg = load_config(CONFIGS / ("quickstart.yaml" if "model.family=llama" in sets else "moe-tiny.yaml"), sets)
    model = nnx.eval_shape(lambda: build_model(cfg.model, dtype=dtype, seed=0))
    cache = jax.eval_shape(lambda: init_cache(model, 3, 17))
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert held == cache_bytes(cfg.model, dtype, 3, 17) > 0


@pytest.mark.parametrize(
    ("name", "sets", "copies"),
    [
        ("quickstart", ["model.family=llama", "model.kv_heads=2", "parallel.tensor=2"], 1),  # heads over tensor
        # every tensor device keeps the whole latent: two copies of the cache over tensor 2
        ("moe-tiny", ["model.layers=2", *DEEPSEEK_PARTS, "parallel.expert=2", "parallel.tensor=2"], 2),
    ],
    ids=["gqa", "mla"],
)
def test_one_devices_share_of_the_cache_is_what_the_layout_gives_it(name, sets, copies):
    """What generate's memory check counts per device is the shard XLA gives one device when the cache is laid
    out as decoding lays it out (4 sequences over the batch axes, 8 devices)."""
    run = resolve(load_config(CONFIGS / f"{name}.yaml", sets), 8)
    graphdef, state, laid_out, _ = params_like(run)
    mesh, strategy = laid_out
    model, constrain = nnx.merge(graphdef, state), Constrainer(strategy=strategy, mesh=mesh)
    layout = CACHE_LAYOUTS[run.config.model.attention]
    cache = jax.jit(lambda: [[constrain(x, layout) for x in c] for c in init_cache(model, 4, 10)])()
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(cache))
    assert held == device_cache_bytes(run, laid_out, 4, 10)
    assert held * 8 == copies * cache_bytes(run.config.model, run.dtype, 4, 10)


def test_generate_names_both_settings_a_token_split_over_experts_needs():
    """parallel.expert_tensor=1 needs sequence parallelism, which generation cannot run: the fix names both
    keys. Before, turning sequence parallelism off met the config check, which asked to turn it back on."""
    from hyperjax import ConfigError, resolve
    from hyperjax.train.generate import check_generable

    sets = ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1"]
    with pytest.raises(ConfigError, match=r"--set parallel.sequence_parallel=false --set parallel.expert_tensor=null"):
        check_generable(resolve(load_config(CONFIGS / "moe-tiny.yaml", sets), 8))
    fixed = [*sets, "parallel.sequence_parallel=false", "parallel.expert_tensor=null"]
    check_generable(resolve(load_config(CONFIGS / "moe-tiny.yaml", fixed), 8))
