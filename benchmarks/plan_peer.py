"""hyperjax's strategy search beside a published planner's: Calculon's optimal-execution search.

Calculon (Isaev et al., SC'23, github.com/calculon-ai/calculon) prices every (tensor, pipeline, data,
interleaving, micro-batch, recompute, optimizer sharding, tensor-parallel communication, overlap and
offload) choice of a GPT-shaped model on a described system and keeps the fastest. It is not on PyPI;
pass a checkout with ``--calculon PATH`` (it imports pandas and psutil). Both planners get one common
case, by default GPT 13B (Megatron's shape: 40 layers, d_model 5120, 40 heads, sequence 2048, 16-bit) at a
global batch of at most 512 on 8 A100-80GB: Calculon on its own ``systems/a100_80g.json`` with host memory
set to 0 GiB (hyperjax's search keeps every tensor on the device and leaves host placement to its offload
pass; with offload Calculon's search is 7x larger), hyperjax on ``dgx-a100-80g``. Each runs as a person
would run it, in a fresh process on this machine (Calculon with a worker per core), and the table reports
the wall time, the strategies each considered, each one's best strategy and its predicted step time.
Calculon's best is then priced by ``hyperjax predict`` (what hyperjax can express of it), with the
default attention kernel and with the fused one, so the two answers can be told apart from the two
cost models. Writes ``benchmarks/results/plan_peer.json``.

Calculon prices about 170 strategies a second on this 2-core machine; GPT-3 175B on 64 GPUs (1.5 million
strategies without offload) would take it about 2.5 hours, so ``--model gpt3-175b`` is there for larger
machines.

    python benchmarks/plan_peer.py --calculon ~/src/calculon [--model gpt-13b] [--devices 8] [--batch 512]
    python benchmarks/plan_peer.py --price-only   # re-price the saved best strategies, no search
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from hyperjax.files import write_json

RESULTS = Path(__file__).parent / "results"
SHAPES = {
    "gpt-13b": {"layers": 40, "d_model": 5120, "heads": 40, "d_ff": 20480, "vocab": 51200, "seq_len": 2048},
    "gpt3-175b": {"layers": 96, "d_model": 12288, "heads": 96, "d_ff": 49152, "vocab": 51200, "seq_len": 2048},
}
RECOMPUTE = {"full": "full", "attn_only": "selective", "none": "none"}


def calculon_app(shape: dict, folder: Path) -> Path:
    """The model in Calculon's application format (its blocks; Calculon has no embedding or head)."""
    app = {
        "hidden": shape["d_model"],
        "feedforward": shape["d_ff"],
        "seq_size": shape["seq_len"],
        "attn_heads": shape["heads"],
        "attn_size": shape["d_model"] // shape["heads"],
        "num_blocks": shape["layers"],
    }
    path = folder / "app.json"
    path.write_text(json.dumps(app))
    return path


def calculon_system(checkout: Path, folder: Path) -> Path:
    """Calculon's A100-80GB system with no host memory to offload to."""
    system = json.loads((checkout / "systems/a100_80g.json").read_text())
    system["mem2"]["GiB"] = 0
    path = folder / "a100_80g_no_offload.json"
    path.write_text(json.dumps(system))
    return path


def run_calculon(checkout: Path, shape: dict, devices: int, batch: int, folder: Path) -> dict:
    out = folder / "calculon.json"
    app, system = calculon_app(shape, folder), calculon_system(checkout, folder)
    command = [sys.executable, str(checkout / "bin/calculon"), "llm-optimal-execution", str(app)]
    command += [str(devices), str(batch), "float16", str(system), str(out)]
    command += ["--cpus", str(os.cpu_count() or 1)]
    env = os.environ | {"PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"Calculon failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    log = proc.stdout + proc.stderr
    executions = next(int(line.split(":")[-1]) for line in log.splitlines() if "Total executions" in line)
    best = json.loads(out.read_text())["0"]
    exe, stats = best["execution"], best["stats"]
    return {
        "wall_s": wall,
        "strategies": executions,
        "execution": exe,
        "step_time_s": stats["total_time"],
        "memory_gib": stats["proc_mem_tier1_cap_req"] / 2**30,
        "offload_gib": stats.get("proc_mem_tier2_cap_req", 0.0) / 2**30,
    }


def hyperjax_config(shape: dict, batch: int) -> dict:
    model = {"family": "gpt", **shape}
    return {"hardware": "dgx-a100-80g", "model": model, "train": {"global_batch": batch, "dtype": "bfloat16"}}


def run_hyperjax(shape: dict, devices: int, batch: int, folder: Path) -> dict:
    path = folder / "model.yaml"
    path.write_text(yaml.safe_dump(hyperjax_config(shape, batch)))
    command = [sys.executable, "-m", "hyperjax", "plan", str(path), "--devices", str(devices), "--json"]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"hyperjax plan failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    data = json.loads(proc.stdout)
    best = data["best"]
    return {
        "wall_s": wall,
        "search_s": data["seconds"],
        "strategies": data["searched"],
        "priced": data["priced"],
        "best": best,
        "step_time_s": best["step_time_s"],
    }


def calculon_as_overrides(exe: dict, batch: int) -> list[str]:
    """Calculon's best execution as hyperjax config overrides (what hyperjax can express of it)."""
    sets = {
        "train.global_batch": exe["batch_size"],
        "parallel.tensor": exe["tensor_par"],
        "parallel.pipeline": exe["pipeline_par"],
        "parallel.data": exe["data_par"],
        "train.micro_batch": exe["microbatch_size"],
        "train.recompute": RECOMPUTE[exe["activation_recompute"]],
        "parallel.zero_stage": 1 if exe["optimizer_sharding"] else 0,
        "parallel.sequence_parallel": str(exe["tensor_par_comm_type"] == "rs_ag").lower(),
    }
    if exe["pipeline_par"] > 1:
        interleave = exe["pipeline_interleaving"]
        sets |= {
            "parallel.virtual_stages": interleave,
            "parallel.schedule": "interleaved" if interleave > 1 else "1f1b",
        }
    return [f"{k}={v}" for k, v in sets.items()]


def predict(shape: dict, devices: int, batch: int, overrides: list[str], folder: Path) -> dict:
    path = folder / "model.yaml"
    path.write_text(yaml.safe_dump(hyperjax_config(shape, batch)))
    command = [sys.executable, "-m", "hyperjax", "predict", str(path), "--devices", str(devices), "--json"]
    for item in overrides:
        command += ["--set", item]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    data = json.loads(proc.stdout)
    return {"step_time_s": data["step_time_s"], "fits": data["fits"], "peak_gib": data["memory_per_device_gib"]["peak"]}


def describe_calculon(exe: dict) -> str:
    parts = [f"tensor {exe['tensor_par']}", f"pipeline {exe['pipeline_par']}", f"data {exe['data_par']}"]
    if exe["pipeline_interleaving"] > 1:
        parts.append(f"interleaved v{exe['pipeline_interleaving']}")
    parts += [f"micro-batch {exe['microbatch_size']}", f"recompute {exe['activation_recompute']}"]
    parts += ["optimizer sharded"] if exe["optimizer_sharding"] else []
    parts += [f"TP comm {exe['tensor_par_comm_type']}"]
    offloads = [k.split("_")[0] for k in ("weight_offload", "activations_offload", "optimizer_offload") if exe[k]]
    parts += [f"offload {'+'.join(offloads)}"] if offloads else []
    return ", ".join(parts) + f"; batch {exe['batch_size']}"


def describe_hyperjax(best: dict) -> str:
    keys = ("parallel.tensor", "parallel.pipeline", "parallel.data", "parallel.fsdp", "parallel.virtual_stages")
    parts = [f"{k.split('.')[1]} {best[k]}" for k in keys if k in best and best[k] not in (None, 1)]
    for key in ("parallel.schedule", "parallel.sequence_parallel", "parallel.zero_stage", "train.recompute"):
        if key in best and best[key] not in (None, 0, False, "none"):
            parts.append(f"{key.split('.')[1]} {best[key]}")
    if "train.micro_batch" in best:
        parts.append(f"micro-batch {best['train.micro_batch']}")
    return ", ".join(parts)


def cross_price(shape: dict, devices: int, batch: int, theirs: dict, folder: Path) -> None:
    """Price Calculon's best in hyperjax, with the default attention kernel and with the fused one."""
    overrides = calculon_as_overrides(theirs["execution"], batch)
    theirs["hyperjax_overrides"] = overrides
    theirs["priced_by_hyperjax"] = predict(shape, devices, batch, overrides, folder)
    flash = [*overrides, "model.attention_kernel=flash"]
    theirs["priced_by_hyperjax_flash"] = predict(shape, devices, batch, flash, folder)


def _priced(cross: dict) -> str:
    if "error" in cross:
        return cross["error"]
    return f"{cross['step_time_s']:.2f}, {cross['peak_gib']:.0f} GiB" + ("" if cross["fits"] else " (does not fit)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calculon", type=Path, help="a checkout of github.com/calculon-ai/calculon")
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt-13b")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_peer.json")
    parser.add_argument(
        "--price-only", action="store_true", help="re-price the best strategies saved in --out; run no search"
    )
    args = parser.parse_args()
    if args.price_only:
        saved = json.loads(args.out.read_text())
        args.model, args.devices, args.batch = saved["model"], saved["devices"], saved["batch"]
        ours, theirs = saved["hyperjax"], saved["calculon"]
    elif args.calculon is None or not (args.calculon / "bin/calculon").is_file():
        raise SystemExit(f"--calculon {args.calculon}: no bin/calculon there; pass a checkout of calculon-ai/calculon")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shape = SHAPES[args.model]
        if not args.price_only:
            ours = run_hyperjax(shape, args.devices, args.batch, folder)
            theirs = run_calculon(args.calculon, shape, args.devices, args.batch, folder)
        cross_price(shape, args.devices, args.batch, theirs, folder)

    title = f"{args.model} on {args.devices} A100-80GB, global batch <= {args.batch}: two searches"
    table = Table(title=title)
    columns = ("planner", "wall s", "strategies", "best strategy", "its step s (own model)")
    for col in (*columns, "priced by hyperjax: s, peak", "the same, flash attention"):
        table.add_column(col, justify="left" if col in ("planner", "best strategy") else "right")
    peak = f"{ours['best']['peak_gib']:.0f} GiB"
    table.add_row(
        "hyperjax plan",
        f"{ours['wall_s']:.1f}",
        f"{ours['strategies']:,}",
        describe_hyperjax(ours["best"]),
        f"{ours['step_time_s']:.2f}",
        f"{ours['step_time_s']:.2f}, {peak}",
        "",
    )
    table.add_row(
        "Calculon llm-optimal-execution",
        f"{theirs['wall_s']:.1f}",
        f"{theirs['strategies']:,}",
        describe_calculon(theirs["execution"]),
        f"{theirs['step_time_s']:.2f}, {theirs['memory_gib']:.0f} GiB",
        _priced(theirs["priced_by_hyperjax"]),
        _priced(theirs["priced_by_hyperjax_flash"]),
    )
    Console(width=180).print(table)
    case = {"model": args.model, "shape": SHAPES[args.model], "devices": args.devices, "batch": args.batch}
    write_json(args.out, case | {"hyperjax": ours, "calculon": theirs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
