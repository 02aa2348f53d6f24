"""Pipeline training: one jitted program per model chunk on its stage's submesh, run by a schedule grid.

A model of ``L`` layers is cut into ``pipeline x virtual_stages`` chunks of consecutive layers; chunk
``c`` lives on stage ``c mod pipeline``. Each stage is a submesh (:func:`split_devices`) with its own
SPMD strategy (data, fsdp, tensor, ... over the stage's devices), so stages may differ in size. Layers
are balanced over the chunks by predicted compute time per device (:func:`balance_layers`), which
gives a larger stage more layers.

Per chunk there are these programs: the forward, which also returns the chunk's pullback (its
residuals as arrays, kept on the stage until the backward task), and the backward (input and weight
gradients together); for a split-backward schedule, the input-gradient (``B``) and weight-gradient
(``W``) halves instead. ``B`` also yields every weight product's output gradient, and ``W`` is then the
weight GEMMs alone (:mod:`hyperjax.models.taps`). Nothing is recomputed unless the model's own
``train.recompute`` says so. The runtime walks the schedule's grid in time order and dispatches each task;
dispatch is asynchronous, so stages run concurrently, waiting only on the arrays they consume.
Activations and their gradients move between submeshes with ``jax.device_put`` to the receiver's
sharding, or, when the submeshes lie in different emulated processes, through the distributed
runtime's key-value store (:func:`_transfer`). Every process walks the whole grid and runs the tasks
of the submeshes that hold its devices.

A GPT model ties its output projection to the embedding: the last chunk holds a copy of the table.
The two gradients are summed on the first stage, the optimizer updates the one table there, and the
copy is refreshed, as Megatron-LM does. Gradient clipping uses the global norm over every stage.
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

from hyperjax.errors import ConfigError
from hyperjax.models.config import ModelConfig
from hyperjax.models.layers import Constrain
from hyperjax.models.taps import output_shapes, split, weights_only
from hyperjax.models.transformer import Transformer, embed_tokens, logits
from hyperjax.mpmd.schedules import Schedule, Task
from hyperjax.shard import Strategy, place
from hyperjax.topology import Hardware, make_mesh


def split_devices(devices: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """Cut ``devices`` (in physical order) into consecutive submeshes of ``sizes``.

    Consecutive slices of the physical order stay inside a tier whenever their sizes allow it: a
    submesh of 32 devices starting at a multiple of 32 is one CloudMatrix384 node.

    Raises:
      ConfigError: sizes that are not positive or do not sum to the devices.
    """
    if any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(f"parallel.stage_devices={list(sizes)} must be positive integers")
    if sum(sizes) != len(devices):
        raise ConfigError(
            f"parallel.stage_devices={list(sizes)} sum to {sum(sizes)}, but the mesh has {len(devices)} devices; "
            f"make them sum to {len(devices)}"
        )
    out, start = [], 0
    for n in sizes:
        out.append(list(devices[start : start + n]))
        start += n
    return out


def layer_costs(cfg: ModelConfig) -> tuple[float, float, float]:
    """Training FLOPs per token of one block, of the embedding and of the output layer (with the loss)."""
    s, h = cfg.seq_len, cfg.d_model
    block = 6 * cfg.block_matrix_params + 6 * 2 * s * cfg.heads * cfg.head_dim
    return float(block), float(6 * h), float(6 * h * cfg.vocab)


def balance_layers(
    cfg: ModelConfig, chunk_devices: Sequence[int], stage_layers: Sequence[int] | None = None
) -> list[int]:
    """Layers per chunk (model order) minimising the slowest chunk's compute time per device.

    Chunk ``c`` runs on ``chunk_devices[c]`` devices; the first chunk also embeds, the last also computes
    the logits and the loss. Every chunk gets at least one layer.

    Raises:
      ConfigError: more chunks than layers, or ``stage_layers`` that do not fit the model.
    """
    chunks = len(chunk_devices)
    if stage_layers is not None:
        if len(stage_layers) != chunks or any(n < 1 for n in stage_layers) or sum(stage_layers) != cfg.layers:
            raise ConfigError(
                f"parallel.stage_layers={list(stage_layers)} must give {chunks} positive layer counts (one per "
                f"chunk: pipeline x virtual_stages) summing to model.layers={cfg.layers}"
            )
        return list(stage_layers)
    if chunks > cfg.layers:
        raise ConfigError(
            f"parallel.pipeline x parallel.virtual_stages = {chunks} chunks, but model.layers={cfg.layers}; "
            f"every chunk needs a layer: use at most {cfg.layers} chunks or a deeper model"
        )
    block, embed, head = layer_costs(cfg)

    def cost(c: int, n: int) -> float:
        extra = (embed if c == 0 else 0.0) + (head if c == chunks - 1 else 0.0)
        return (n * block + extra) / chunk_devices[c]

    # best[c][k]: the smallest possible slowest chunk when chunks 0..c hold the first k layers
    inf = float("inf")
    best = [[inf] * (cfg.layers + 1) for _ in range(chunks)]
    cut = [[0] * (cfg.layers + 1) for _ in range(chunks)]
    for k in range(1, cfg.layers + 1):
        best[0][k] = cost(0, k)
    for c in range(1, chunks):
        for k in range(c + 1, cfg.layers + 1):
            for n in range(1, k - c + 1):
                value = max(best[c - 1][k - n], cost(c, n))
                if value < best[c][k]:
                    best[c][k], cut[c][k] = value, n
    counts, k = [], cfg.layers
    for c in range(chunks - 1, 0, -1):
        counts.append(cut[c][k])
        k -= cut[c][k]
    counts.append(k)
    return counts[::-1]


class Chunk(nnx.Module):
    """Consecutive blocks of a :class:`Transformer`, with the embedding if first and the head if last.

    It shares the model's variables (its state is a slice of the model's), so a pipeline starts from
    exactly the parameters of the single-program model.
    """

    def __init__(self, model: Transformer, layers: range, *, first: bool, last: bool) -> None:
        self.cfg, self.dtype, self.recompute = model.cfg, model.dtype, model.recompute
        self.first, self.last = first, last
        if first:
            self.embed = model.embed
            if model.cfg.family == "gpt":
                self.pos_embed = model.pos_embed
        self.blocks = nnx.List([model.blocks[i] for i in layers])
        if last:
            self.final_norm = model.final_norm
            # a tied head is the embedding table; a separate chunk holds its own copy
            self.head = model.embed if model.cfg.family == "gpt" else model.lm_head

    def __call__(self, x: jax.Array, constrain: Constrain) -> jax.Array:
        """Hidden states (or, for the last chunk, logits); the first chunk's ``x`` is the tokens."""
        if self.first:
            x = embed_tokens(self, x, constrain)
        for block in self.blocks:
            x = Transformer.run_block(self, block, x, constrain)  # type: ignore[arg-type]
        return logits(self, self.head, x, constrain) if self.last else x


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Where everything of a pipeline runs.

    Attributes:
      schedule: the schedule and its grid.
      stage_devices: devices per stage.
      stage_axes: mesh axes per stage (its own data / fsdp / context / tensor degrees).
      chunk_layers: layers per chunk, model order.
      names: a label per stage (the submeshes of a heterogeneous model); empty for a pipeline.
    """

    schedule: Schedule
    stage_devices: tuple[int, ...]
    stage_axes: tuple[dict[str, int], ...]
    chunk_layers: tuple[int, ...]
    names: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: stages with their devices and layers, and the schedule."""
        stages = []
        for s, n in enumerate(self.stage_devices):
            layers = [self.chunk_layers[c] for c in range(s, len(self.chunk_layers), len(self.stage_devices))]
            degrees = ",".join(f"{k}={v}" for k, v in self.stage_axes[s].items() if v > 1) or "1 device"
            label = f"{self.names[s]}: " if self.names else ""
            stages.append(f"{label}{n} devices ({degrees}) {'+'.join(map(str, layers))} layers")
        sched = self.schedule
        v = f" v={sched.virtual_stages}" if sched.virtual_stages > 1 else ""
        kind = "mpmd" if self.names else "pipeline"
        return f"{kind} {' | '.join(stages)}, {sched.name}{v}, {sched.microbatches} micro-batches"


def transformer_chunks(model: Transformer, layout: PipelineLayout) -> list[Chunk]:
    """The chunks of a decoder-only model, ``layout.chunk_layers`` layers each."""
    bounds = np.cumsum([0, *layout.chunk_layers])
    n = len(layout.chunk_layers)
    return [Chunk(model, range(bounds[c], bounds[c + 1]), first=c == 0, last=c == n - 1) for c in range(n)]


class PipelineRunner:
    """Runs training steps of a model cut into chunks, each on its stage's submesh (one process).

    Args:
      chunks: the model's pieces in order, sharing its variables (so they start from its parameters).
        Chunk ``c`` is called as ``chunk(x, constrain, **feeds)``: ``x`` is the previous chunk's output
        (for the first, the batch entry ``entry``); ``feeds`` are the batch entries named by its
        ``feeds`` attribute. The last returns logits for ``targets``.
      layout: stages, their devices and mesh axes, and the schedule.
      strategy: the SPMD rules each stage applies on its own submesh.
      hardware: the preset (for the meshes' capacity checks).
      devices: every device of the pipeline, in physical order.
      optimizer: the optimizer without clipping (applied per chunk; the global norm is combined here).
      grad_clip: global-norm clip (0: none).
      entry: the batch entry the first chunk reads.
    """

    def __init__(
        self,
        *,
        chunks: Sequence[nnx.Module],
        layout: PipelineLayout,
        strategy: Strategy,
        hardware: Hardware,
        devices: Sequence[Any],
        optimizer: optax.GradientTransformation,
        grad_clip: float,
        entry: str = "inputs",
    ) -> None:
        self.layout, self.optimizer, self.grad_clip, self.entry = layout, optimizer, grad_clip, entry
        sched = layout.schedule
        self.sched = sched
        groups = split_devices(list(devices), layout.stage_devices)
        self.meshes = [make_mesh(hardware, axes, devices=g) for axes, g in zip(layout.stage_axes, groups, strict=True)]
        n = len(chunks)
        last_chunk = chunks[-1]
        # a tied GPT head: the last chunk's `head` is the first chunk's `embed`
        self.tied = n > 1 and isinstance(last_chunk, Chunk) and last_chunk.cfg.family == "gpt"
        self.n_chunks = n
        self.feeds = [tuple(getattr(ch, "feeds", ())) for ch in chunks]
        self.chunks: list[dict[str, Any]] = []
        for c, part in enumerate(chunks):
            mesh = self.meshes[sched.stage_of(c)]
            graphdef, state = nnx.split(part)
            strat = strategy.with_param_axes(state)
            params = nnx.to_pure_dict(state)
            owners = {d.process_index for d in mesh.devices.flat}
            self.chunks.append(
                {
                    "graphdef": graphdef,
                    "recompute": getattr(part, "recompute", None),  # rematerialised blocks cannot be tapped
                    "mesh": mesh,
                    "mine": jax.process_index() in owners,  # this process holds some of its devices
                    "lead": jax.process_index() == min(owners),  # ... and is the one that reports for it
                    "local": owners == {jax.process_index()},  # ... all of them
                    "strategy": strat,
                    "constrain": strat.constrainer(mesh),
                    "param_sh": strat.shardings(params, mesh),
                    "host_params": jax.tree.map(np.asarray, params),
                    "act_sh": NamedSharding(mesh, strat.spec(("batch", "res_seq", "act_embed"))),
                    "scalar_sh": NamedSharding(mesh, PartitionSpec()),
                    "opt_sh": strat.shardings(jax.eval_shape(optimizer.init, self._trained(params, c)), mesh),
                }
            )
        self.shapes: list[Any] | None = None  # each chunk's output, found at the first step
        self.steps_done = 0
        self.handovers = 0  # hand-overs so far in this step
        self.published: list[str] = []  # keys this process wrote to the key-value store this step
        self._build_programs()

    def _batch_sharding(self, c: int, rank: int) -> NamedSharding:
        """Where chunk ``c`` takes a batch entry of ``rank`` dimensions: split over its batch axes."""
        ch = self.chunks[c]
        logical = ("batch", "seq") if rank == 2 else ("batch",) + (None,) * (rank - 1)
        return NamedSharding(ch["mesh"], ch["strategy"].spec(logical))

    # ---- parameters ------------------------------------------------------------------------------------

    def _trained(self, params: dict[str, Any], c: int) -> dict[str, Any]:
        """The parameters chunk ``c``'s optimizer updates (not the last chunk's tied copy of the table)."""
        if self.tied and c == self.n_chunks - 1:
            return {k: v for k, v in params.items() if k != "head"}
        return params

    def memory_per_device(self, state: dict[str, Any]) -> int:
        """Bytes per device of parameters, gradients and optimizer state on the fullest stage."""
        per_stage = [0] * self.sched.stages
        for c, (p, o) in enumerate(zip(state["params"], state["opt_state"], strict=True)):
            if not self.chunks[c]["mine"]:
                continue
            shard = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(p))
            opt = sum(
                x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(o) if hasattr(x, "addressable_shards")
            )
            per_stage[self.sched.stage_of(c)] += 2 * shard + opt
        return max(per_stage)

    def init_state(self) -> dict[str, Any]:
        """Parameters and optimizer state per chunk, on the chunks' submeshes."""
        params, opt = [], []
        for c, ch in enumerate(self.chunks):
            if not ch["mine"]:  # another process's submesh
                params.append(None)
                opt.append(None)
                continue
            p = jax.tree.map(place, ch["host_params"], ch["param_sh"])
            params.append(p)
            opt.append(jax.jit(self.optimizer.init, out_shardings=ch["opt_sh"])(self._trained(p, c)))
        return {"params": params, "opt_state": opt, "step": 0}

    # ---- programs ---------------------------------------------------------------------------------------

    def _build_programs(self) -> None:
        m = self.sched.microbatches
        for c, ch in enumerate(self.chunks):
            taps = self.sched.split_backward and ch["recompute"] == "none"  # unknown (None): the plain split
            last = c == len(self.chunks) - 1
            ch.update(_programs(ch["graphdef"], ch["constrain"], first=c == 0, last=last, m=m, taps=taps))
            ch["zeros"] = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=ch["param_sh"])
            ch["sumsq"] = jax.jit(lambda g: optax.tree.norm(g, squared=True))

            def update(params: Any, opt_state: Any, grads: Any, scale: jax.Array) -> tuple[Any, Any]:
                grads = jax.tree.map(lambda g: g * scale, grads)
                updates, opt_state = self.optimizer.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            ch["update"] = jax.jit(update, donate_argnums=(0, 1))

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
            self.shapes = self._activation_shapes(batch, rows)
        grads = [ch["zeros"](p) if ch["mine"] else None for ch, p in zip(chunks, params, strict=True)]
        # ("in", microbatch, chunk) -> the chunk's input; (microbatch, chunk) -> its pullback (with taps, also
        # the products' inputs and the chunk's input); ("douts", microbatch, chunk) -> B's product gradients
        xs: dict[tuple, Any] = {}
        dys: dict[tuple[int, int], Any] = {}  # (microbatch, chunk) -> gradient of the chunk's output
        feeds: dict[tuple[int, int], dict[str, jax.Array]] = {}  # (microbatch, chunk) -> its batch entries
        losses: list[jax.Array] = []

        def put(key: str, j: int, c: int) -> jax.Array:
            part = batch[key][j * rows : (j + 1) * rows]
            return place(part, self._batch_sharding(c, part.ndim))

        for j in range(m):
            xs[("in", j, 0)] = put(self.entry, j, 0)
            for c in range(len(chunks)):
                feeds[(j, c)] = {key: put(key, j, c) for key in self.feeds[c]}
            feeds[(j, last)]["targets"] = put("targets", j, last)
        origin = time.perf_counter()
        for _, s, task in sched.starts():
            start = time.perf_counter()
            out = self._run(task, params, grads, xs, dys, feeds, losses)
            if timeline is not None and chunks[task.chunk]["mine"]:
                jax.block_until_ready(out)
                timeline.append((s, task, start - origin, time.perf_counter() - origin))
        if self.tied:  # the head's gradient joins the embedding's, on the first stage
            table = jax.ShapeDtypeStruct(chunks[0]["host_params"]["embed"].shape, np.float32)
            g_head = grads[last]["head"] if chunks[last]["mine"] else None
            head = self._hand_over(g_head, last, 0, chunks[0]["param_sh"]["embed"], table)
            if chunks[0]["mine"]:
                grads[0] = {**grads[0], "embed": grads[0]["embed"] + head}
        trained = [self._trained(g, c) if g is not None else None for c, g in enumerate(grads)]
        # every process of a submesh runs its programs; one of them reports each value
        sums = [_scalar(ch["sumsq"](g)) if ch["mine"] else 0.0 for ch, g in zip(chunks, trained, strict=True)]
        local = sum(x for x, ch in zip(sums, chunks, strict=True) if ch["lead"])
        norm = math.sqrt(_sum_over_processes(local))
        scale = 1.0 if not self.grad_clip or norm < self.grad_clip else self.grad_clip / norm
        new_params, new_opt = [], []
        for c, ch in enumerate(chunks):
            if not ch["mine"]:
                new_params.append(None)
                new_opt.append(None)
                continue
            factor = place(np.float32(scale), ch["scalar_sh"])
            p, o = ch["update"](self._trained(params[c], c), state["opt_state"][c], trained[c], factor)
            new_params.append(p)
            new_opt.append(o)
        if self.tied:  # refresh the last chunk's copy of the table
            table = jax.ShapeDtypeStruct(chunks[0]["host_params"]["embed"].shape, np.float32)
            embed = new_params[0]["embed"] if chunks[0]["mine"] else None
            head = self._hand_over(embed, 0, last, chunks[last]["param_sh"]["head"], table)
            if chunks[last]["mine"]:
                new_params[last] = {**new_params[last], "head": head}
        loss = _sum_over_processes(sum(_scalar(x) for x in losses) if chunks[last]["lead"] else 0.0)
        # every process has passed the gather above, so every hand-over of this step has been read
        if self.published:
            from jax._src import distributed

            for key in self.published:
                distributed.global_state.client.key_value_delete(key)
        self.published, self.handovers, self.steps_done = [], 0, self.steps_done + 1
        new_state = {"params": new_params, "opt_state": new_opt, "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": norm}

    def _activation_shapes(self, batch: dict[str, np.ndarray], rows: int) -> list[Any]:
        """The shape and dtype of every chunk's output for one micro-batch.

        A process that receives an array from another process's submesh reads it as bytes and needs
        its shape and dtype to rebuild it.
        """
        out = []
        x = jax.ShapeDtypeStruct((rows, *batch[self.entry].shape[1:]), batch[self.entry].dtype)
        for c, ch in enumerate(self.chunks):
            fed = {k: jax.ShapeDtypeStruct((rows, *batch[k].shape[1:]), batch[k].dtype) for k in self.feeds[c]}
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ch["host_params"])
            graphdef, constrain = ch["graphdef"], ch["constrain"]

            def apply(p: Any, h: Any, f: Any, graphdef: Any = graphdef, constrain: Any = constrain) -> Any:
                return nnx.merge(graphdef, p)(h, constrain, **f)

            x = jax.eval_shape(apply, abstract, x, fed)
            out.append(x)
        return out

    def _hand_over(self, value: Any, src: int, dst: int, sharding: NamedSharding, shape: Any) -> Any:
        """Move ``value`` from chunk ``src``'s submesh to ``sharding`` on chunk ``dst``'s.

        The processes of both sides take part (see :func:`_transfer`); ``shape`` is the array's shape and
        dtype. ``None`` where this process holds neither side.
        """
        sender, receiver = self.chunks[src], self.chunks[dst]
        key = f"hyperjax/mpmd/{self.steps_done}/{self.handovers}"  # the same in every process
        self.handovers += 1
        if not (sender["mine"] or receiver["mine"]):
            return None
        if jax.process_count() == 1 or (sender["local"] and receiver["local"]):
            return jax.device_put(value, sharding)
        if sender["lead"]:
            self.published.append(key)
        return _transfer(value, sender["mesh"], sharding, shape, sender["mine"], key)

    def _run(self, task: Task, params, grads, xs, dys, feeds, losses) -> Any:
        c, j, ch = task.chunk, task.microbatch, self.chunks[task.chunk]
        last = c == len(self.chunks) - 1
        if task.kind == "F":
            y = None
            if ch["mine"]:
                x = xs.pop(("in", j, c))
                y, xs[(j, c)] = ch["forward"](params[c], x, feeds[(j, c)])  # keep the pullback
                if ch["taps"]:  # and, for W, the products' inputs and the chunk's
                    xs[(j, c)] = (*xs[(j, c)], x)
            if last:
                if y is not None:
                    losses.append(y)
                return y
            xs[("in", j, c + 1)] = self._hand_over(y, c, c + 1, self.chunks[c + 1]["act_sh"], self.shapes[c])
            return xs[("in", j, c + 1)]
        if not ch["mine"]:
            if task.kind == "B" and c > 0:  # take part in handing the input gradient back
                self._send_back(j, c, None, dys)
            return None
        pullback = xs[(j, c)]
        if task.kind == "W" and ch["taps"]:  # the weight GEMMs, from what F recorded and B computed
            _, kept, x = pullback
            grads[c] = ch["weights"](params[c], kept, x, xs.pop(("douts", j, c)), feeds[(j, c)], grads[c])
            self._forget(j, c, xs, dys)
            return grads[c]
        dy = None if last else dys[(j, c)]  # the last chunk's backward is seeded by its loss
        if task.kind == "B" and not self.sched.split_backward:  # both gradients at once
            grads[c], dx = ch["backward"](pullback, dy, grads[c])
            self._send_back(j, c, dx, dys)
            self._forget(j, c, xs, dys)
            return grads[c]
        if task.kind == "B" and ch["taps"]:  # the input and product-output gradients; W reads the latter
            pullback, kept, x = pullback
            grads[c], dx, xs[("douts", j, c)] = ch["inputs"](pullback, dy, grads[c])
            xs[(j, c)] = (None, kept, x)  # the pullback's residuals are spent
            dys.pop((j, c), None)
            self._send_back(j, c, dx, dys)
            return xs[("douts", j, c)]
        if task.kind == "B":  # the input gradient only; the weight gradient waits for W
            if c == 0:
                return pullback  # nothing flows into the batch
            return self._send_back(j, c, ch["inputs"](pullback, dy), dys)
        grads[c] = ch["weights"](pullback, dy, grads[c])
        self._forget(j, c, xs, dys)
        return grads[c]

    def _send_back(self, j: int, c: int, dx: Any, dys: dict) -> Any:
        if c == 0:
            return None
        dys[(j, c - 1)] = self._hand_over(dx, c, c - 1, self.chunks[c - 1]["act_sh"], self.shapes[c - 1])
        return dys[(j, c - 1)]

    def _forget(self, j: int, c: int, xs: dict, dys: dict) -> None:
        del xs[(j, c)]
        dys.pop((j, c), None)


def _programs(graphdef: Any, constrain: Constrain, *, first: bool, last: bool, m: int, taps: bool) -> dict[str, Any]:
    """The jitted programs of one chunk.

    The forward returns the chunk's output and its pullback: a ``jax.tree_util.Partial`` whose leaves are
    the residuals the backward needs, kept on the stage's devices between the two tasks (no recompute).
    The last chunk's output is its micro-batch's loss divided by ``m`` (so the losses sum to the step's
    mean), and its backward is seeded by that loss; other chunks take their output's gradient.

    With ``taps`` (a split backward over blocks that are not rematerialised), the forward runs under
    :func:`hyperjax.models.taps.split` and also returns every weight product's input (``W`` takes the
    chunk's input from the runtime, which keeps it).
    ``inputs`` (``B``) then returns the input gradient, each product's output gradient, and the gradients
    of the parameters used outside products. ``weights`` (``W``) is the weight GEMMs alone
    (:func:`hyperjax.models.taps.weights_only`). Without ``taps``, both halves read the plain pullback:
    ``B`` drops the weight half and ``W`` the input half, so ``W`` re-runs the activation-gradient chain.
    """

    def apply(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> jax.Array:
        feeds = {k: v for k, v in fed.items() if k != "targets"}
        return nnx.merge(graphdef, params)(x, constrain, **feeds)

    def loss(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, x, fed), fed["targets"]).mean() / m

    f = loss if last else apply

    def forward(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        if first:  # the batch has no gradient
            return jax.vjp(lambda p: f(p, x, fed), params)
        return jax.vjp(lambda p, h: f(p, h, fed), params, x)

    def seed(dy: jax.Array | None) -> jax.Array:
        return jnp.ones((), jnp.float32) if dy is None else dy

    def pull(pullback: Any, dy: jax.Array | None) -> tuple[Any, Any]:
        grads = pullback(seed(dy))
        return grads[0], (None if first else grads[1])

    def backward(pullback: Any, dy: Any, acc: Any) -> tuple[Any, Any]:
        dparams, dx = pull(pullback, dy)
        return jax.tree.map(jnp.add, acc, dparams), dx

    def weights(pullback: Any, dy: Any, acc: Any) -> Any:
        return jax.tree.map(jnp.add, acc, pull(pullback, dy)[0])  # XLA drops the unused input half

    def inputs(pullback: Any, dy: Any) -> Any:
        return pull(pullback, dy)[1]  # and here the unused weight half

    def forward_split(params: Any, x: jax.Array, fed: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        offsets = [jnp.zeros(a.shape, a.dtype) for a in output_shapes(lambda p, h: f(p, h, fed), params, x)]

        def tapped(p: Any, h: jax.Array, o: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
            with split(o) as state:
                out = f(p, h, fed)
            return out, state.inputs

        if first:
            y, pullback, kept = jax.vjp(lambda p, o: tapped(p, x, o), params, offsets, has_aux=True)
        else:
            y, pullback, kept = jax.vjp(tapped, params, x, offsets, has_aux=True)
        return y, (pullback, kept)

    def inputs_split(pullback: Any, dy: Any, acc: Any) -> tuple[Any, Any, Any]:
        grads = pullback(seed(dy))
        dparams, dx, douts = (grads[0], None, grads[1]) if first else grads
        return jax.tree.map(jnp.add, acc, dparams), dx, douts

    def weights_split(params: Any, kept: Any, x: jax.Array, douts: Any, fed: dict[str, jax.Array], acc: Any) -> Any:
        def products(p: Any) -> list[jax.Array]:
            with weights_only(kept) as state:
                f(p, x, fed)  # only the products feed the outputs; XLA drops the rest
            return state.outputs

        (dparams,) = jax.vjp(products, params)[1](douts)
        return jax.tree.map(jnp.add, acc, dparams)

    if taps:
        return {
            "forward": jax.jit(forward_split),
            "inputs": jax.jit(inputs_split, donate_argnums=2),
            "weights": jax.jit(weights_split, donate_argnums=5),
            "taps": True,
        }
    return {
        "forward": jax.jit(forward),
        "backward": jax.jit(backward, donate_argnums=2),
        "weights": jax.jit(weights, donate_argnums=2),
        "inputs": jax.jit(inputs),
        "taps": False,
    }


def _sum_over_processes(value: float) -> float:
    """The sum of ``value`` over every process (each adds what its submeshes report)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(np.sum(multihost_utils.process_allgather(np.asarray(value, np.float64))))


@functools.cache
def _identity(sharding: NamedSharding) -> Any:
    return jax.jit(lambda v: v, out_shardings=sharding)


def _relayout(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` laid out as ``sharding`` on the same devices (every process holding some of them calls it)."""
    return _identity(sharding)(x)


def _transfer(value: Any, src: jax.sharding.Mesh, dst: NamedSharding, shape: Any, sending: bool, key: str) -> Any:
    """Move an array from mesh ``src`` to ``dst`` when the two submeshes span different processes.

    The array goes through the distributed runtime's key-value store under ``key`` (one key per
    hand-over, the same in every process because every process walks the same grid): the sending
    submesh gathers it whole and its first process publishes the bytes; each receiving process reads
    them and places its shards. XLA's own cross-process copies (``jax.device_put`` with
    ``jax_cross_host_transfer_socket_address``) need equal device counts on both sides, and on CPU
    they matched concurrent copies between the same devices out of order, mixing micro-batches.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    me = jax.process_index()
    if sending:
        whole = _relayout(value, NamedSharding(src, PartitionSpec()))  # every sending process takes part
        if me == min(d.process_index for d in src.devices.flat):
            client.key_value_set_bytes(key, np.asarray(whole.addressable_data(0)).tobytes())
    if me not in {d.process_index for d in dst.mesh.devices.flat}:
        return None
    raw = client.blocking_key_value_get_bytes(key, _TRANSFER_TIMEOUT_MS)
    return place(np.frombuffer(raw, dtype=shape.dtype).reshape(shape.shape), dst)


_TRANSFER_TIMEOUT_MS = 600_000  # a stage may compute for minutes on an emulated supernode


def _scalar(x: jax.Array) -> float:
    """A replicated scalar's value, read from this process's copy."""
    return float(x.addressable_data(0))
