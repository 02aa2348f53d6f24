"""Generation on a resolved run's mesh: the model's parameters laid out by the run's strategy, prompts split
over its batch axes, and the KV cache laid out like the activations (:mod:`hyperjax.models.decode`)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from hyperjax.config import Run
from hyperjax.models.decode import generate
from hyperjax.shard import Constrainer, place
from hyperjax.topology import make_mesh
from hyperjax.train.prepare import prepare


def generate_on_mesh(
    run: Run, model: nnx.Module, prompt: np.ndarray, max_new_tokens: int, **sampling: object
) -> tuple[jax.Array, jax.Array]:
    """:func:`hyperjax.models.decode.generate` of ``model`` on ``run``'s mesh (one SPMD program); ``sampling``:
    ``temperature``, ``top_k``, ``seed``."""
    mesh = make_mesh(run.hardware, run.axes, devices=jax.devices()[: run.devices])
    graphdef, state = nnx.split(model)
    strategy = prepare(run).strategy.with_param_axes(state)
    params = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, jax.tree.map(place, params, strategy.shardings(params, mesh)))
    tokens = place(np.asarray(prompt), jax.sharding.NamedSharding(mesh, strategy.spec(("batch", "seq"))))
    constrain = Constrainer(strategy=strategy, mesh=mesh)
    return generate(nnx.merge(graphdef, state), tokens, max_new_tokens, constrain=constrain, **sampling)
