"""One pipeline chunk at run time: its jitted programs (forward, backward, a split backward's two halves) and
where its arrays live; a forward paired with a backward (:func:`pair_program`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax.config import MoEConfig, Recompute
from hyperjax.models.layers import Constrain, cross_entropy
from hyperjax.models.moe import aux_term
from hyperjax.models.taps import output_shapes, split, weights_only
from hyperjax.mpmd.transfer import scalar, sum_over_processes
from hyperjax.shard import Strategy
from hyperjax.shard.replicas import bucket_sum, host_blocks
from hyperjax.shard.strategy import spec_entry

Kind = Literal["whole", "rows", "stacked"]
"""How a program's argument or result meets the replicas of :func:`per_replica`: ``whole`` (the same on
every replica: parameters), ``rows`` (the replicas' rows of a batch-major array, split along its first
axis) or ``stacked`` (each replica's own value, stacked along a new first axis: residuals, gradients)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Programs:
    """A chunk's programs (see :func:`chunk_programs`).

    Attributes:
      forward: ``(params, x, feeds) -> (y, pullback, (loss, stats))``: ``y`` is the output (for the last
        chunk its share of the training loss), ``loss`` the last chunk's share of the cross-entropy (zero
        elsewhere) and ``stats`` the chunk's router stats (``None`` without MoE layers); with ``taps`` the
        pullback also carries the products' inputs.
      backward: ``(pullback, dy, acc) -> (acc + dparams, dx)`` (plain backward only).
      inputs: ``B``: the input gradient (with ``taps``: ``(acc, dx, product gradients)``).
      weights: ``W``: the weight gradients added to the accumulator.
      taps: whether the backward is split at the weight products (:mod:`hyperjax.models.taps`).
    """

    forward: Callable[..., Any]
    inputs: Callable[..., Any]
    weights: Callable[..., Any]
    taps: bool
    backward: Callable[..., Any] | None = None


def pair_program(forward_of: Programs, backward_of: Programs) -> Callable[..., Any]:
    """``(params, x, feeds, pullback, dy, acc) -> (forward's outputs, backward's outputs)``: one micro-batch's
    forward through chunk ``forward_of`` and another's backward through chunk ``backward_of`` (the same chunk,
    or under an interleaved schedule another chunk of the stage) as one program (``parallel.overlap:
    fb-pair``), so that each one's all-to-all can run beside the other's compute. Plain backward only."""
    forward, backward = forward_of.forward, backward_of.backward
    if backward is None:
        raise ValueError("a pair needs the plain backward, not a split one")

    def pair(params: Any, x: jax.Array, fed: dict[str, jax.Array], pullback: Any, dy: Any, acc: Any) -> Any:
        return forward(params, x, fed), backward(pullback, dy, acc)

    return jax.jit(pair, donate_argnums=5)


def chunk_programs(
    graphdef: Any,
    constrain: Constrain,
    *,
    first: bool,
    last: bool,
    m: int,
    taps: bool,
    moe: MoEConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    manual: tuple[str, ...] = (),
    acc_sh: Any = None,
) -> Programs:
    """The jitted programs of one chunk.

    The forward returns the chunk's output and its pullback: a ``jax.tree_util.Partial`` whose leaves are
    the residuals the backward needs, kept on the stage's devices between the two tasks (no recompute).
    The last chunk's output is its micro-batch's loss divided by ``m`` (so the losses sum to the step's
    mean), and its backward is seeded by that loss; other chunks take their output's gradient. A chunk
    with MoE layers balanced by an auxiliary loss adds its layers' share of that loss: to the last
    chunk's loss, or as a second output of another chunk whose backward seeds it with 1.

    With ``taps`` (a split backward over blocks that are not rematerialised), the forward runs under
    :func:`hyperjax.models.taps.split` and also returns every weight product's input (``W`` takes the
    chunk's input from the runtime, which keeps it).
    ``inputs`` (``B``) then returns the input gradient, each product's output gradient, and the gradients
    of the parameters used outside products. ``weights`` (``W``) is the weight GEMMs alone
    (:func:`hyperjax.models.taps.weights_only`). Without ``taps``, both halves read the plain pullback:
    ``B`` drops the weight half and ``W`` the input half, so ``W`` re-runs the activation-gradient chain.

    With ``manual`` axes of ``mesh`` (the stage's data-parallel replicas, ``constrain`` made manual over
    them), every program runs per replica (:func:`per_replica`): the accumulator holds each replica's own
    gradients, stacked, and no program sums over the replicas; the runner sums them once per step. The
    last chunk's loss is then its replica's share of the micro-batch's mean (its rows' mean over the
    replicas), and each replica's balancing loss its share of the replicas' mean, so the replicas'
    gradients sum to the micro-batch's; the router stats come back stacked, one entry per replica.

    ``acc_sh`` (no ``manual`` axes) is where the gradient accumulator lives (ZeRO-2 splits it over the
    replicas): every program that adds to it keeps it there, so each micro-batch's gradients, reduced over
    the replicas, are added to each device's share (XLA may reduce-scatter them) rather than held whole.
    """
    replicas = math.prod(mesh.shape[a] for a in manual) if manual else 1

    def add(acc: Any, dparams: Any) -> Any:
        total = jax.tree.map(jnp.add, acc, dparams)
        return total if acc_sh is None or manual else jax.lax.with_sharding_constraint(total, acc_sh)

    def apply(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        feeds = {k: v for k, v in fed.items() if k != "targets"}
        return nnx.merge(graphdef, params).forward(x, constrain, **feeds)

    def loss(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        logits, stats = apply(params, x, fed)
        ce = cross_entropy(logits, fed["targets"]).mean() / (m * replicas)
        return ce + aux_term(moe, stats) / (m * replicas), (ce, stats)

    def hidden(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[Any, Any]:
        y, stats = apply(params, x, fed)
        return (y, aux_term(moe, stats) / (m * replicas)), (jnp.zeros((), jnp.float32), stats)

    f = loss if last else hidden

    def forward(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[Any, Any, Any]:
        if first:  # the batch has no gradient
            out, pullback, extra = jax.vjp(lambda p: f(p, x, fed), params, has_aux=True)
        else:
            out, pullback, extra = jax.vjp(lambda p, h: f(p, h, fed), params, x, has_aux=True)
        return out if last else out[0], pullback, extra

    def seed(dy: jax.Array | None) -> Any:
        one = jnp.ones((), jnp.float32)
        return one if last else (dy, one)  # a hidden chunk's auxiliary loss enters with gradient 1

    def pull(pullback: Any, dy: jax.Array | None) -> tuple[Any, Any]:
        grads = pullback(seed(dy))
        return grads[0], (None if first else grads[1])

    def backward(pullback: Any, dy: Any, acc: Any) -> tuple[Any, Any]:
        dparams, dx = pull(pullback, dy)
        return add(acc, dparams), dx

    def weights(pullback: Any, dy: Any, acc: Any) -> Any:
        return add(acc, pull(pullback, dy)[0])  # XLA drops the unused input half

    def inputs(pullback: Any, dy: Any) -> Any:
        return pull(pullback, dy)[1]  # and here the unused weight half

    def forward_split(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[Any, Any, Any]:
        offsets = [jnp.zeros(a.shape, a.dtype) for a in output_shapes(lambda p, h: f(p, h, fed), params, x)]

        def tapped(p: Any, h: jax.Array, o: list[jax.Array]) -> tuple[Any, Any]:
            with split(o) as state:
                out, extra = f(p, h, fed)
            return out, (state.inputs, extra)

        if first:
            y, pullback, (kept, extra) = jax.vjp(lambda p, o: tapped(p, x, o), params, offsets, has_aux=True)
        else:
            y, pullback, (kept, extra) = jax.vjp(tapped, params, x, offsets, has_aux=True)
        return y if last else y[0], (pullback, kept), extra

    def inputs_split(pullback: Any, dy: Any, acc: Any) -> tuple[Any, Any, Any]:
        grads = pullback(seed(dy))
        dparams, dx, douts = (grads[0], None, grads[1]) if first else grads
        return add(acc, dparams), dx, douts

    def weights_split(params: Any, kept: Any, x: jax.Array, douts: Any, fed: dict[str, jax.Array], acc: Any) -> Any:
        def products(p: Any) -> list[jax.Array]:
            with weights_only(kept) as state:
                f(p, x, fed)  # only the products feed the outputs; XLA drops the rest
            return state.outputs

        (dparams,) = jax.vjp(products, params)[1](douts)
        return add(acc, dparams)

    each = functools.partial(per_replica, mesh=mesh, manual=manual)
    out = "stacked" if last else "rows"  # the last chunk's output is its loss
    if taps:
        return Programs(
            forward=jax.jit(each(forward_split, ("whole", "rows", "rows"), (out, "stacked", "stacked"))),
            inputs=jax.jit(
                each(inputs_split, ("stacked", "rows", "stacked"), ("stacked", "rows", "stacked")), donate_argnums=2
            ),
            weights=jax.jit(
                each(weights_split, ("whole", "stacked", "rows", "stacked", "rows", "stacked"), "stacked"),
                donate_argnums=5,
            ),
            taps=True,
        )

    return Programs(
        forward=jax.jit(each(forward, ("whole", "rows", "rows"), (out, "stacked", "stacked"))),
        backward=jax.jit(each(backward, ("stacked", "rows", "stacked"), ("stacked", "rows")), donate_argnums=2),
        weights=jax.jit(each(weights, ("stacked", "rows", "stacked"), "stacked"), donate_argnums=2),
        inputs=jax.jit(each(inputs, ("stacked", "rows"), "rows")),
        taps=False,
    )


def per_replica(
    fn: Callable[..., Any],
    ins: Sequence[Kind],
    outs: Sequence[Kind] | Kind,
    *,
    mesh: jax.sharding.Mesh | None,
    manual: tuple[str, ...],
) -> Callable[..., Any]:
    """``fn`` run by each replica along the ``manual`` axes of ``mesh`` apart (``jax.shard_map`` over them; the
    other axes stay SPMD), its arguments and results of the kinds ``ins`` and ``outs`` (:data:`Kind`, one
    per argument and per element of the result tuple, or one for a single result). ``fn`` itself when no
    axis is manual."""
    if not manual:
        return fn
    split = P(spec_entry(manual))
    single = isinstance(outs, str)
    kinds = (outs,) if single else tuple(outs)

    def body(*args: Any) -> Any:
        args = [jax.tree.map(lambda a: a[0], x) if k == "stacked" else x for x, k in zip(args, ins, strict=True)]
        result = fn(*args)
        parts = [
            jax.tree.map(lambda a: a[None], r) if k == "stacked" else r
            for r, k in zip((result,) if single else result, kinds, strict=True)
        ]
        return parts[0] if single else tuple(parts)

    specs = lambda ks: tuple(P() if k == "whole" else split for k in ks)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=specs(ins),
        out_specs=specs(kinds)[0] if single else specs(kinds),
        axis_names=set(manual),
        check_vma=False,
    )


@dataclasses.dataclass(kw_only=True)
class ChunkRuntime:
    """One chunk on its submesh: its structure, where its arrays live, and its programs.

    Attributes:
      graphdef: the chunk's NNX structure.
      recompute: whether its blocks are rematerialised (a split backward cannot tap them); ``None``
        where the chunk does not say.
      mesh: its stage's submesh.
      mine: this process holds some of the submesh's devices.
      lead: ... and is the one that reports the chunk's values.
      local: ... all of them.
      strategy: the SPMD rules on the submesh, with a pattern per parameter path.
      constrain: the activation constraint the chunk is called with (outside its programs).
      manual: the mesh axes whose replicas compute their gradients apart, summed once per step (gradient
        buckets; empty: XLA reduces each micro-batch's gradients in its backward program).
      param_sh, grad_sh, opt_sh: where its parameters, its summed gradients (and, without ``manual`` axes,
        its gradient accumulator) and its optimizer state live.
      host_params: its initial parameters on the host.
      act_sh: where its output (and its output's gradient) lives.
      scalar_sh: a replicated scalar on the submesh.
      programs: its jitted programs (built once the runner knows the schedule).
      zeros, reduce, sumsq, update: a zero gradient accumulator, its sum over the replicas, the squared
        gradient norm, the optimizer update.
      total: the step's loss from the last chunk's per-replica shares (with ``manual`` axes).
      unstack: the step's router stats from each replica's (with ``manual`` axes): the replicas' mean (the
        expert loads are the micro-batch's on every replica; the balancing loss is each replica's own).
      moe: the model's mixture of experts (``None`` when dense).
      moe_layers: the chunk's MoE layers.
      rebias: moves the chunk's routing biases by its step's load (``balance: bias``).
    """

    graphdef: Any
    recompute: Recompute | None
    mesh: jax.sharding.Mesh
    mine: bool
    lead: bool
    local: bool
    strategy: Strategy
    constrain: Any
    manual: tuple[str, ...]
    param_sh: Any
    grad_sh: Any
    host_params: Any
    act_sh: NamedSharding
    scalar_sh: NamedSharding
    opt_sh: Any
    programs: Programs | None = None
    zeros: Any = None
    reduce: Any = None
    total: Any = None
    unstack: Any = None
    sumsq: Any = None
    update: Any = None
    moe: MoEConfig | None = None
    moe_layers: int = 0
    rebias: Any = None


def replica_sum(param_sh: Any, grad_sh: Any, mesh: jax.sharding.Mesh, manual: tuple[str, ...]) -> tuple[Any, Any]:
    """A chunk's zero gradient accumulator and what sums it once per step into the gradients' layout
    ``grad_sh`` (split over the replicas at ``zero_stage`` 2). With ``manual`` replica axes the accumulator
    stacks each replica's gradients, each laid out as its parameter (``P(manual, *spec)``), and the sum runs
    in flat buffers (:func:`hyperjax.shard.replicas.bucket_sum`, inside each process first); without, it is
    laid out as ``grad_sh``, XLA reducing each micro-batch's gradients in its backward program, and the sum
    is the identity."""
    if not manual:
        return jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=grad_sh), lambda g: g
    n = math.prod(mesh.shape[a] for a in manual)
    stacked = jax.tree.map(lambda s: NamedSharding(mesh, P(manual, *s.spec)), param_sh)
    zeros = jax.jit(lambda p: jax.tree.map(lambda a: jnp.zeros((n, *a.shape), a.dtype), p), out_shardings=stacked)
    specs, tree = jax.tree.flatten(jax.tree.map(lambda s: s.spec, param_sh), is_leaf=lambda x: isinstance(x, P))
    hosts = host_blocks(mesh, manual)

    def total(acc: Any) -> Any:
        leaves = jax.tree.leaves(acc)
        summed = bucket_sum(leaves, mesh=mesh, specs=specs, over=[manual] * len(leaves), hosts=hosts)
        return jax.tree.unflatten(tree, summed)

    return zeros, jax.jit(total, out_shardings=grad_sh)


def router_metrics(chunks: Sequence[ChunkRuntime], routers: list[Any], microbatches: int) -> dict[str, Any]:
    """A pipeline step's MoE metrics over every chunk (each chunk's lead process reports its layers)."""
    experts = next(ch.moe.experts for ch in chunks if ch.moe_layers)
    rows, totals = [], np.zeros(3)
    for ch, stats in zip(chunks, routers, strict=True):
        if not ch.moe_layers:
            continue
        if ch.lead:
            rows.append(np.asarray(stats.load.addressable_data(0)))
            totals += [scalar(stats.aux_loss), scalar(stats.dropped), scalar(stats.routed)]
        else:
            rows.append(np.zeros((ch.moe_layers, experts)))
    load = sum_over_processes(np.concatenate(rows))
    aux, dropped, routed = sum_over_processes(totals)
    return {
        "aux_loss": aux / (microbatches * load.shape[0]),
        "expert_load_max_over_mean": float(np.max(load.max(-1) / load.mean(-1))),
        "dropped_fraction": dropped / routed,
        "expert_load": load,
    }


def activation_shapes(
    chunks: Sequence[ChunkRuntime], feeds: Sequence[Sequence[str]], entry: Any, batch: dict[str, Any], rows: int
) -> list[Any]:
    """The shape and dtype of every chunk's output for one micro-batch of ``rows`` rows, the first chunk
    reading the batch entry ``entry``.

    A process that receives an array from another process's submesh reads it as bytes and needs its shape
    and dtype to rebuild it.
    """
    out = []
    x = jax.ShapeDtypeStruct((rows, *entry.shape[1:]), entry.dtype)
    for c, ch in enumerate(chunks):
        fed = {k: jax.ShapeDtypeStruct((rows, *batch[k].shape[1:]), batch[k].dtype) for k in feeds[c]}
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ch.host_params)
        graphdef, constrain = ch.graphdef, ch.constrain

        def apply(p: Any, h: Any, f: Any, graphdef: Any = graphdef, constrain: Any = constrain) -> Any:
            return nnx.merge(graphdef, p)(h, constrain, **f)

        x = jax.eval_shape(apply, abstract, x, fed)
        out.append(x)
    return out
