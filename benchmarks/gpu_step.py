"""The cost model against training steps measured on a real GPU.

Small transformers (a few million to two billion parameters), each trained on one GPU by hyperjax's own
training step (the jitted function ``hyperjax train`` runs: AdamW, gradient clipping, the same model
code), timed back to back on the device. The same configs are priced by ``hyperjax.cost.estimate`` on the
matching hardware preset. One GPU exercises the compute and memory halves of the cost model (GEMM
roofline, element-wise streaming, kernel overhead, attention, the head, the optimizer, and the memory
estimate); collectives need more than one device and are validated by ``benchmarks/validate.py``.

Two steps, so the comparison can be redone without a GPU whenever the cost model changes:

    python benchmarks/gpu_step.py measure --out measured.json   # on the GPU machine (JAX with CUDA)
    python benchmarks/gpu_step.py                                # anywhere: predict, compare, print

``measure`` writes the raw timings (median of repeated back-to-back runs) and the compiled program's
memory (XLA's FLOP count is recorded too, but on GPU it leaves out the cuBLAS calls, so it is not used);
the default mode reads every ``benchmarks/results/gpu-*-measured.json`` (an H100 and an H200 so far), prices
every case on the matching preset (``dgx-h100``, ``dgx-h200``: the same compute, the H200's HBM3e) and writes
``benchmarks/results/gpu-*.json``. Serving cases (``--decode``) time a greedy generation's prefill and
per-token decode against ``hyperjax.cost.estimate_inference``. Nothing is fitted to these measurements: the
preset's constants come from datasheets and public microbenchmarks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PRESET = "dgx-h100"  # what a case is configured for; compared on the preset of the device that ran it

GPT2_SMALL = ["model.family=gpt", "model.layers=12", "model.d_model=768", "model.heads=12", "model.d_ff=3072"]
GPT2_MEDIUM = ["model.family=gpt", "model.layers=24", "model.d_model=1024", "model.heads=16", "model.d_ff=4096"]
LLAMA_1B = [  # TinyLlama-1.1B's shape
    "model.family=llama",
    "model.layers=22",
    "model.d_model=2048",
    "model.heads=32",
    "model.kv_heads=4",
    "model.d_ff=5632",
    "model.vocab=32000",
]
MOE_SMALL = [  # a small mixture of experts: 16 experts of 1408, top-2, one shared (Qwen1.5-MoE-like widths)
    "model.family=llama",
    "model.layers=8",
    "model.d_model=2048",
    "model.heads=16",
    "model.d_ff=5632",
    "model.vocab=32000",
    "model.moe.experts=16",
    "model.moe.top_k=2",
    "model.moe.d_ff=1408",
    "model.moe.shared_experts=1",
    "model.moe.first_dense=1",
]
LLAMA_8B_8L = [  # Llama-3-8B's layer shape, 8 of its 32 layers
    "model.family=llama",
    "model.layers=8",
    "model.d_model=4096",
    "model.heads=32",
    "model.kv_heads=8",
    "model.d_ff=14336",
    "model.vocab=32000",
]
CASES: dict[str, list[str]] = {  # name: config overrides (one device, hardware dgx-h100)
    "quickstart fp32": [
        "model.family=gpt",
        "model.layers=4",
        "model.d_model=256",
        "model.heads=8",
        "model.d_ff=1024",
        "model.vocab=256",
        "model.seq_len=128",
        "train.global_batch=32",
        "train.dtype=float32",
    ],
    "gpt2-small s1024 b8 bf16": [*GPT2_SMALL, "model.vocab=50304", "model.seq_len=1024", "train.global_batch=8"],
    "gpt2-small s1024 b8 fp32": [
        *GPT2_SMALL,
        "model.vocab=50304",
        "model.seq_len=1024",
        "train.global_batch=8",
        "train.dtype=float32",
    ],
    "gpt2-small s1024 b32 bf16": [*GPT2_SMALL, "model.vocab=50304", "model.seq_len=1024", "train.global_batch=32"],
    "gpt2-small s4096 b2 bf16": [*GPT2_SMALL, "model.vocab=50304", "model.seq_len=4096", "train.global_batch=2"],
    "gpt2-medium s1024 b8 bf16": [*GPT2_MEDIUM, "model.vocab=50304", "model.seq_len=1024", "train.global_batch=8"],
    "llama-1b s2048 b4 bf16": [*LLAMA_1B, "model.seq_len=2048", "train.global_batch=4"],
    "llama-1b s2048 b4 bf16 full": [*LLAMA_1B, "model.seq_len=2048", "train.global_batch=4", "train.recompute=full"],
    "llama-1b s2048 b4 bf16 selective": [
        *LLAMA_1B,
        "model.seq_len=2048",
        "train.global_batch=4",
        "train.recompute=selective",
    ],
    "llama-8b-8l s2048 b2 bf16": [*LLAMA_8B_8L, "model.seq_len=2048", "train.global_batch=2"],
    # added after the model's two fixes (README), as out-of-sample checks
    "gpt2-small s2048 b8 bf16 full": [
        *GPT2_SMALL,
        "model.vocab=50304",
        "model.seq_len=2048",
        "train.global_batch=8",
        "train.recompute=full",
    ],
    "gpt2-medium s512 b32 bf16": [*GPT2_MEDIUM, "model.vocab=50304", "model.seq_len=512", "train.global_batch=32"],
    "llama-1b s1024 b8 fp32": [*LLAMA_1B, "model.seq_len=1024", "train.global_batch=8", "train.dtype=float32"],
    "llama-8b-8l s4096 b1 bf16 selective": [
        *LLAMA_8B_8L,
        "model.seq_len=4096",
        "train.global_batch=1",
        "train.recompute=selective",
    ],
    # FP8 products (train.fp8) beside their BF16 twins above, and a mixture of experts
    **{
        f"llama-8b-8l s2048 b2 fp8 {recipe}": [
            *LLAMA_8B_8L,
            "model.seq_len=2048",
            "train.global_batch=2",
            f"train.fp8.recipe={recipe}",
        ]
        for recipe in ("tensorwise", "rowwise", "blockwise")
    },
    "gpt2-medium s1024 b8 fp8 tensorwise": [
        *GPT2_MEDIUM,
        "model.vocab=50304",
        "model.seq_len=1024",
        "train.global_batch=8",
        "train.fp8.recipe=tensorwise",
    ],
    "moe-16x2 s2048 b4 bf16": [*MOE_SMALL, "model.seq_len=2048", "train.global_batch=4"],
    "moe-16x2 s2048 b4 fp8 tensorwise": [
        *MOE_SMALL,
        "model.seq_len=2048",
        "train.global_batch=4",
        "train.fp8.recipe=tensorwise",
    ],
}
DECODE: dict[str, list[str]] = {  # serving: name -> config overrides (serve.* sets the batch and lengths)
    "decode llama-1b b1 p512 n128": [*LLAMA_1B, "model.seq_len=1024", "serve.batch=1", "serve.prompt_len=512"],
    "decode llama-1b b16 p512 n128": [*LLAMA_1B, "model.seq_len=1024", "serve.batch=16", "serve.prompt_len=512"],
    "decode llama-8b-8l b8 p1024 n128": [*LLAMA_8B_8L, "model.seq_len=2048", "serve.batch=8", "serve.prompt_len=1024"],
}
DECODE_COMMON = ["serve.new_tokens=128"]
COMMON = [f"hardware={PRESET}", "emulate.devices=1", "train.data=synthetic", "train.dtype=bfloat16", "train.steps=100"]


def config(name: str):
    """The run config of case ``name`` (``COMMON`` first, so a case's own overrides win)."""
    import hyperjax

    return hyperjax.load_config(None, [*COMMON, *CASES[name]])


def compile_case(name: str):
    """Case ``name``'s training step compiled on the first local device: ``(compiled, state, batch,
    compile_s)``."""
    import jax
    from flax import nnx

    import hyperjax
    from hyperjax.train import Batches, build_train_step, init_state, make_optimizer, prepare

    cfg = config(name)
    run = hyperjax.resolve(cfg, 1)
    t = cfg.train
    model = hyperjax.build_model(cfg.model, dtype=t.dtype, recompute=t.recompute, seed=t.seed, fp8=t.fp8)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(t)
    mesh = hyperjax.make_mesh(run.hardware, run.axes, devices=jax.devices()[:1])
    step = build_train_step(
        graphdef=graphdef,
        param_state=params,
        strategy=prepare(run).strategy,
        mesh=mesh,
        optimizer=optimizer,
        moe=cfg.model.moe,
    )
    state = init_state(params, optimizer, step)
    m = cfg.model
    data = Batches(source=t.data, global_batch=t.global_batch, seq_len=m.seq_len, vocab=m.vocab, seed=t.seed)
    batch = data.global_batch_arrays(0, step.batch_shardings)
    start = time.perf_counter()
    compiled = step.fn.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - start


def measure_case(name: str, *, repeats: int, iters: int) -> dict:
    """Compile case ``name`` on the first local device and time ``iters`` steps, ``repeats`` times."""
    import jax

    from hyperjax.train import compiled_bytes

    compiled, state, batch, compile_s = compile_case(name)
    mem = compiled.memory_analysis()
    text = compiled.as_text() or ""
    fp8_gemms = text.count("__cublas$lt$matmul$f8")  # the GEMMs XLA's GPU compiler ran in FP8
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - start) / iters)
    return {
        "name": name,
        "overrides": [*COMMON, *CASES[name]],
        "step_s": statistics.median(times),
        "step_s_runs": times,
        "iters": iters,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "xla_flops": float(cost.get("flops", 0.0)) if cost else None,
        "memory_bytes": compiled_bytes(compiled) or None,
        "temp_bytes": None if mem is None else mem.temp_size_in_bytes,
        "fp8_gemm_calls": fp8_gemms,
    }


def measure_decode(name: str) -> dict:
    """Prefill and decode of case ``name`` on the first local device (random weights, greedy)."""
    import jax
    import numpy as np

    import hyperjax
    from hyperjax.models import generate

    cfg = hyperjax.load_config(None, [*COMMON, *DECODE[name], *DECODE_COMMON])
    s = cfg.serve
    model = hyperjax.build_model(cfg.model, dtype=cfg.train.dtype, seed=0)
    prompt = np.random.default_rng(0).integers(0, cfg.model.vocab, (s.batch, s.prompt_len)).astype(np.int32)
    with jax.default_device(jax.devices()[0]):
        runs = [generate(model, prompt, s.new_tokens) for _ in range(3)]
    best = min(runs, key=lambda g: g.decode_s)
    return {
        "name": name,
        "overrides": [*COMMON, *DECODE[name], *DECODE_COMMON],
        "decode_s_per_token": best.decode_s / best.steps,
        "prefill_s": min(g.prefill_s for g in runs),
        "steps": best.steps,
        "method": "fastest of 3 generations; compiled beforehand; one Python dispatch per token",
    }


def measure(out: Path, names: list[str], *, repeats: int, iters: int, decode: list[str] = ()) -> None:
    """Time every case in ``names`` (and the serving cases in ``decode``) on this machine's first device; write
    ``out`` after each case."""
    import jax

    device = jax.devices()[0]
    rows, served = [], []
    for name in names:
        try:
            rows.append(measure_case(name, repeats=repeats, iters=iters))
            print(f"{name:<36} {rows[-1]['step_s'] * 1e3:9.2f} ms  (compile {rows[-1]['compile_s']:.0f} s)", flush=True)
        except Exception as e:  # one case that does not fit must not lose the others
            rows.append({"name": name, "overrides": [*COMMON, *CASES[name]], "error": f"{type(e).__name__}: {e}"})
            print(f"{name:<36} failed: {rows[-1]['error'][:200]}", flush=True)
        _write(out, device, repeats, iters, rows, served)
    for name in decode:
        try:
            served.append(measure_decode(name))
            print(f"{name:<36} {served[-1]['decode_s_per_token'] * 1e3:9.3f} ms a token", flush=True)
        except Exception as e:
            served.append({"name": name, "error": f"{type(e).__name__}: {e}"})
            print(f"{name:<36} failed: {served[-1]['error'][:200]}", flush=True)
        _write(out, device, repeats, iters, rows, served)


def _write(out: Path, device, repeats: int, iters: int, rows: list, served: list) -> None:
    import jax

    out.write_text(
        json.dumps(
            {
                "device": device.device_kind,
                "platform": device.platform,
                "jax": jax.__version__,
                "method": f"median over {repeats} runs of {iters} back-to-back steps, after 3 warm-up steps",
                "cases": rows,
                "decode": served,
            },
            indent=1,
        )
    )


def preset_of(device: str) -> str:
    """The hardware preset of the GPU a measurement ran on."""
    return "dgx-h200" if "H200" in device else "dgx-h100"


def compare(measured_path: Path, out: Path) -> dict:
    """Price every measured case on the matching preset; print the tables; write ``out``."""
    from rich.console import Console
    from rich.table import Table

    import hyperjax
    from hyperjax.files import write_json

    measured = json.loads(measured_path.read_text())
    preset = preset_of(measured["device"])
    table = Table(title=f"One training step on one {measured['device']}: measured vs {preset} preset")
    cols = ("case", "params", "measured ms", "predicted ms", "error", "TFLOP/s", "mem meas GiB", "mem pred GiB")
    for col in (*cols, "fits"):
        table.add_column(col, justify="left" if col == "case" else "right")
    rows, failed = [], []
    for case in measured["cases"]:
        cfg = hyperjax.load_config(None, [*case["overrides"], f"hardware={preset}"])  # one device of the preset
        est = hyperjax.estimate(hyperjax.resolve(cfg))
        if "error" in case:  # it did not run (out of device memory): the prediction should say so
            failed.append(
                {
                    "name": case["name"],
                    "measured": case["error"].split(":")[0] + ": " + case["error"].split(":")[1].strip(),
                    "predicted_memory_gib": est.memory_per_device_gib["peak"],
                    "predicted_fits": est.fits,
                }
            )
            mem = f"{est.memory_per_device_gib['peak']:.2f}"
            fits = "no" if not est.fits else "yes"
            table.add_row(case["name"], f"{est.params / 1e6:,.0f}M", "out of memory", "", "", "", "", mem, fits)
            continue
        flops = est.model_flops_per_step
        error = est.step_time_s / case["step_s"] - 1
        mem_pred = est.memory_per_device_gib["peak"]
        mem_meas = case["memory_bytes"] / 2**30 if case.get("memory_bytes") else None
        rows.append(
            {
                "name": case["name"],
                "params": est.params,
                "measured_step_s": case["step_s"],
                "predicted_step_s": est.step_time_s,
                "error": error,
                "model_flops": flops,
                "measured_tflops": flops / case["step_s"] / 1e12,
                "predicted_breakdown_s": est.breakdown_s,
                "measured_memory_gib": mem_meas,
                "predicted_memory_gib": mem_pred,
                "predicted_fits": est.fits,
            }
        )
        table.add_row(
            case["name"],
            f"{est.params / 1e6:,.0f}M",
            f"{case['step_s'] * 1e3:.2f}",
            f"{est.step_time_s * 1e3:.2f}",
            f"{error:+.0%}",
            f"{flops / case['step_s'] / 1e12:.0f}",
            "" if mem_meas is None else f"{mem_meas:.2f}",
            f"{mem_pred:.2f}",
            "yes" if est.fits else "no",
        )
    errors = [abs(r["error"]) for r in rows]
    memory = [r["predicted_memory_gib"] / r["measured_memory_gib"] - 1 for r in rows if r["measured_memory_gib"]]
    summary = {
        "device": measured["device"],
        "jax": measured["jax"],
        "method": measured["method"],
        "preset": preset,
        "cases": rows,
        "mean_abs_error": statistics.mean(errors) if errors else None,
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "memory_error_range": [min(memory), max(memory)] if memory else None,
        "did_not_run": failed,
        "fits_right": sum(r["predicted_fits"] for r in rows) + sum(not f["predicted_fits"] for f in failed),
        "fits_cases": len(rows) + len(failed),
    }
    console = Console(width=150)
    console.print(table)
    if errors:
        console.print(
            f"step time: mean |error| {summary['mean_abs_error']:.1%}, median {summary['median_abs_error']:.1%}, "
            f"max {summary['max_abs_error']:.1%} over {len(errors)} cases"
        )
    if memory:
        console.print(
            f"memory: predicted peak {min(memory):+.0%} to {max(memory):+.0%} of the compiled program's "
            "(arguments + outputs + temporaries)"
        )
    console.print(f"fits: predicted right for {summary['fits_right']} of {summary['fits_cases']} cases")
    summary["decode"] = compare_decode(measured.get("decode", []), preset, console)
    write_json(out, summary)
    return summary


def compare_decode(cases: list[dict], preset: str, console) -> list[dict]:
    """Each measured generation's decode time per token and prefill against ``estimate_inference``."""
    from rich.table import Table

    import hyperjax
    from hyperjax.cost import estimate_inference

    if not cases:
        return []
    table = Table(title=f"Serving on one GPU: measured vs {preset} preset")
    for col in ("case", "decode ms meas.", "pred.", "error", "prefill ms meas.", "pred.", "error"):
        table.add_column(col, justify="left" if col == "case" else "right")
    rows = []
    for case in cases:
        if "error" in case:
            table.add_row(case["name"], "failed", "", "", "", "", "")
            continue
        est = estimate_inference(
            hyperjax.resolve(hyperjax.load_config(None, [*case["overrides"], f"hardware={preset}"]))
        )
        row = {
            "name": case["name"],
            "measured_decode_s": case["decode_s_per_token"],
            "predicted_decode_s": est.decode_s_per_token,
            "decode_error": est.decode_s_per_token / case["decode_s_per_token"] - 1,
            "measured_prefill_s": case["prefill_s"],
            "predicted_prefill_s": est.prefill_s,
            "prefill_error": est.prefill_s / case["prefill_s"] - 1,
        }
        rows.append(row)
        table.add_row(
            case["name"],
            f"{row['measured_decode_s'] * 1e3:.3f}",
            f"{row['predicted_decode_s'] * 1e3:.3f}",
            f"{row['decode_error']:+.0%}",
            f"{row['measured_prefill_s'] * 1e3:.2f}",
            f"{row['predicted_prefill_s'] * 1e3:.2f}",
            f"{row['prefill_error']:+.0%}",
        )
    console.print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    m = sub.add_parser("measure", help="time every case on this machine's GPU")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="NAME")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--iters", type=int, default=10)
    m.add_argument("--decode", nargs="*", default=list(DECODE), choices=list(DECODE), metavar="NAME")
    args = parser.parse_args(argv)
    if args.mode == "measure":
        import jax

        if jax.devices()[0].platform != "gpu":  # timings on another device would be labelled a GPU preset's
            parser.error(f"measure times a GPU, but JAX's first device is {jax.devices()[0].platform}; run it there")
        measure(args.out, args.cases, repeats=args.repeats, iters=args.iters, decode=args.decode)
        return 0
    return each_measured("gpu", compare, Path(__file__).name)


def each_measured(prefix: str, report, script: str) -> int:
    """``report(measured, out)`` for every ``results/<prefix>-*-measured.json``, ``out`` its name without
    ``-measured``; 2, and what to run, when there is none."""
    found = sorted(RESULTS.glob(f"{prefix}-*-measured.json"))
    if not found:
        print(f"no {RESULTS}/{prefix}-*-measured.json; run `python benchmarks/{script} measure --out FILE` on a GPU")
        return 2
    for path in found:
        report(path, path.with_name(path.name.replace("-measured", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
