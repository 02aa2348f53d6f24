"""A pipeline's training state on the host, for checkpoints.

Each chunk's parameters and optimizer state live only in the processes of its stage's submesh, and a
stage may span several processes or share one with others. A checkpoint wants one complete value: every
chunk's state is gathered whole onto process 0 (:func:`to_host`), which writes it; a restore reads the
host value in every process and places each chunk on the submesh that holds it in the new run
(:func:`from_host`), whatever its processes and devices. The host value has the same structure in every
process and every run of the same model and pipeline layout (:func:`host_like`), so a checkpoint moves
between process counts.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from hyperjax.mpmd.runner import PipelineRunner
from hyperjax.mpmd.transfer import to_process0
from hyperjax.shard import place


def host_like(runner: PipelineRunner) -> dict[str, Any]:
    """The shapes and dtypes of every chunk's parameters and optimizer state (the same in every process)."""
    params = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ch.host_params) for ch in runner.chunks]
    opt = [jax.eval_shape(runner.optimizer.init, runner.trained(p, c)) for c, p in enumerate(params)]
    return {"params": params, "opt_state": opt}


def to_host(runner: PipelineRunner, state: dict[str, Any], step: int) -> dict[str, Any] | None:
    """Every chunk's state as host arrays on process 0 (``None`` in the others); every process calls it."""
    like = host_like(runner)
    out: dict[str, list] = {"params": [], "opt_state": []}
    for kind in ("params", "opt_state"):
        for c, ch in enumerate(runner.chunks):
            shapes, tree = jax.tree.flatten(like[kind][c])
            values = jax.tree.leaves(state[kind][c]) if ch.mine else [None] * len(shapes)
            leaves = [
                to_process0(v, ch.mesh, s, f"hyperjax/checkpoint/{step}/{kind}/{c}/{i}")
                for i, (v, s) in enumerate(zip(values, shapes, strict=True))
            ]
            out[kind].append(jax.tree.unflatten(tree, leaves))
    return out if jax.process_index() == 0 else None


def from_host(runner: PipelineRunner, host: dict[str, Any], step: int) -> dict[str, Any]:
    """The training state of ``runner`` from a host value (:func:`to_host`), each chunk placed on its
    submesh where this process holds it."""
    params, opt = [], []
    for c, ch in enumerate(runner.chunks):
        if not ch.mine:
            params.append(None)
            opt.append(None)
            continue
        params.append(jax.tree.map(lambda x, s: place(np.asarray(x), s), host["params"][c], ch.param_sh))
        opt.append(jax.tree.map(lambda x, s: place(np.asarray(x), s), host["opt_state"][c], ch.opt_sh))
    return {"params": params, "opt_state": opt, "step": step}
