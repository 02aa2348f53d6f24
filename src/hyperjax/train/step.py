"""The training step: model, strategy, mesh and optimizer in; one jitted function out.

The step itself never looks at configuration flags: everything that varies (shardings, ZeRO, gradient
accumulation, recomputation) is decided when it is built and lives in its shardings and in the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax.config import MoEConfig, TrainConfig
from hyperjax.models.layers import cross_entropy
from hyperjax.models.moe import RouterStats, aux_term, update_router_biases
from hyperjax.offload import Placement
from hyperjax.offload.apply import DEVICE, HOST, on_device, place_kinds, to_kind
from hyperjax.shard import Constrainer, Strategy, place
from hyperjax.shard.constrainer import without
from hyperjax.shard.replicas import axes_in, bucket_sum, check_replicas, host_blocks, manual_part
from hyperjax.shard.strategy import spec_entry


def make_optimizer(train: TrainConfig, *, clip: bool = True) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay, global-norm clipping, decay on matrices only.

    ``clip=False`` leaves clipping to the caller (a pipeline clips by the norm over all its stages).
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if train.warmup else train.lr,
        peak_value=train.lr,
        warmup_steps=train.warmup,
        decay_steps=max(train.steps, train.warmup + 1),
        end_value=train.lr * train.min_lr_ratio,
    )
    adamw = optax.adamw(
        schedule,
        b1=train.beta1,
        b2=train.beta2,
        weight_decay=train.weight_decay,
        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
    )
    return optax.chain(optax.clip_by_global_norm(train.grad_clip), adamw) if (train.grad_clip and clip) else adamw


LossFn = Callable[
    [nnx.GraphDef, Any, dict[str, jax.Array], Any], tuple[jax.Array, tuple[dict[str, jax.Array], RouterStats | None]]
]
"""``(graphdef, params, batch, constrain) -> (loss, (measured, router stats))``: the loss a step differentiates
and, apart, the scalars it reports (``measured["loss"]`` among them; each a mean over the batch's rows, so
micro-batches and replicas average them)."""


def loss_fn(
    graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], constrain: Any
) -> tuple[jax.Array, tuple[dict[str, jax.Array], RouterStats | None]]:
    """The training loss of ``batch`` and, apart, its mean next-token cross-entropy (``loss``) and router stats.

    The loss is the cross-entropy over every token plus, for a mixture of experts balanced by an
    auxiliary loss, ``aux_loss_weight`` times the MoE layers' balancing losses. Batch entries other than
    the tokens (``images``) feed the model.
    """
    feeds = {k: v for k, v in batch.items() if k not in ("inputs", "targets")}
    model = nnx.merge(graphdef, params)
    logits, stats = model.forward(batch["inputs"], constrain, **feeds)
    ce = cross_entropy(logits, batch["targets"]).mean()
    return ce + aux_term(model.cfg.moe, stats), ({"loss": ce}, stats)


def router_metrics(stats: RouterStats, microbatches: int = 1) -> dict[str, jax.Array]:
    """Per-step MoE metrics from the router stats summed over ``microbatches`` micro-batches:
    ``aux_loss`` (the balancing loss per MoE layer, 1 when balanced), ``expert_load_max_over_mean`` (the
    busiest expert's routed copies over the mean, worst layer), ``dropped_fraction`` (copies dropped for
    capacity) and ``expert_load`` (routed copies per expert, one row per MoE layer)."""
    load = stats.load
    return {
        "aux_loss": stats.aux_loss / (microbatches * load.shape[0]),
        "expert_load_max_over_mean": jnp.max(load.max(-1) / load.mean(-1)),
        "dropped_fraction": stats.dropped / stats.routed,
        "expert_load": load,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStep:
    """A compiled-on-first-use training step and the shardings it expects.

    Attributes:
      fn: ``(state, batch) -> (state, metrics)``, jitted with the shardings below.
      state_shardings: where ``{"params", "opt_state", "step"}`` live between steps.
      batch_sharding: where each ``(global_batch, seq_len)`` token array lives.
      microbatches: gradient-accumulation steps inside one optimizer step.
      batch_shardings: where every entry of the batch lives (tokens, and images for a vision model).
    """

    fn: Any
    state_shardings: Any
    batch_sharding: NamedSharding
    microbatches: int
    batch_shardings: dict[str, NamedSharding]


def build_train_step(
    *,
    graphdef: nnx.GraphDef,
    param_state: Any,
    strategy: Strategy,
    mesh: jax.sharding.Mesh,
    optimizer: optax.GradientTransformation,
    microbatches: int = 1,
    feeds: dict[str, int] | None = None,
    placement: Any = None,
    moe: MoEConfig | None = None,
    replicas: tuple[str, ...] = (),
    loss: LossFn = loss_fn,
) -> TrainStep:
    """Build the jitted step.

    Args:
      graphdef: the model's structure (from ``nnx.split``).
      param_state: the model's ``nnx.State`` (its variables carry logical axes).
      strategy: the sharding strategy.
      mesh: the device mesh.
      optimizer: the optax transformation.
      microbatches: gradient-accumulation steps (each takes every ``microbatches``-th sequence, so each
        micro-batch is spread over all data-parallel replicas without moving data).
      feeds: extra batch entries the model takes, by name and rank (``{"images": 4}``), split over batch.
      placement: where parameters, optimizer state and gradients live (a
        :class:`hyperjax.offload.Placement`; ``None``: all on the device). Host-placed state is kept in
        ``pinned_host`` between steps and moved to the device inside the step.
      moe: the model's mixture of experts, if any (its router stats become metrics).
      replicas: mesh axes whose replicas compute their gradients apart and sum them in flat buffers
        (a run's ``replica_axes``, see :mod:`hyperjax.shard.replicas`); empty: every reduction is XLA's.
      loss: what the step differentiates and reports (:data:`LossFn`; default the next-token cross-entropy).
        Batch entries it reads beyond the tokens come in through ``feeds``.
    """
    placement = placement if placement is not None else Placement(())
    strategy = strategy.with_param_axes(param_state)
    params = nnx.to_pure_dict(param_state)
    param_sh = place_kinds(strategy.shardings(params, mesh), placement, "params")
    grad_sh = place_kinds(strategy.shardings(params, mesh, role="gradients"), placement, "gradients")
    opt_state_shape = jax.eval_shape(optimizer.init, params)
    opt_sh = place_kinds(strategy.shardings(opt_state_shape, mesh, role="optimizer"), placement, "optimizer")
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    state_sh = {"params": param_sh, "opt_state": opt_sh, "step": replicated}
    batch_sh = NamedSharding(mesh, strategy.spec(("batch", "seq")))
    batch_shs = {"inputs": batch_sh, "targets": batch_sh}
    for name, rank in (feeds or {}).items():
        batch_shs[name] = NamedSharding(mesh, strategy.spec(("batch",) + (None,) * (rank - 1)))
    manual = check_replicas(strategy, params, mesh, replicas)
    constrain = Constrainer(strategy=strategy, mesh=mesh, manual=manual)
    grads_in_use = jax.tree.map(lambda s: s.spec, on_device(param_sh))

    def grads_of(p: Any, batch: dict[str, jax.Array]) -> tuple[tuple[jax.Array, Any], Any]:
        (_, measured), grads = jax.value_and_grad(loss, argnums=1, has_aux=True)(graphdef, p, batch, constrain)
        return measured, grads

    def replica(p: Any, batch: dict[str, jax.Array]) -> tuple[tuple[jax.Array, Any], Any]:
        """Loss, router stats and gradients of the rows this replica holds (the whole batch with no manual axes)."""
        grad_here = inside(grad_sh, manual)
        if microbatches == 1:
            (measured, stats), grads = grads_of(p, batch)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1), batch
            )

            def accumulate(carry: tuple[Any, Any], mb: dict[str, jax.Array]) -> tuple[tuple[Any, Any], None]:
                measured, grads = grads_of(p, mb)
                acc = to_kind(jax.tree.map(jnp.add, to_kind(carry[1], grad_here, DEVICE), grads), grad_here, HOST)
                return (jax.tree.map(jnp.add, carry[0], measured), acc), None

            shapes = jax.eval_shape(lambda: grads_of(p, jax.tree.map(lambda x: x[0], micro))[0])
            zeros = (
                jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes),
                to_kind(jax.tree.map(jnp.zeros_like, p), grad_here, HOST),
            )
            ((measured, stats), grads), _ = jax.lax.scan(accumulate, zeros, micro)
            grads = to_kind(grads, grad_here, DEVICE)
            measured = jax.tree.map(lambda v: v / microbatches, measured)
            grads = jax.tree.map(lambda g: g / microbatches, grads)
        if manual:  # each gradient laid out as its parameter, over the axes not split outside
            grads = jax.lax.with_sharding_constraint(grads, inside(on_device(param_sh), manual))
        return (measured, stats), grads

    def gradients(p: Any, batch: dict[str, jax.Array]) -> tuple[tuple[jax.Array, Any], Any]:
        """The batch's loss, router stats and gradients: per replica, then summed in buckets."""
        if not manual:
            return replica(p, batch)
        specs, tree = jax.tree.flatten(grads_in_use, is_leaf=lambda s: isinstance(s, P))
        over = [tuple(a for a in manual if a not in axes_in(s)) for s in specs]

        def body(p: Any, batch: dict[str, jax.Array]) -> tuple[Any, ...]:
            (measured, stats), grads = replica(p, batch)
            aux = jnp.zeros((1,)) if stats is None else stats.aux_loss[None]  # each replica's own
            shared = None if stats is None else stats._replace(aux_loss=jnp.zeros(()))  # the same everywhere
            return jax.tree.map(lambda v: v[None], measured), aux, shared, [g[None] for g in jax.tree.leaves(grads)]

        in_specs = (jax.tree.map(lambda s: manual_part(s, manual), grads_in_use), {k: P(manual) for k in batch})
        grad_specs = [P(spec_entry(o), *manual_part(s, manual)) for s, o in zip(specs, over, strict=True)]
        out_specs = (P(manual), P(manual), P(), grad_specs)
        measured, aux, stats, stacked = jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(manual), check_vma=False
        )(p, batch)
        values, named = jax.tree.flatten(measured)
        summed = bucket_sum(
            [*values, aux, *stacked],
            mesh=mesh,
            specs=[P()] * (len(values) + 1) + specs,
            over=[manual] * (len(values) + 1) + over,
            hosts=host_blocks(mesh, manual),
        )
        n, k = constrain.replicas, len(values)
        if stats is not None:
            stats = stats._replace(aux_loss=summed[k] / n)
        measured = jax.tree.unflatten(named, [v / n for v in summed[:k]])
        return (measured, stats), jax.tree.unflatten(tree, [g / n for g in summed[k + 1 :]])

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        p = to_kind(state["params"], param_sh, DEVICE)  # host-placed layers come to the device for the step
        opt_state = to_kind(state["opt_state"], opt_sh, DEVICE)
        (measured, stats), grads = gradients(p, batch)
        grads = jax.lax.with_sharding_constraint(grads, on_device(grad_sh))
        updates, opt_state = optimizer.update(grads, opt_state, p)
        new_params = optax.apply_updates(p, updates)
        if moe is not None and moe.balance == "bias":
            new_params = update_router_biases(new_params, stats.load, moe.bias_update_rate)
        new_params = jax.lax.with_sharding_constraint(new_params, on_device(param_sh))
        metrics = {**measured, "grad_norm": optax.tree.norm(grads)}
        if stats is not None:
            metrics |= router_metrics(stats, microbatches)
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics  # the output shardings put host-placed state back on the host

    fn = jax.jit(step, in_shardings=(state_sh, batch_shs), out_shardings=(state_sh, replicated), donate_argnums=0)
    return TrainStep(
        fn=fn, state_shardings=state_sh, batch_sharding=batch_sh, microbatches=microbatches, batch_shardings=batch_shs
    )


def inside(shardings: Any, manual: Sequence[str]) -> Any:
    """``shardings`` as seen inside ``shard_map`` over the ``manual`` axes (those axes left out)."""
    if not manual:
        return shardings
    mesh = jax.sharding.get_abstract_mesh()
    return jax.tree.map(lambda s: NamedSharding(mesh, without(s.spec, manual), memory_kind=s.memory_kind), shardings)


def init_state(param_state: Any, optimizer: optax.GradientTransformation, step: TrainStep) -> dict[str, Any]:
    """The initial training state, placed on the mesh (every process passes the same host values)."""
    params = jax.tree.map(jax.device_get, nnx.to_pure_dict(param_state))
    host = {"params": params, "opt_state": jax.device_get(optimizer.init(params)), "step": jnp.zeros((), jnp.int32)}
    return jax.tree.map(
        place,
        host,
        step.state_shardings,
    )


def compiled_bytes(compiled: Any) -> int:
    """Bytes per device of a compiled program: arguments + outputs + temporaries - aliased (0 if unknown)."""
    mem = compiled.memory_analysis()
    if mem is None:
        return 0
    return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
