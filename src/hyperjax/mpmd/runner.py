"""Pipeline training: one jitted program per model chunk on its stage's submesh, run by a schedule grid.

Each stage of a resolved run is a submesh (a consecutive slice of the devices in physical order) with
its own SPMD strategy (data, fsdp, tensor, ... over the stage's devices), so stages may differ in size.
Chunk ``c`` lives on stage ``c mod stages``. Per chunk there are these programs
(:mod:`hyperjax.mpmd.programs`): the forward, which also returns the chunk's pullback (its residuals,
kept on the stage until the backward task), and the backward; for a split-backward schedule, the
input-gradient (``B``) and weight-gradient (``W``) halves instead. The runtime walks the schedule's grid
in time order and dispatches each task; dispatch is asynchronous, so stages run concurrently, waiting
only on the arrays they consume. Activations and their gradients move between submeshes as
:mod:`hyperjax.mpmd.transfer` says. Every process walks the whole grid and runs the tasks of the
submeshes that hold its devices.

A tied embedding is held on the first and the last chunk: the two gradients are summed on the first
stage, the optimizer updates the one table there, and the copy is refreshed, as Megatron-LM does.
Gradient clipping uses the global norm over every stage.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hyperjax.config import Run
from hyperjax.config.run import stage_replica_axes
from hyperjax.models.moe import MoE, update_router_biases
from hyperjax.mpmd.chunks import Chunk
from hyperjax.mpmd.programs import (
    ChunkRuntime,
    activation_shapes,
    chunk_programs,
    pair_program,
    replica_sum,
    router_metrics,
)
from hyperjax.mpmd.schedules import Task, run_schedule
from hyperjax.mpmd.transfer import forget, scalar, split_devices, sum_over_processes, transfer
from hyperjax.shard import Constrainer, Strategy, place
from hyperjax.shard.replicas import check_replicas
from hyperjax.topology import make_mesh


class PipelineRunner:
    """Runs training steps of a model cut into chunks, each on its stage's submesh (one process).

    Args:
      chunks: the model's pieces in order, sharing its variables (so they start from its parameters).
        Chunk ``c`` is called as ``chunk(x, constrain, **feeds)``: ``x`` is the previous chunk's output
        (for the first, the batch entry ``entry``); ``feeds`` are the batch entries named by its
        ``feeds`` attribute. The last returns logits for ``targets``.
      run: the resolved run: its stages (devices and mesh axes), micro-batches and schedule.
      strategy: the SPMD rules each stage applies on its own submesh.
      devices: every device of the pipeline, in physical order.
      optimizer: the optimizer without clipping (applied per chunk; the global norm is combined here).
      grad_clip: global-norm clip (0: none).
      entry: the batch entry the first chunk reads.
    """

    def __init__(
        self,
        *,
        chunks: Sequence[nnx.Module],
        run: Run,
        strategy: Strategy,
        devices: Sequence[Any],
        optimizer: optax.GradientTransformation,
        grad_clip: float,
        entry: str = "inputs",
    ) -> None:
        self.optimizer, self.grad_clip, self.entry = optimizer, grad_clip, entry
        sched = run_schedule(run)
        self.sched = sched
        groups = split_devices(list(devices), [s.devices for s in run.stages])
        self.meshes = [
            make_mesh(run.hardware, dict(s.axes), devices=g) for s, g in zip(run.stages, groups, strict=True)
        ]
        n = len(chunks)
        # a tied head: the last chunk's `head` is a copy of the first chunk's `embed`
        self.tied = isinstance(chunks[-1], Chunk) and chunks[-1].tied
        self.n_chunks = n
        self.feeds = [tuple(getattr(ch, "feeds", ())) for ch in chunks]
        self.chunks: list[ChunkRuntime] = []
        for c, part in enumerate(chunks):
            mesh = self.meshes[sched.stage_of(c)]
            graphdef, state = nnx.split(part)
            strat = strategy.with_param_axes(state)
            params = nnx.to_pure_dict(state)
            owners = {d.process_index for d in mesh.devices.flat}
            replicas = stage_replica_axes(mesh.shape) if run.gradient_buckets else ()
            manual = check_replicas(strat, params, mesh, replicas)
            self.chunks.append(
                ChunkRuntime(
                    graphdef=graphdef,
                    recompute=getattr(part, "recompute", None),
                    mesh=mesh,
                    mine=jax.process_index() in owners,
                    lead=jax.process_index() == min(owners),
                    local=owners == {jax.process_index()},
                    strategy=strat,
                    constrain=Constrainer(strategy=strat, mesh=mesh),
                    manual=manual,
                    param_sh=strat.shardings(params, mesh),
                    grad_sh=strat.shardings(params, mesh, role="gradients"),
                    host_params=jax.tree.map(np.asarray, params),
                    act_sh=NamedSharding(mesh, strat.spec(("batch", "res_seq", "act_embed"))),
                    scalar_sh=NamedSharding(mesh, PartitionSpec()),
                    opt_sh=strat.shardings(
                        jax.eval_shape(optimizer.init, self.trained(params, c)), mesh, role="optimizer"
                    ),
                    moe=getattr(getattr(part, "cfg", None), "moe", None),
                    moe_layers=sum(isinstance(node, MoE) for _, node in nnx.iter_graph(part)),
                )
            )
        self.shapes: list[Any] | None = None  # each chunk's output, found at the first step
        self._pairs: dict[tuple[int, int], Any] = {}  # (forward's chunk, backward's chunk) -> its pair program
        self.steps_done = 0
        self.handovers = 0  # hand-overs so far in this step
        self.published: list[str] = []  # keys this process wrote to the key-value store this step
        self._build_programs()

    def _batch_sharding(self, c: int, rank: int) -> NamedSharding:
        """Where chunk ``c`` takes a batch entry of ``rank`` dimensions: split over its batch axes."""
        ch = self.chunks[c]
        logical = ("batch", "seq") if rank == 2 else ("batch",) + (None,) * (rank - 1)
        return NamedSharding(ch.mesh, ch.strategy.spec(logical))

    # ---- parameters ------------------------------------------------------------------------------------

    def trained(self, params: dict[str, Any], c: int) -> dict[str, Any]:
        """The parameters chunk ``c``'s optimizer updates (not the last chunk's tied copy of the table)."""
        if self.tied and c == self.n_chunks - 1:
            return {k: v for k, v in params.items() if k != "head"}
        return params

    def memory_per_device(self, state: dict[str, Any]) -> int:
        """Bytes per device of parameters, gradient accumulators and optimizer state on the fullest stage."""
        per_stage = [0] * self.sched.stages
        for c, (p, o) in enumerate(zip(state["params"], state["opt_state"], strict=True)):
            ch = self.chunks[c]
            if not ch.mine:
                continue
            shard = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(p))
            opt = sum(
                x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(o) if hasattr(x, "addressable_shards")
            )
            acc = sum(
                math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                for a in jax.tree.leaves(jax.eval_shape(ch.zeros, p))
            )
            per_stage[self.sched.stage_of(c)] += shard + acc + opt
        return max(per_stage)

    def init_state(self) -> dict[str, Any]:
        """Parameters and optimizer state per chunk, on the chunks' submeshes."""
        params, opt = [], []
        for c, ch in enumerate(self.chunks):
            if not ch.mine:  # another process's submesh
                params.append(None)
                opt.append(None)
                continue
            p = jax.tree.map(place, ch.host_params, ch.param_sh)
            params.append(p)
            opt.append(jax.jit(self.optimizer.init, out_shardings=ch.opt_sh)(self.trained(p, c)))
        return {"params": params, "opt_state": opt, "step": 0}

    # ---- programs ---------------------------------------------------------------------------------------

    def _build_programs(self) -> None:
        m = self.sched.microbatches
        for c, ch in enumerate(self.chunks):
            taps = self.sched.split_backward and ch.recompute == "none"  # unknown (None): the plain split
            last = c == len(self.chunks) - 1
            ch.programs = chunk_programs(
                ch.graphdef,
                dataclasses.replace(ch.constrain, manual=ch.manual),
                first=c == 0,
                last=last,
                m=m,
                taps=taps,
                moe=ch.moe if ch.moe_layers else None,
                mesh=ch.mesh,
                manual=ch.manual,
                acc_sh=ch.grad_sh,
            )
            if ch.moe_layers and ch.moe.balance == "bias":
                ch.rebias = jax.jit(functools.partial(update_router_biases, rate=ch.moe.bias_update_rate))
            ch.zeros, ch.reduce = replica_sum(ch.param_sh, ch.grad_sh, ch.mesh, ch.manual)
            ch.total = jax.jit(lambda xs: sum(jnp.sum(x) for x in xs), out_shardings=ch.scalar_sh)
            ch.unstack = jax.jit(lambda s: jax.tree.map(lambda a: a.mean(0), s), out_shardings=ch.scalar_sh)
            ch.sumsq = jax.jit(lambda g: optax.tree.norm(g, squared=True))

            def update(params: Any, opt_state: Any, grads: Any, scale: jax.Array) -> tuple[Any, Any]:
                grads = jax.tree.map(lambda g: g * scale, grads)
                updates, opt_state = self.optimizer.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            # the parameters stay as placed; the optimizer state stays ZeRO-split over the replicas (zero_stage)
            ch.update = jax.jit(update, donate_argnums=(0, 1), out_shardings=(self.trained(ch.param_sh, c), ch.opt_sh))

    # ---- one step ---------------------------------------------------------------------------------------

    def step(
        self, state: dict[str, Any], batch: dict[str, np.ndarray], *, timeline: list | None = None
    ) -> tuple[dict[str, Any], dict[str, float]]:
        """One optimizer step over the global ``batch`` (host arrays by entry, ``targets`` among them).

        Every process walks the whole grid and runs the tasks of the chunks whose submesh holds some of
        its devices; hand-overs between processes are ``jax.device_put`` calls both sides make.
        ``timeline``, when given, receives ``(stage, task, start_s, end_s)`` per task this process runs;
        each task is then waited for, so the times are each task's own (the stages no longer overlap).
        """
        sched, chunks, m = self.sched, self.chunks, self.sched.microbatches
        last = len(chunks) - 1
        rows = batch["targets"].shape[0] // m
        params = state["params"]
        if self.shapes is None:
            self.shapes = activation_shapes(self.chunks, self.feeds, batch[self.entry], batch, rows)
        grads = [ch.zeros(p) if ch.mine else None for ch, p in zip(chunks, params, strict=True)]
        # ("in", microbatch, chunk) -> the chunk's input; (microbatch, chunk) -> its pullback (with taps, also
        # the products' inputs and the chunk's input); ("douts", microbatch, chunk) -> B's product gradients
        xs: dict[tuple, Any] = {}
        dys: dict[tuple[int, int], Any] = {}  # (microbatch, chunk) -> gradient of the chunk's output
        feeds: dict[tuple[int, int], dict[str, jax.Array]] = {}  # (microbatch, chunk) -> its batch entries
        losses: list[jax.Array] = []
        routers: list[Any] = [None] * len(chunks)  # each chunk's router stats, summed over micro-batches

        def put(key: str, j: int, c: int) -> jax.Array:  # micro-batch j: every m-th row from j, as one program's
            part = batch[key][j::m]  # accumulation takes them (a capacity queue and a balancing loss see the same)
            return place(part, self._batch_sharding(c, part.ndim))

        for j in range(m):
            xs[("in", j, 0)] = put(self.entry, j, 0)
            for c in range(len(chunks)):
                feeds[(j, c)] = {key: put(key, j, c) for key in self.feeds[c]}
            feeds[(j, last)]["targets"] = put("targets", j, last)
        origin = time.perf_counter()
        partner = dict(sched.pairs)  # a pair's forward -> its backward (fb-pair)
        later = set(partner.values())
        for _, s, task in sched.starts():
            if task in later:
                continue  # it ran with its forward
            start = time.perf_counter()
            if task in partner:
                out = self._run_pair(task, partner[task], params, grads, xs, dys, feeds, losses, routers)
            else:
                out = self._run(task, params, grads, xs, dys, feeds, losses, routers)
            if timeline is not None and chunks[task.chunk].mine:
                jax.block_until_ready(out)
                end = time.perf_counter() - origin
                for t in (task, partner[task]) if task in partner else (task,):
                    timeline.append((s, t, start - origin, end))
        # per-replica gradients (gradient buckets) summed once, in flat buffers; router stats of the replicas
        routers = [ch.unstack(r) if ch.manual and r is not None else r for ch, r in zip(chunks, routers, strict=True)]
        grads = [ch.reduce(g) if g is not None else None for ch, g in zip(chunks, grads, strict=True)]
        if self.tied:  # the head's gradient joins the embedding's, on the first stage
            table = jax.ShapeDtypeStruct(chunks[0].host_params["embed"].shape, np.float32)
            g_head = grads[last]["head"] if chunks[last].mine else None
            head = self._hand_over(g_head, last, 0, chunks[0].grad_sh["embed"], table)
            if chunks[0].mine:
                grads[0] = {**grads[0], "embed": grads[0]["embed"] + head}
        trained = [self.trained(g, c) if g is not None else None for c, g in enumerate(grads)]
        # every process of a submesh runs its programs; one of them reports each value
        sums = [scalar(ch.sumsq(g)) if ch.mine else 0.0 for ch, g in zip(chunks, trained, strict=True)]
        local = sum(x for x, ch in zip(sums, chunks, strict=True) if ch.lead)
        norm = math.sqrt(sum_over_processes(local))
        scale = 1.0 if not self.grad_clip or norm < self.grad_clip else self.grad_clip / norm
        new_params, new_opt = [], []
        for c, ch in enumerate(chunks):
            if not ch.mine:
                new_params.append(None)
                new_opt.append(None)
                continue
            factor = place(np.float32(scale), ch.scalar_sh)
            p, o = ch.update(self.trained(params[c], c), state["opt_state"][c], trained[c], factor)
            if ch.rebias is not None:
                p = ch.rebias(p, routers[c].load)
            new_params.append(p)
            new_opt.append(o)
        if self.tied:  # refresh the last chunk's copy of the table
            table = jax.ShapeDtypeStruct(chunks[0].host_params["embed"].shape, np.float32)
            embed = new_params[0]["embed"] if chunks[0].mine else None
            head = self._hand_over(embed, 0, last, chunks[last].param_sh["head"], table)
            if chunks[last].mine:
                new_params[last] = {**new_params[last], "head": head}
        if chunks[last].mine and chunks[last].manual:  # each replica's share of each micro-batch's loss
            losses = [chunks[last].total(losses)]
        loss = sum_over_processes(sum(scalar(x) for x in losses) if chunks[last].lead else 0.0)
        # every process has passed the gather above, so every hand-over of this step has been read
        forget(self.published)
        self.published, self.handovers, self.steps_done = [], 0, self.steps_done + 1
        new_state = {"params": new_params, "opt_state": new_opt, "step": state["step"] + 1}
        metrics = {"loss": loss, "grad_norm": norm}
        if any(ch.moe_layers for ch in chunks):
            metrics |= router_metrics(self.chunks, routers, self.sched.microbatches)
        return new_state, metrics

    def _hand_over(self, value: Any, src: int, dst: int, sharding: NamedSharding, shape: Any) -> Any:
        """Move ``value`` from chunk ``src``'s submesh to ``sharding`` on chunk ``dst``'s.

        The processes of both sides take part (see :func:`_transfer`); ``shape`` is the array's shape and
        dtype. ``None`` where this process holds neither side.
        """
        sender, receiver = self.chunks[src], self.chunks[dst]
        key = f"hyperjax/mpmd/{self.steps_done}/{self.handovers}"  # the same in every process
        self.handovers += 1
        if not (sender.mine or receiver.mine):
            return None
        if jax.process_count() == 1 or (sender.local and receiver.local):
            return jax.device_put(value, sharding)
        if sender.lead:
            self.published.append(key)
        return transfer(value, sender.mesh, sharding, shape, sender.mine, key)

    def _run(self, task: Task, params, grads, xs, dys, feeds, losses, routers) -> Any:
        c, j, ch = task.chunk, task.microbatch, self.chunks[task.chunk]
        last = c == len(self.chunks) - 1
        if task.kind == "F":
            y = None
            if ch.mine:
                x = xs.pop(("in", j, c))
                y, xs[(j, c)], (ce, stats) = ch.programs.forward(params[c], x, feeds[(j, c)])  # keep the pullback
                if ch.programs.taps:  # and, for W, the products' inputs and the chunk's
                    xs[(j, c)] = (*xs[(j, c)], x)
                _collect(c, ce, stats, last, losses, routers)
            if last:
                return y
            xs[("in", j, c + 1)] = self._hand_over(y, c, c + 1, self.chunks[c + 1].act_sh, self.shapes[c])
            return xs[("in", j, c + 1)]
        if not ch.mine:
            if task.kind == "B" and c > 0:  # take part in handing the input gradient back
                self._send_back(j, c, None, dys)
            return None
        pullback = xs[(j, c)]
        if task.kind == "W" and ch.programs.taps:  # the weight GEMMs, from what F recorded and B computed
            _, kept, x = pullback
            grads[c] = ch.programs.weights(params[c], kept, x, xs.pop(("douts", j, c)), feeds[(j, c)], grads[c])
            self._forget(j, c, xs, dys)
            return grads[c]
        dy = None if last else dys[(j, c)]  # the last chunk's backward is seeded by its loss
        if task.kind == "B" and not self.sched.split_backward:  # both gradients at once
            grads[c], dx = ch.programs.backward(pullback, dy, grads[c])
            self._send_back(j, c, dx, dys)
            self._forget(j, c, xs, dys)
            return grads[c]
        if task.kind == "B" and ch.programs.taps:  # the input and product-output gradients; W reads the latter
            pullback, kept, x = pullback
            grads[c], dx, xs[("douts", j, c)] = ch.programs.inputs(pullback, dy, grads[c])
            xs[(j, c)] = (None, kept, x)  # the pullback's residuals are spent
            dys.pop((j, c), None)
            self._send_back(j, c, dx, dys)
            return xs[("douts", j, c)]
        if task.kind == "B":  # the input gradient only; the weight gradient waits for W
            if c == 0:
                return pullback  # nothing flows into the batch
            return self._send_back(j, c, ch.programs.inputs(pullback, dy), dys)
        grads[c] = ch.programs.weights(pullback, dy, grads[c])
        self._forget(j, c, xs, dys)
        return grads[c]

    def _run_pair(self, f: Task, b: Task, params, grads, xs, dys, feeds, losses, routers) -> Any:
        """Forward ``f`` and backward ``b`` (another micro-batch; the same chunk, or another of the stage's
        under an interleaved schedule) as one program; then ``f``'s output is handed on and ``b``'s input
        gradient back, in that order on every process."""
        cf, cb = f.chunk, b.chunk
        ch, last = self.chunks[cf], len(self.chunks) - 1
        y = dx = None
        if ch.mine:
            x, dy = xs.pop(("in", f.microbatch, cf)), None if cb == last else dys[(b.microbatch, cb)]
            program = self._pairs.get((cf, cb))
            if program is None:
                program = self._pairs[(cf, cb)] = pair_program(ch.programs, self.chunks[cb].programs)
            forward, backward = program(params[cf], x, feeds[(f.microbatch, cf)], xs[(b.microbatch, cb)], dy, grads[cb])
            y, xs[(f.microbatch, cf)], (ce, stats) = forward
            grads[cb], dx = backward
            _collect(cf, ce, stats, cf == last, losses, routers)
        if cf != last:
            xs[("in", f.microbatch, cf + 1)] = self._hand_over(
                y, cf, cf + 1, self.chunks[cf + 1].act_sh, self.shapes[cf]
            )
        if ch.mine:
            self._send_back(b.microbatch, cb, dx, dys)
            self._forget(b.microbatch, cb, xs, dys)
            return grads[cb]
        if cb > 0:
            self._send_back(b.microbatch, cb, None, dys)
        return None

    def _send_back(self, j: int, c: int, dx: Any, dys: dict) -> Any:
        if c == 0:
            return None
        dys[(j, c - 1)] = self._hand_over(dx, c, c - 1, self.chunks[c - 1].act_sh, self.shapes[c - 1])
        return dys[(j, c - 1)]

    def _forget(self, j: int, c: int, xs: dict, dys: dict) -> None:
        del xs[(j, c)]
        dys.pop((j, c), None)


def _collect(c: int, ce: Any, stats: Any, last: bool, losses: list, routers: list) -> None:
    """What chunk ``c``'s forward reports: its router stats summed over micro-batches, and (the last chunk)
    its share of the loss."""
    if stats is not None:
        routers[c] = stats if routers[c] is None else jax.tree.map(jnp.add, routers[c], stats)
    if last:
        losses.append(ce)
