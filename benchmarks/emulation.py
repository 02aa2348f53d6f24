"""hyperjax's training step against the same program written in plain JAX, on emulated devices.

At 8 devices (one process) both versions train the quickstart GPT under data x tensor parallelism: the
hyperjax version through a declarative Strategy and the flax NNX model, the plain version with hand-written
parameter dictionaries, PartitionSpecs and sharding constraints. Steps alternate between the two in rounds
so that machine noise hits both alike; the table reports median step times and hyperjax's overhead.

With ``--with-384`` it also trains ``configs/gpt-tiny-cm384.yaml`` on 384 devices (12 processes) twice:
with every gradient reduction left to XLA (``parallel.gradient_buckets=false``) and with the replicas'
gradients summed in buckets (the default there), each for ``--steps-384`` steps, the last one profiled
(``hyperjax train --profile``). It prints the per-collective breakdown of a step (count, arrays, devices
per group, processes per group, bytes, seconds) for both, the median step times (the compiling first step
and the profiled last one left out) and how far the losses moved.

With ``--with-vlm-384`` it trains ``configs/vlm-cm384.yaml`` (the VLM's encoder and language model as
MPMD submeshes of 128 and 256 devices, 12 processes) for ``--steps-vlm`` steps, once with each micro-batch's
gradients reduced over the data replicas inside its backward programs and once with the replicas'
gradients summed once per step in buckets (the default there), and prints the median step times (the
compiling first step left out) and how far the losses moved. Writes ``benchmarks/results/emulation.json``.

    python benchmarks/emulation.py [--steps 10] [--rounds 3] [--with-384] [--steps-384 6] [--with-vlm-384]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hyperjax

hyperjax.start_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hyperjax.train import Batches, build_train_step, init_state, make_optimizer, prepare  # noqa: E402

ROOT = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results"


# ---- the same GPT in plain JAX ------------------------------------------------------------------------------
def plain_init(key, cfg):
    d, h, f, v, s, L = cfg.d_model, cfg.heads, cfg.d_ff, cfg.vocab, cfg.seq_len, cfg.layers
    hd = d // h
    keys = iter(jax.random.split(key, 8 * L + 4))
    n = lambda shape, std=0.02: std * jax.random.normal(next(keys), shape, jnp.float32)
    resid = 0.02 / (2 * L) ** 0.5
    layer = lambda: {
        "ln1_s": jnp.ones(d),
        "ln1_b": jnp.zeros(d),
        "q": n((d, h, hd)),
        "k": n((d, h, hd)),
        "v": n((d, h, hd)),
        "qb": jnp.zeros((h, hd)),
        "kb": jnp.zeros((h, hd)),
        "vb": jnp.zeros((h, hd)),
        "o": n((h, hd, d), resid),
        "ob": jnp.zeros(d),
        "ln2_s": jnp.ones(d),
        "ln2_b": jnp.zeros(d),
        "w_in": n((d, f)),
        "b_in": jnp.zeros(f),
        "w_out": n((f, d), resid),
        "b_out": jnp.zeros(d),
    }
    return {
        "embed": n((v, d)),
        "pos": n((s, d), 0.01),
        "layers": [layer() for _ in range(L)],
        "lnf_s": jnp.ones(d),
        "lnf_b": jnp.zeros(d),
    }


def plain_specs(params):
    layer = {
        "ln1_s": P(),
        "ln1_b": P(),
        "q": P(None, "tensor"),
        "k": P(None, "tensor"),
        "v": P(None, "tensor"),
        "qb": P("tensor"),
        "kb": P("tensor"),
        "vb": P("tensor"),
        "o": P("tensor"),
        "ob": P(),
        "ln2_s": P(),
        "ln2_b": P(),
        "w_in": P(None, "tensor"),
        "b_in": P("tensor"),
        "w_out": P("tensor"),
        "b_out": P(),
    }
    return {"embed": P("tensor"), "pos": P(), "layers": [layer] * len(params["layers"]), "lnf_s": P(), "lnf_b": P()}


def layer_norm(x, s, b):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(jnp.square(x - m).mean(-1, keepdims=True) + 1e-5) * s + b


def plain_loss(params, inputs, targets, mesh):
    wsc = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    x = wsc(jnp.take(params["embed"], inputs, axis=0) + params["pos"][: inputs.shape[1]], P("data"))
    s = inputs.shape[1]
    for p in params["layers"]:
        y = layer_norm(x, p["ln1_s"], p["ln1_b"])
        q = wsc(jnp.einsum("bsd,dhk->bshk", y, p["q"]) + p["qb"], P("data", None, "tensor"))
        k = wsc(jnp.einsum("bsd,dhk->bshk", y, p["k"]) + p["kb"], P("data", None, "tensor"))
        v = wsc(jnp.einsum("bsd,dhk->bshk", y, p["v"]) + p["vb"], P("data", None, "tensor"))
        b, _, h, d = q.shape
        att = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, s, h, 1, d), k) / jnp.sqrt(jnp.float32(d))
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, jnp.finfo(jnp.float32).min), axis=-1)
        o = wsc(jnp.einsum("bkgqs,bskd->bqkgd", att, v).reshape(b, s, h, d), P("data", None, "tensor"))
        x = wsc(x + jnp.einsum("bshk,hkd->bsd", o, p["o"]) + p["ob"], P("data"))
        y = layer_norm(x, p["ln2_s"], p["ln2_b"])
        hdn = wsc(jax.nn.gelu(y @ p["w_in"] + p["b_in"], approximate=True), P("data", None, "tensor"))
        x = wsc(x + hdn @ p["w_out"] + p["b_out"], P("data"))
    logits = wsc(layer_norm(x, params["lnf_s"], params["lnf_b"]) @ params["embed"].T, P("data", None, "tensor"))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def plain_program(cfg, mesh, optimizer):
    params = plain_init(jax.random.key(0), cfg.model)
    specs = plain_specs(params)
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    params = jax.device_put(params, p_sh)
    opt_state = optimizer.init(params)

    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(plain_loss)(params, inputs, targets, mesh)
        grads = jax.lax.with_sharding_constraint(grads, p_sh)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, P())
    opt_sh = jax.tree.map(lambda x: x.sharding if x.ndim else replicated, opt_state)
    opt_state = jax.device_put(opt_state, opt_sh)
    fn = jax.jit(
        step,
        in_shardings=(p_sh, opt_sh, NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data"))),
        out_shardings=(p_sh, opt_sh, replicated),
        donate_argnums=(0, 1),
    )
    state = [params, opt_state]

    def run(batch):
        state[0], state[1], loss = fn(state[0], state[1], batch["inputs"], batch["targets"])
        return loss

    run.compiled = lambda batch: fn.lower(state[0], state[1], batch["inputs"], batch["targets"]).compile()
    return run


def hyperjax_program(run):
    from flax import nnx

    t = run.config.train
    mesh = hyperjax.make_mesh(run.hardware, run.axes)
    graphdef, state = nnx.split(hyperjax.build_model(run.config.model, seed=t.seed))
    optimizer = make_optimizer(t)
    step = build_train_step(
        graphdef=graphdef, param_state=state, strategy=prepare(run).strategy, mesh=mesh, optimizer=optimizer
    )
    holder = [init_state(state, optimizer, step)]

    def run(batch):
        holder[0], metrics = step.fn(holder[0], batch)
        return metrics["loss"]

    run.compiled = lambda batch: step.fn.lower(holder[0], batch).compile()
    return run, step.batch_sharding, mesh


def program_stats(compiled) -> dict:
    """FLOPs, bytes accessed and collective ops of a compiled step (XLA's own numbers)."""
    cost = compiled.cost_analysis()
    text = compiled.as_text()
    ops = {k: len(re.findall(rf"= \S+ {k}(?:-start)?\(", text)) for k in ("all-reduce", "all-gather", "reduce-scatter")}
    return {"flops": cost.get("flops", 0.0), "bytes_accessed": cost.get("bytes accessed", 0.0), **ops}


def time_steps(run, data, sharding, first, steps):
    times = []
    for i in range(first, first + steps):
        batch = data.global_batch_arrays(i, sharding)
        start = time.perf_counter()
        float(run(batch))
        times.append(time.perf_counter() - start)
    return times


def run_384(steps: int, *, buckets: bool) -> dict:
    """Train gpt-tiny-cm384 for ``steps`` steps (the last one profiled); ``buckets=False`` leaves every
    gradient reduction to XLA."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        start = time.perf_counter()
        command = [sys.executable, "-m", "hyperjax", "train", str(ROOT / "configs/gpt-tiny-cm384.yaml")]
        command += ["--steps", str(steps), "--profile", "--metrics-out", str(metrics), "--out-dir", tmp]
        command += [] if buckets else ["--set", "parallel.gradient_buckets=false"]
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr)[-3000:], "wall_s": wall}
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        collectives = json.loads((Path(tmp) / "collectives.json").read_text())["collectives"]
    timed = [r["step_time_s"] for r in rows[1:-1]]  # neither the compiling step nor the profiled one
    return {
        "gradient_buckets": buckets,
        "wall_s": wall,
        "losses": [r["loss"] for r in rows],
        "step_times_s": [r["step_time_s"] for r in rows],
        "median_step_s": statistics.median(timed),
        "profiled_step_s": rows[-1]["step_time_s"],
        "collectives": collectives,
    }


def run_vlm_384(steps: int, *, buckets: bool) -> dict:
    """Train vlm-cm384 for ``steps`` steps; ``buckets=False`` reduces every micro-batch's gradients in its
    backward programs."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        start = time.perf_counter()
        command = [sys.executable, "-m", "hyperjax", "train", str(ROOT / "configs/vlm-cm384.yaml")]
        command += ["--steps", str(steps), "--metrics-out", str(metrics), "--out-dir", tmp]
        command += ["--set", f"parallel.gradient_buckets={str(buckets).lower()}"]
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr)[-3000:], "wall_s": wall}
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {
        "gradient_buckets": buckets,
        "wall_s": wall,
        "losses": [r["loss"] for r in rows],
        "step_times_s": [r["step_time_s"] for r in rows],
        "median_step_s": statistics.median(r["step_time_s"] for r in rows[1:]),  # the compiling step left out
    }


def breakdown_table(title: str, r: dict) -> Table:
    table = Table(title=title)
    for col in ("collective", "devices per group", "processes per group", "count", "arrays", "KiB", "s", "share"):
        table.add_column(col, justify="left" if col == "collective" else "right")
    step = r["profiled_step_s"]
    for c in r["collectives"]:
        table.add_row(
            c["kind"],
            str(c["participants"]),
            str(c["processes"]),
            str(c["count"]),
            str(c["arrays"]),
            f"{c['bytes'] / 1024:.0f}",
            f"{c['seconds']:.3f}",
            f"{c['seconds'] / step:.0%}",
        )
    rest = step - sum(c["seconds"] for c in r["collectives"])
    table.add_row("everything else", "", "", "", "", "", f"{rest:.3f}", f"{rest / step:.0%}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round per version")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--with-384", action="store_true", help="also train gpt-tiny-cm384, without and with buckets")
    parser.add_argument("--steps-384", type=int, default=6, help="steps of each 384-device run (at least 3)")
    parser.add_argument("--with-vlm-384", action="store_true", help="also train vlm-cm384, without and with buckets")
    parser.add_argument("--steps-vlm", type=int, default=3, help="steps of each vlm-cm384 run (at least 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "emulation.json")
    args = parser.parse_args()
    for flag, value, least in (
        (("--steps", args.steps, 1), ("--rounds", args.rounds, 1))
        + ((("--steps-384", args.steps_384, 3),) if args.with_384 else ())
        + ((("--steps-vlm", args.steps_vlm, 2),) if args.with_vlm_384 else ())
    ):
        if value < least:  # checked before anything trains: the first steps compile, the rest are timed
            parser.error(f"{flag} {value}: at least {least}")

    cfg = hyperjax.load_config(ROOT / "configs/quickstart.yaml", ["parallel.tensor=2"])
    run = hyperjax.resolve(cfg)
    hj_run, sharding, mesh = hyperjax_program(run)
    plain_run = plain_program(cfg, mesh, make_optimizer(cfg.train))
    data = Batches(
        source="text", global_batch=cfg.train.global_batch, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab, seed=0
    )
    time_steps(hj_run, data, sharding, 0, 2)  # compile and warm up both
    time_steps(plain_run, data, sharding, 0, 2)
    hj, plain = [], []
    for r in range(args.rounds):
        first = 2 + r * args.steps
        hj += time_steps(hj_run, data, sharding, first, args.steps)
        plain += time_steps(plain_run, data, sharding, first, args.steps)
    hj_s, plain_s = statistics.median(hj), statistics.median(plain)
    probe = data.global_batch_arrays(0, sharding)
    hj_stats, plain_stats = program_stats(hj_run.compiled(probe)), program_stats(plain_run.compiled(probe))
    overhead = hj_s / plain_s - 1
    result = {
        "devices": 8,
        "mesh": run.axes,
        "model": dataclasses.asdict(cfg.model),
        "steps_each": len(hj),
        "hyperjax_step_s": hj_s,
        "plain_jax_step_s": plain_s,
        "overhead": overhead,
        "cpu_cores": os.cpu_count(),
        "hyperjax_program": hj_stats,
        "plain_jax_program": plain_stats,
    }
    table = Table(title="training step: hyperjax vs plain JAX (quickstart GPT, 8 emulated devices, data=4 x tensor=2)")
    for col in ("program", "median step ms", "steps timed", "vs plain JAX", "GFLOP", "GB accessed", "all-reduce ops"):
        table.add_column(col, justify="left" if col == "program" else "right")
    for name, t, times, vs, st in (
        ("plain JAX (hand-written)", plain_s, plain, "-", plain_stats),
        ("hyperjax (Strategy + NNX)", hj_s, hj, f"{overhead:+.1%}", hj_stats),
    ):
        table.add_row(
            name,
            f"{t * 1e3:.1f}",
            str(len(times)),
            vs,
            f"{st['flops'] / 1e9:.2f}",
            f"{st['bytes_accessed'] / 1e9:.2f}",
            str(st["all-reduce"]),
        )
    console = Console(width=140)
    console.print(table)
    if args.with_384:
        before, after = run_384(args.steps_384, buckets=False), run_384(args.steps_384, buckets=True)
        result["cm384"] = {"xla_reductions": before, "gradient_buckets": after}
        for r in (before, after):
            if "error" in r:
                raise SystemExit(f"gpt-tiny-cm384 failed: {r['error']}")
        drift = max(abs(a - b) / abs(a) for a, b in zip(before["losses"], after["losses"], strict=True))
        result["cm384"]["max_relative_loss_difference"] = drift
        for name, r in (("every gradient reduction XLA's", before), ("gradient buckets", after)):
            title = f"gpt-tiny-cm384, 384 devices in 12 processes, {name}: the profiled step"
            console.print(breakdown_table(title, r))
        steps = Table(title="gpt-tiny-cm384: median step (the first and the profiled last left out)")
        for col in ("reductions", "median step s", "steps", "losses"):
            steps.add_column(col, justify="left" if col in ("reductions", "losses") else "right")
        for name, r in (("XLA's, one per tensor", before), ("buckets", after)):
            losses = ", ".join(f"{x:.6f}" for x in r["losses"])
            steps.add_row(name, f"{r['median_step_s']:.2f}", str(len(r["losses"])), losses)
        steps.caption = f"largest relative difference between the two runs' losses: {drift:.1e}"
        console.print(steps)
    if args.with_vlm_384:
        before, after = run_vlm_384(args.steps_vlm, buckets=False), run_vlm_384(args.steps_vlm, buckets=True)
        for r in (before, after):
            if "error" in r:
                raise SystemExit(f"vlm-cm384 failed: {r['error']}")
        drift = max(abs(a - b) / abs(a) for a, b in zip(before["losses"], after["losses"], strict=True))
        result["vlm_cm384"] = {"reduced_per_microbatch": before, "gradient_buckets": after}
        result["vlm_cm384"]["max_relative_loss_difference"] = drift
        vlm = Table(title="vlm-cm384, MPMD submeshes of 128 + 256 devices in 12 processes: median step")
        for col in ("data-parallel reduction", "median step s", "run s", "steps", "losses"):
            vlm.add_column(col, justify="right" if col in ("median step s", "run s", "steps") else "left")
        for name, r in (("every micro-batch, one per tensor", before), ("once per step, buckets", after)):
            losses = ", ".join(f"{x:.6f}" for x in r["losses"])
            vlm.add_row(name, f"{r['median_step_s']:.1f}", f"{r['wall_s']:.0f}", str(len(r["losses"])), losses)
        vlm.caption = f"largest relative difference between the two runs' losses: {drift:.1e}"
        console.print(vlm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
