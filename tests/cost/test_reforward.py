"""What a full recomputation re-runs: JAX's rematerialisation (hyperjax's own step) or PyTorch's re-forward."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from hyperjax import estimate, load_config, resolve
from hyperjax.models import build_model

ROOT = Path(__file__).parents[2]


def products(cfg, recompute: str) -> int:
    """The products (``dot_general``) in the jaxpr of the gradient of hyperjax's model under ``recompute``."""
    model = build_model(cfg.model, seed=0, recompute=recompute)
    graph, state = nnx.split(model)
    tokens = jnp.zeros((2, cfg.model.seq_len), jnp.int32)
    grad = jax.grad(lambda s: nnx.merge(graph, s)(tokens).sum())
    return str(jax.make_jaxpr(grad)(state)).count("dot_general")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_rematerialised_block_re_runs_every_product_but_the_mlp_output(family):
    """JAX drops from a rematerialised block's re-forward what its backward does not read: the MLP's output
    product (the block's output is read by no one in its backward). ``train.reforward: needed`` prices that."""
    layers = 2
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"model.family={family}", f"model.layers={layers}"])
    model = build_model(cfg.model, seed=0)
    graph, state = nnx.split(model)
    tokens = jnp.zeros((2, cfg.model.seq_len), jnp.int32)
    forward = str(jax.make_jaxpr(lambda s: nnx.merge(graph, s)(tokens))(state)).count("dot_general")
    per_block = (forward - 1) // layers  # the output layer is one product
    assert per_block >= 7  # queries, keys, values or one, scores, values, output, the MLP's two or three
    assert products(cfg, "full") - products(cfg, "none") == layers * (per_block - 1)


def test_reforward_prices_jax_s_re_forward_or_pytorch_s_whole_one():
    sets = ["emulate.devices=null", "train.recompute=full", "parallel.tensor=2", "model.family=llama"]
    needed, whole = (
        estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*sets, f"train.reforward={r}"])))
        for r in ("needed", "whole")
    )
    a, b = needed.stages[0].parts[0].layer, whole.stages[0].parts[0].layer
    assert b.recompute_s == pytest.approx(b.forward_s)
    # every named activation recomputed: the forward but the MLP's output product
    assert a.recompute_s == pytest.approx(sum(a.recompute_by_name_s.values())) and a.recompute_s < b.recompute_s
    # and the re-forward's tensor-parallel collectives are those before the MLP's output product: one of the
    # forward's two all-reduces, or three of its four halves with sequence parallelism
    plain = estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*sets, "train.recompute=none"])))
    forward_pass = plain.stages[0].parts[0].layer.tensor_comm_s / 2  # the forward's and the backward's
    dropped = 0.25 if needed.run.sequence_parallel else 0.5
    assert forward_pass > 0
    assert b.tensor_comm_s - a.tensor_comm_s == pytest.approx(dropped * forward_pass)
    assert needed.step_time_s < whole.step_time_s
