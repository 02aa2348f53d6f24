"""Mixture-of-experts MLPs with expert parallelism: a router, experts sharded over the ``experts`` axis,
and the exchange that takes every token to its experts and back.

The router runs in ordinary SPMD code (the mesh decides its layout): scores, the top-k experts of each
token, their weights, the load-balancing loss over the whole micro-batch and, with a capacity factor,
which routed copies are kept. The experts run under ``jax.shard_map`` on every device's own tokens: the
routed copies are packed into one send buffer per destination device along the expert axes, exchanged
with ``all_to_all``, sorted by local expert and multiplied in grouped products (``jax.lax.ragged_dot``),
then exchanged back and combined with their weights. Expert weights split over the tensor axis leave
partial sums, reduced over it.

How the exchange is sized. XLA:CPU cannot emit a ragged all-to-all, so the send buffer has a fixed
number of slots per destination: dropless, every copy a device holds could go to one destination
(``tokens x min(top_k, local experts)`` slots); with a capacity factor, a destination's experts take at
most ``local experts x capacity`` copies. A real runtime exchanges only the copies (the cost model
prices that); the emulation moves the padded buffer, and :func:`exchange_slots` is the one place its
size is decided (the runtime inventory reads it too).

Capacity is counted over the whole micro-batch in a fixed priority (every token's first choice before
any second choice, then token order), so which copies are dropped does not depend on the mesh: a run
with a capacity factor loses the same tokens on 1 device and on any layout. (GShard counts per group of
tokens on a device; the totals are the same, the choice of victims is not.)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from hyperjax.config import GATED, Fp8Config, ModelConfig, MoEConfig
from hyperjax.errors import ShardingError
from hyperjax.models.fp8 import GroupAxes, grouped_product
from hyperjax.models.layers import MLP, Constrain, activate, param, use
from hyperjax.models.taps import product


class RouterBias(nnx.Param):
    """DeepSeek-V3's per-expert routing bias (``balance: bias``): added to the scores that choose the
    experts, never to the weights, so it has no gradient; it moves after every step towards the mean
    load (:func:`update_router_biases`)."""


class RouterStats(NamedTuple):
    """What a module's MoE layers report for one micro-batch.

    Attributes:
      aux_loss: the load-balancing losses of its MoE layers, summed (each ``E x sum_e f_e P_e``: 1 when
        perfectly balanced).
      load: routed copies per expert, one row per MoE layer in model order, before any capacity drop.
      dropped: routed copies dropped for capacity.
      routed: routed copies (tokens x top_k, per layer, summed).
      probs: each layer's mean routing probability per expert over the tokens (one row per layer), from
        which two halves' balancing loss is the whole micro-batch's (:func:`combine_halves`).
    """

    aux_loss: jax.Array
    load: jax.Array
    dropped: jax.Array
    routed: jax.Array
    probs: jax.Array


def merge_stats(stats: list[RouterStats | None]) -> RouterStats | None:
    """The stats of consecutive layers as one (loads stacked in order); ``None`` for no MoE layer."""
    found = [s for s in stats if s is not None]
    if not found:
        return None
    return RouterStats(
        aux_loss=sum(s.aux_loss for s in found),
        load=jnp.concatenate([s.load for s in found]),
        dropped=sum(s.dropped for s in found),
        routed=sum(s.routed for s in found),
        probs=jnp.concatenate([s.probs for s in found]),
    )


def combine_halves(a: RouterStats | None, b: RouterStats | None, experts: int) -> RouterStats | None:
    """The stats of a micro-batch from those of its two equal halves (``parallel.overlap: two-microbatch``):
    loads and counts add, and the balancing loss is the micro-batch's, ``E x sum_e (share of copies routed
    to e) x (mean probability of e)`` per layer from the halves' loads and mean probabilities (a half's
    own loss would weigh its probabilities by its own loads)."""
    if a is None or b is None:
        return None
    load, routed = a.load + b.load, a.routed + b.routed
    probs = (a.probs + b.probs) / 2
    aux = experts * jnp.sum(load / (routed / load.shape[0]) * probs)
    return RouterStats(aux_loss=aux, load=load, dropped=a.dropped + b.dropped, routed=routed, probs=probs)


def aux_term(moe: MoEConfig | None, stats: RouterStats | None) -> jax.Array:
    """What the balance method adds to the training loss: ``aux_loss_weight x aux_loss`` under ``aux_loss``."""
    if moe is None or stats is None or moe.balance != "aux_loss":
        return jnp.zeros((), jnp.float32)
    return moe.aux_loss_weight * stats.aux_loss


def exchange_slots(tokens: int, moe: MoEConfig, local_experts: int, capacity: int | None) -> int:
    """Send-buffer slots per destination device for ``tokens`` tokens on one device (see the module
    docstring): ``tokens x min(top_k, local_experts)``, at most ``local_experts x capacity`` with one."""
    slots = tokens * min(moe.top_k, local_experts)
    return slots if capacity is None else min(slots, local_experts * capacity)


def expert_capacity(moe: MoEConfig, tokens: int) -> int | None:
    """Routed copies one expert takes from a micro-batch of ``tokens`` tokens: ``ceil(c x tokens x top_k /
    experts)``; ``None`` when dropless."""
    if moe.capacity_factor is None:
        return None
    return max(1, math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.experts))


class MoE(nnx.Module):
    """A mixture-of-experts MLP (``model.moe``): ``shared(x) + sum over the top_k experts of w_e expert_e(x)``.

    The routed experts' weights are stacked on a leading ``experts`` axis (their hidden width on
    ``expert_mlp``); each expert is an MLP of
    ``moe.d_ff`` of the model's kind (gated or not), the shared experts one dense MLP of
    ``shared_experts x moe.d_ff``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, fp8: Fp8Config | None = None) -> None:
        x = cfg.moe
        self.fp8 = fp8  # the experts' FP8 recipe (None: train.dtype); the router stays float32
        h, e, f = cfg.d_model, x.experts, x.d_ff
        self.moe, self.kind, self.bias = x, cfg.mlp, cfg.bias
        self.router = param(rngs, (h, e), ("embed", None))
        if x.balance == "bias":
            self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,))
        self.w_in = param(rngs, (e, h, f), ("experts", "embed", "expert_mlp"))
        if cfg.gated:
            self.w_gate = param(rngs, (e, h, f), ("experts", "embed", "expert_mlp"))
        self.w_out = param(rngs, (e, f, h), ("experts", "expert_mlp", "embed"), scale=0.02 / (2 * cfg.layers) ** 0.5)
        if cfg.bias:
            self.b_in = param(rngs, (e, f), ("experts", "expert_mlp"), init="zeros")
            if cfg.gated:
                self.b_gate = param(rngs, (e, f), ("experts", "expert_mlp"), init="zeros")
            self.b_out = param(rngs, (e, h), ("experts", "embed"), init="zeros")
        if x.shared_experts:
            self.shared = MLP(
                h, x.shared_experts * f, kind=cfg.mlp, bias=cfg.bias, layers=cfg.layers, rngs=rngs, fp8=fp8
            )

    def __call__(self, x: jax.Array, constrain: Constrain) -> tuple[jax.Array, RouterStats]:
        moe = self.moe
        b, s, _ = x.shape
        tokens = constrain(x, ("batch", token_axis(constrain), "act_embed"))  # each device's own tokens
        idx, weights, keep, stats = self.route(tokens, constrain)
        experts = [self.w_in[...], self.w_gate[...] if self.kind in GATED else None, self.w_out[...]]
        gate_bias = self.b_gate[...] if self.bias and self.kind in GATED else None
        biases = [self.b_in[...], gate_bias, self.b_out[...]] if self.bias else [None, None, None]
        capacity = expert_capacity(moe, b * s * _replicas(constrain))
        y = _experts(tokens, idx, weights, keep, experts, biases, self.kind, capacity, moe, constrain, self.fp8)
        if moe.shared_experts:
            y = y + self.shared(x, constrain)
        return y, stats

    def route(self, x: jax.Array, constrain: Constrain) -> tuple[jax.Array, jax.Array, jax.Array, RouterStats]:
        """Each token's ``top_k`` experts, their weights (float32), which copies are kept, and the stats."""
        moe = self.moe
        b, s, _ = x.shape
        logits = product("bsd,de->bse", x.astype(jnp.float32), use(self.router, constrain))
        # kept with the MLP's hidden (its float32 scores): the weights' gradient reads them through the
        # softmax or sigmoid, which a block rebuilds from them element-wise rather than re-running the product
        logits = checkpoint_name(constrain(logits, ("batch", token_axis(constrain), None)), "mlp_hidden")
        scores = jax.nn.softmax(logits, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
        choose = scores
        if moe.balance == "bias":
            choose = scores + jax.lax.stop_gradient(self.router_bias[...])
        idx = _top_k(jax.lax.stop_gradient(choose), moe, constrain)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if moe.normalize_top_k:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        if moe.routed_scaling != 1.0:
            weights = weights * moe.routed_scaling
        chosen = jax.nn.one_hot(idx, moe.experts, dtype=jnp.float32)  # (b, s, k, E)
        load = _replica_sum(constrain, chosen.sum((0, 1, 2)))  # over the whole micro-batch
        routed = _replica_sum(constrain, jnp.float32(b * s * moe.top_k))
        # Switch / GShard: E x sum_e (share of copies routed to e) x (mean routing probability of e); a
        # replica's term uses its own tokens' probabilities, so the replicas' mean is the micro-batch's
        probs = scores if moe.router == "softmax" else scores / scores.sum(-1, keepdims=True)
        mean_probs = probs.mean((0, 1))
        aux = moe.experts * jnp.sum(load / routed * mean_probs)
        keep = jnp.ones(idx.shape, bool)
        capacity = expert_capacity(moe, b * s * _replicas(constrain))
        if capacity is not None:
            keep = _queue_position(chosen, constrain) < capacity
        stats = RouterStats(
            aux_loss=aux,
            load=load[None],
            dropped=routed - _replica_sum(constrain, keep.sum().astype(jnp.float32)),
            routed=routed,
            probs=mean_probs[None],
        )
        return idx, weights, keep, stats


def _queue_position(chosen: jax.Array, constrain: Constrain) -> jax.Array:
    """Each routed copy's place in its expert's queue over the whole micro-batch, ``(b, s, k)``: every
    token's first choice before any second choice, then token order; replicas hold consecutive tokens,
    so a copy waits behind the earlier choices of every replica, then this choice of earlier replicas."""
    b, s, k, e = chosen.shape
    order = jnp.moveaxis(chosen, 2, 0).reshape(k, b * s, e).astype(jnp.int32)  # (choice, token, expert)
    within = ((jnp.cumsum(order, axis=1) - order) * order).sum(-1)  # among this replica's tokens
    counts = _replica_gather(constrain, order.sum(1))  # (replica, choice, expert)
    earlier_choices = jnp.cumsum(counts.sum(0), axis=0) - counts.sum(0)
    mine = jnp.arange(counts.shape[0]) < _replica_index(constrain)
    earlier_replicas = jnp.where(mine[:, None, None], counts, 0).sum(0)
    offset = ((earlier_choices + earlier_replicas)[:, None, :] * order).sum(-1)
    return jnp.moveaxis((within + offset).reshape(k, b, s), 0, 2)


def _replicas(constrain: Constrain) -> int:
    return getattr(constrain, "replicas", 1)


def _replica_sum(constrain: Constrain, x: jax.Array) -> jax.Array:
    return constrain.replica_sum(x) if hasattr(constrain, "replica_sum") else x


def _replica_gather(constrain: Constrain, x: jax.Array) -> jax.Array:
    return constrain.replica_gather(x) if hasattr(constrain, "replica_gather") else x[None]


def _replica_index(constrain: Constrain) -> jax.Array:
    return constrain.replica_index() if hasattr(constrain, "replica_index") else jnp.int32(0)


def token_axis(constrain: Constrain) -> str:
    """The logical axis that splits the sequence into each device's own tokens for the experts: ``seq``,
    or ``res_seq`` when the experts spread over the tensor axis too (``parallel.expert_tensor: 1``, where
    sequence parallelism gives each tensor-parallel device its own tokens, which then stay there)."""
    mesh = getattr(constrain, "mesh", None)
    if mesh is None:
        return "seq"
    held = constrain.mesh_axes("batch") + constrain.mesh_axes("seq")
    return "seq" if all(a in held for a in constrain.mesh_axes("experts")) else "res_seq"


def choose_experts(scores: jax.Array, moe: MoEConfig) -> jax.Array:
    """The ``top_k`` experts of each row of ``scores``; with ``moe.groups``, among the experts of the row's
    ``group_top_k`` best groups only, a group ranked by the sum of its two best scores (DeepSeek-V3's
    grouped, device-limited routing)."""
    if moe.groups > 1:
        per = moe.experts // moe.groups
        grouped = scores.reshape(*scores.shape[:-1], moe.groups, per)
        rank = jax.lax.top_k(grouped, 2)[0].sum(-1)
        kept = jax.lax.top_k(rank, moe.group_top_k or moe.groups)[1]
        mask = jax.nn.one_hot(kept, moe.groups, dtype=jnp.bool_).any(-2)
        scores = jnp.where(jnp.repeat(mask, per, axis=-1), scores, -jnp.inf)
    return jax.lax.top_k(scores, moe.top_k)[1]


def _top_k(scores: jax.Array, moe: MoEConfig, constrain: Constrain) -> jax.Array:
    """:func:`choose_experts` for every token, on the device that holds the token (XLA's partitioner would
    gather every token's scores onto every device for a ``top_k`` over sharded rows)."""
    mesh = getattr(constrain, "mesh", None)
    pick = partial(choose_experts, moe=moe)
    if mesh is None:
        return pick(scores)
    spec = constrain.spec(("batch", token_axis(constrain), None))
    region = constrain.region_mesh()
    return jax.shard_map(pick, mesh=region, in_specs=spec, out_specs=spec, axis_names=constrain.auto_axes)(scores)


def _experts(
    x: jax.Array,
    idx: jax.Array,
    weights: jax.Array,
    keep: jax.Array,
    experts: list[jax.Array | None],
    biases: list[jax.Array | None],
    kind: str,
    capacity: int | None,
    moe: MoEConfig,
    constrain: Constrain,
    fp8: Fp8Config | None,
) -> jax.Array:
    """The routed experts' output for every token: the exchange under ``shard_map`` on a mesh, the same
    computation in place without one."""
    mesh = getattr(constrain, "mesh", None)
    if mesh is None:
        local = partial(_local, kind=kind, capacity=capacity, moe=moe, ep=(), tp=(), fp8=fp8, every=())
        return local(x, idx, weights, keep, experts, biases)
    batch, ep, tp = constrain.mesh_axes("batch"), constrain.mesh_axes("experts"), constrain.mesh_axes("expert_mlp")
    seq = constrain.mesh_axes(token_axis(constrain))
    stray = [a for a in ep if a not in batch + seq]
    if stray:
        raise ShardingError(
            f"logical axis 'experts' is sharded over mesh axes {ep}, but {stray} split no tokens (the batch is "
            f"over {batch}, the sequence over {seq}), so no tokens could be exchanged over them; map 'experts' "
            "to the expert axis (and the tensor axis only with sequence parallelism)"
        )
    # the axes a surrounding shard_map already split (the training step's replicas) are not split again
    held = lambda axes: tuple(a for a in axes if a in constrain.auto_axes) or None
    act = P(held(batch), held(seq), None)
    weight = P(held(ep), None, held(tp))
    out_weight = P(held(ep), held(tp), None)
    bias = P(held(ep), held(tp))
    specs = (act, act, act, act, [weight, weight, out_weight], [bias, bias, P(held(ep), None)])
    body = partial(_local, kind=kind, capacity=capacity, moe=moe, ep=ep, tp=tp, fp8=fp8, every=mesh.axis_names)
    exchange = jax.shard_map(
        body,
        mesh=constrain.region_mesh(),
        in_specs=specs,
        out_specs=act,
        axis_names=constrain.auto_axes,
        check_vma=False,
    )
    return exchange(x, idx, weights, keep, experts, biases)


def _local(
    x: jax.Array,
    idx: jax.Array,
    weights: jax.Array,
    keep: jax.Array,
    experts: list[jax.Array | None],
    biases: list[jax.Array | None],
    *,
    kind: str,
    capacity: int | None,
    moe: MoEConfig,
    ep: tuple[str, ...],
    tp: tuple[str, ...],
    fp8: Fp8Config | None,
    every: tuple[str, ...],
) -> jax.Array:
    """One device's tokens through the experts: pack, exchange, grouped products, exchange back, combine
    (the products in FP8 with ``fp8``; ``every`` names all mesh axes, over which their scales are reduced)."""
    w_in, w_gate, w_out = experts
    b, s, d = x.shape
    k, dt = moe.top_k, x.dtype
    tokens = b * s
    local_experts = w_in.shape[0]
    devices = moe.experts // local_experts
    slots = exchange_slots(tokens, moe, local_experts, capacity)
    rows = x.reshape(tokens, d)
    expert = idx.reshape(-1)
    dest = jnp.where(keep.reshape(-1), expert // local_experts, devices)  # ``devices``: dropped
    # each copy's slot among the copies for its destination, in token order
    onehot = (dest[:, None] == jnp.arange(devices)[None, :]).astype(jnp.int32)
    position = jnp.take_along_axis(jnp.cumsum(onehot, 0) - onehot, jnp.minimum(dest, devices - 1)[:, None], 1)[:, 0]
    slot = jnp.where(dest < devices, dest * slots + position, devices * slots)  # out of range: not sent
    send = jnp.zeros((devices * slots, d), dt).at[slot].set(rows[jnp.arange(tokens * k) // k], mode="drop")
    which = jnp.full((devices * slots,), local_experts, jnp.int32).at[slot].set(expert % local_experts, mode="drop")
    recv, which = _exchange(send, ep, devices), _exchange(which, ep, devices)
    recv = checkpoint_name(recv, "mlp_hidden")
    order = jnp.argsort(which, stable=True)  # grouped by local expert; empty slots last
    sizes = jnp.bincount(which, length=local_experts).astype(jnp.int32)
    grouped, group = recv[order], which[order]
    up = partial(_grouped, sizes=sizes, group=group, fp8=fp8, axes=GroupAxes(every, (), tp, ep))
    h = up(grouped, w_in.astype(dt))
    if biases[0] is not None:
        h = h + _per_row(biases[0], group).astype(dt)
    h = checkpoint_name(h, "mlp_hidden")
    gate = None
    if w_gate is not None:
        gate = up(grouped, w_gate.astype(dt))
        if biases[1] is not None:
            gate = gate + _per_row(biases[1], group).astype(dt)
    h = checkpoint_name(activate(kind, h, gate), "mlp_act")
    out = _grouped(h, w_out.astype(dt), sizes=sizes, group=group, fp8=fp8, axes=GroupAxes(every, tp, (), ep))
    if biases[2] is not None:  # the output bias once over the tensor axis, whose partial sums are added
        out = out + _per_row(biases[2], group).astype(dt) / (jax.lax.psum(1, tp) if tp else 1)
    back = _exchange(jnp.zeros_like(out).at[order].set(out), ep, devices)
    # the routed copies' outputs back home, kept with the MLP's hidden: the routing weights' gradient reads
    # them, and rebuilding them would re-run the output product and the exchange back
    got = checkpoint_name(back.at[slot].get(mode="fill", fill_value=0).reshape(tokens, k, d), "mlp_hidden")
    y = jnp.einsum("tk,tkd->td", (weights * keep).reshape(tokens, k).astype(dt), got)
    if tp:  # expert columns split over the tensor axis: partial sums
        y = jax.lax.psum(y, tp)
    return y.reshape(b, s, d)


def _grouped(
    x: jax.Array, w: jax.Array, *, sizes: jax.Array, group: jax.Array, fp8: Fp8Config | None, axes: GroupAxes
) -> jax.Array:
    """The grouped product of ``x``'s rows with their experts' weights, in FP8 with ``fp8``."""
    if fp8 is None:
        return jax.lax.ragged_dot(x, w, sizes)
    return grouped_product(x, w, sizes, group, fp8, axes)


def _exchange(buffer: jax.Array, axes: tuple[str, ...], devices: int) -> jax.Array:
    """Slot block ``r`` of ``buffer`` to device ``r`` along ``axes``; block ``r`` of the result came from it."""
    if not axes:
        return buffer
    shaped = buffer.reshape(devices, -1, *buffer.shape[1:])
    return jax.lax.all_to_all(shaped, axes, 0, 0, tiled=True).reshape(buffer.shape)


def _per_row(bias: jax.Array, group: jax.Array) -> jax.Array:
    """Each row's expert bias (empty slots, numbered past the last expert, get zeros)."""
    return jnp.take(bias, group, axis=0, mode="fill", fill_value=0)


def update_router_biases(params: Any, load: jax.Array, rate: float) -> Any:
    """DeepSeek-V3's auxiliary-loss-free balancing: every ``router_bias`` in ``params`` (a pure state dict;
    one row of ``load`` per MoE layer, in model order) moves by ``rate`` towards the mean load: up for
    experts below it, down for those above."""
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    rows = iter(range(load.shape[0]))
    out = []
    for path, leaf in flat:
        if getattr(path[-1], "key", None) == "router_bias":
            row = load[next(rows)]
            leaf = leaf + rate * jnp.sign(row.mean() - row)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(tree, out)
