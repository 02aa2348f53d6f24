"""The two phases of reinforcement learning, each one jitted program on its own submesh (HyperMPMD).

- :class:`Rollout` samples completions: the prompt's prefill, then a scan of one-token decode steps with the
  KV cache (:mod:`hyperjax.models.decode`), compiled once, on the rollout's layout.
- :class:`Learner` scores completions (each sampled token's log-probability) and steps the optimizer on the
  algorithm's loss: the training step of :mod:`hyperjax.train.step` with that loss, on the learner's layout.
- :func:`hand_over` moves the learner's weights to the rollout's shardings: across submeshes when the phases
  are disaggregated, a reshard in place when they are colocated. It copies, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax.config import RLRun
from hyperjax.models import build_model
from hyperjax.models.decode import init_cache, sample_token, step
from hyperjax.rl.losses import FEEDS, LOSSES, token_logp
from hyperjax.shard import Constrainer, place
from hyperjax.train import prepare
from hyperjax.train.checkpoint import restore_params
from hyperjax.train.generate import layout
from hyperjax.train.step import TrainStep, build_train_step, init_state, make_optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollout:
    """The rollout phase on its submesh.

    Attributes:
      mesh: its devices.
      shardings: where each parameter lives on it (the hand-over's destination).
      sample: ``(params, prompts, rows, key) -> completions``, jitted: ``(batch, prompt_len)`` prompts and
        each one's row in the iteration in, ``(batch, max_new_tokens)`` out.
      prompt_sharding: where the prompts go.
      wave: completions decoded together.
    """

    mesh: jax.sharding.Mesh
    shardings: Any
    sample: Any
    prompt_sharding: NamedSharding
    wave: int

    def generate(self, params: Any, prompts: np.ndarray, key: jax.Array) -> np.ndarray:
        """A completion of every prompt, in waves of :attr:`wave`; row ``i``'s tokens are drawn from
        ``key`` folded with ``i``, so they do not depend on the layout, nor on the waves but under a mixture
        of experts' capacity factor, where a wave's tokens compete for capacity (``rl.rollout_batch`` then
        decides them, alike on every layout)."""
        n = len(prompts)
        rows = np.arange(n, dtype=np.int32)
        pad = -n % self.wave  # the last wave filled with copies of the last prompt, their tokens dropped
        prompts, rows = (
            np.concatenate([prompts, prompts[-1:].repeat(pad, 0)]),
            np.concatenate([rows, rows[-1:].repeat(pad)]),
        )
        row_sh = NamedSharding(self.mesh, P(*self.prompt_sharding.spec[:1]))
        out = [
            self.sample(
                params,
                place(prompts[w : w + self.wave], self.prompt_sharding),
                place(rows[w : w + self.wave], row_sh),
                key,
            )
            for w in range(0, len(prompts), self.wave)
        ]
        return np.concatenate([np.asarray(o) for o in out])[:n]


def build_rollout(rl: RLRun) -> Rollout:
    """The rollout program of ``rl`` (compiled on first use)."""
    run, r = rl.rollout, rl.rl
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(run.config.model, dtype=run.dtype)))
    mesh, strategy = layout(run, state, first=rl.rollout_first)
    shapes = nnx.to_pure_dict(state)
    shardings = strategy.shardings(shapes, mesh)
    constrain = Constrainer(strategy=strategy, mesh=mesh)
    new, temperature, top_k = r.max_new_tokens, r.temperature, r.top_k

    def pick(last: jax.Array, keys: jax.Array, i: jax.Array) -> jax.Array:
        """Each row's token at step ``i``, from its own key: the draws do not depend on the batch's split."""
        draw = lambda k, row: sample_token(row[None], jax.random.fold_in(k, i), temperature, top_k)[0]
        return jax.vmap(draw)(keys, last)

    def sample(params: Any, prompts: jax.Array, rows: jax.Array, key: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        b, width = prompts.shape
        keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
        logits, cache = step(model, prompts, init_cache(model, b, width + new), jnp.int32(0), constrain)

        def advance(carry: tuple[jax.Array, Any], i: jax.Array) -> tuple[tuple[jax.Array, Any], jax.Array]:
            last, cache = carry
            token = pick(last, keys, i)
            logits, cache = step(model, token[:, None], cache, width + i, constrain)
            return (logits[:, -1], cache), token

        (last, _), tokens = jax.lax.scan(advance, (logits[:, -1], cache), jnp.arange(new - 1, dtype=jnp.int32))
        return jnp.concatenate([tokens.T, pick(last, keys, jnp.int32(new - 1))[:, None]], axis=1)

    prompt_sharding = NamedSharding(mesh, strategy.spec(("batch", "seq")))
    row_sharding = NamedSharding(mesh, strategy.spec(("batch",)))
    fn = jax.jit(sample, in_shardings=(shardings, prompt_sharding, row_sharding, None), out_shardings=prompt_sharding)
    return Rollout(mesh=mesh, shardings=shardings, sample=fn, prompt_sharding=prompt_sharding, wave=rl.wave)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Learner:
    """The learning phase on its submesh.

    Attributes:
      mesh: its devices.
      step: the training step with the algorithm's loss (``TrainStep.fn(state, batch)``).
      state: ``{"params", "opt_state", "step"}`` now (replaced by :meth:`update`).
      reference: the frozen reference model's parameters (a copy of the starting weights), laid out as
        ``params``, in device or host memory (``rl.reference``); ``None`` when ``rl.kl_coef`` is 0.
      score: ``(params, inputs, targets) -> log-probabilities``, jitted (host-kept parameters come in for it).
      parked, working: where the optimizer state waits during a rollout (host memory) and where it works.
    """

    mesh: jax.sharding.Mesh
    step: TrainStep
    state: Any
    reference: Any
    score: Any
    parked: Any
    working: Any

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The batch on the learner's mesh, each entry where the step expects it."""
        return {k: place(v, self.step.batch_shardings[k]) for k, v in batch.items()}

    def park(self) -> None:
        """The optimizer state to host memory (``rl.offload_optimizer``: colocated rollouts use its room)."""
        self._move(self.parked)

    def unpark(self) -> None:
        """The optimizer state back to where the step reads it."""
        self._move(self.working)

    def _move(self, shardings: Any) -> None:
        moved = jax.device_put(self.state["opt_state"], shardings)
        object.__setattr__(self, "state", {**self.state, "opt_state": jax.block_until_ready(moved)})

    def update(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """One optimizer step on ``batch`` (the state moves on); the step's metrics."""
        state, metrics = self.step.fn(self.state, batch)
        object.__setattr__(self, "state", state)
        return metrics


def build_learner(rl: RLRun, *, init_checkpoint: str | None = None) -> Learner:
    """The learner of ``rl``: its model at ``train.seed`` (or the parameters of the newest checkpoint in
    ``init_checkpoint``), the optimizer, the reference copy and the scoring program.

    Raises:
      ConfigError: ``init_checkpoint`` holds no checkpoint of this model (see :func:`restore_params`).
    """
    run, r, t = rl.learner, rl.rl, rl.learner.config.train
    ready = prepare(run)
    model = build_model(
        run.config.model, dtype=run.dtype, recompute=run.recompute, recompute_modules=t.recompute_modules, seed=t.seed
    )
    graphdef, param_state = nnx.split(model)
    mesh, strategy = layout(run, param_state, first=rl.learner_first)
    optimizer = make_optimizer(t)
    loss = LOSSES[r.algorithm](clip=r.clip, kl_coef=r.kl_coef, temperature=r.temperature)
    train_step = build_train_step(
        graphdef=graphdef,
        param_state=param_state,
        strategy=ready.strategy,
        mesh=mesh,
        optimizer=optimizer,
        microbatches=run.microbatches,
        feeds=FEEDS,
        moe=run.config.model.moe,
        replicas=run.replica_axes,
        loss=loss,
    )
    state = init_state(param_state, optimizer, train_step)
    if init_checkpoint is not None:
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state["params"])
        params = restore_params(init_checkpoint, like, command="rl.init_checkpoint", model=run.config.model).state
        state = init_state_from(params, optimizer, train_step)
    param_sh = train_step.state_shardings["params"]
    kind = "pinned_host" if r.reference == "host" else "device"
    ref_sh = jax.tree.map(lambda sh: sh.with_memory_kind(kind), param_sh)
    frozen = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=ref_sh)  # a copy: the state is donated
    reference = frozen(state["params"]) if r.kl_coef > 0 else None
    constrain = Constrainer(strategy=strategy, mesh=mesh)
    tokens = train_step.batch_sharding
    temperature = r.temperature
    on_device = jax.tree.map(lambda sh: sh.with_memory_kind("device"), param_sh)

    def score(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        params = jax.device_put(params, on_device)  # a host-kept reference comes in for its pass
        return token_logp(nnx.merge(graphdef, params), inputs, targets, constrain, temperature)[0]

    scored = jax.jit(score, in_shardings=(None, tokens, tokens), out_shardings=train_step.batch_shardings["mask"])
    opt_sh = train_step.state_shardings["opt_state"]
    return Learner(
        mesh=mesh,
        step=train_step,
        state=state,
        reference=reference,
        score=scored,
        parked=jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"), opt_sh),
        working=opt_sh,
    )


def init_state_from(params: Any, optimizer: Any, train_step: TrainStep) -> dict[str, Any]:
    """A fresh optimizer's state around ``params`` (already on their shardings)."""
    opt_sh = train_step.state_shardings["opt_state"]
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    step0 = place(np.zeros((), np.int32), NamedSharding(train_step.batch_sharding.mesh, P()))
    return {"params": params, "opt_state": opt_state, "step": step0}


def hand_over(params: Any, shardings: Any) -> Any:
    """``params`` copied onto ``shardings`` (the rollout's), leaving the learner's own untouched."""
    return jax.block_until_ready(jax.device_put(params, shardings, may_alias=False))
