"""Where a measured training step's time goes: its GPU kernels, by kind, beside the cost model's parts.

``benchmarks/gpu_step.py`` times whole steps; where one is far from its price, this says which kernels
hold the difference. On the GPU machine it compiles a case of ``gpu_step.py`` (the same step ``hyperjax
train`` runs), warms it up, traces a few steps with JAX's profiler and sums each kernel's time on the
device from the trace:

    python benchmarks/gpu_step_profile.py measure --out profile.json --cases NAME ...   # on the GPU
    python benchmarks/gpu_step_profile.py                                               # anywhere

The default mode reads every ``benchmarks/results/profile-*-measured.json`` and prints, per case, the
kernels by kind (cuBLAS products, XLA's fused element-wise and reduction kernels, cuDNN, copies) beside the
cost model's step on the matching preset.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_step

KINDS = (  # kernel name pattern -> kind, first match wins
    (r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_", "products"),
    (r"cudnn|flash|fmha", "fused attention"),
    (r"memcpy|memset|copy", "copies"),
    (r"reduce|fusion|loop|input_|wrapped|triton", "fusions"),
)


def kind(name: str) -> str:
    """The kind of a kernel, from its name."""
    low = name.lower()
    return next((k for pattern, k in KINDS if re.search(pattern, low)), "other")


def kernels(trace: dict) -> dict[str, list[float]]:
    """Each GPU kernel's durations in seconds, from a Perfetto/Chrome trace: complete events of the processes
    whose name names a GPU (XLA's device streams)."""
    gpus = {
        e["pid"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))
    }
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in gpus and "dur" in e:
            out[e["name"]].append(e["dur"] * 1e-6)
    return out


def profile_case(name: str, *, steps: int, keep: Path) -> dict:
    """Trace ``steps`` steps of case ``name`` after 3 warm-up steps; its kernels' time on the device (the
    trace itself copied to ``keep``)."""
    import jax

    compiled, state, batch, compile_s = gpu_step.compile_case(name)
    for _ in range(3):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
        wall = (time.perf_counter() - start) / steps
        found = sorted(Path(tmp).rglob("perfetto_trace.json.gz"))
        if not found:
            raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {tmp}")
        raw = found[0].read_bytes()
    keep.write_bytes(raw)
    trace = json.loads(gzip.decompress(raw))
    per = kernels(trace)
    rows = sorted(((sum(d) / steps, len(d) / steps, k) for k, d in per.items()), reverse=True)
    return {
        "name": name,
        "overrides": [*gpu_step.COMMON, *gpu_step.CASES[name]],
        "steps": steps,
        "traced_wall_s": wall,
        "kernel_s": sum(r[0] for r in rows),
        "kernels_per_step": sum(r[1] for r in rows),
        "kernels": [{"name": k[:160], "s": s, "count": c} for s, c, k in rows],
        "compile_s": compile_s,
        "processes": sorted(
            {str(e.get("args", {}).get("name")) for e in trace["traceEvents"] if e.get("name") == "process_name"}
        ),
    }


def measure(out: Path, names: list[str], *, steps: int) -> None:
    """Profile every case in ``names`` on this machine's first device; write ``out`` after each."""
    import jax

    device = jax.devices()[0]
    rows = []
    for i, name in enumerate(names):
        try:
            rows.append(profile_case(name, steps=steps, keep=out.with_name(f"{out.stem}-trace{i}.json.gz")))
            r = rows[-1]
            print(f"{name:<36} {r['traced_wall_s'] * 1e3:8.2f} ms a step, kernels {r['kernel_s'] * 1e3:8.2f} ms")
        except Exception as e:  # one case must not lose the others
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
            print(f"{name:<36} failed: {rows[-1]['error'][:300]}", flush=True)
        out.write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__, "cases": rows}, indent=1))


def report(path: Path, out: Path) -> dict:
    """Print each profiled case's kernels by kind beside the cost model's step on the matching preset; write
    ``out``."""
    from rich.console import Console
    from rich.table import Table

    import hyperjax
    from hyperjax.files import write_json

    measured = json.loads(path.read_text())
    preset = gpu_step.preset_of(measured["device"])
    console = Console(width=150)
    summary = {"device": measured["device"], "jax": measured["jax"], "preset": preset, "cases": []}
    for case in measured["cases"]:
        if "error" in case:
            console.print(f"{case['name']}: {case['error']}")
            continue
        est = hyperjax.estimate(
            hyperjax.resolve(hyperjax.load_config(None, [*case["overrides"], f"hardware={preset}"]))
        )
        table = Table(title=f"{case['name']} on one {measured['device']}: kernels by kind, a step")
        for col in ("kind", "ms", "kernels", "share"):
            table.add_column(col, justify="left" if col == "kind" else "right")
        by = collections.defaultdict(lambda: [0.0, 0.0])
        for k in case["kernels"]:
            by[kind(k["name"])][0] += k["s"]
            by[kind(k["name"])][1] += k["count"]
        summary["cases"].append(
            {
                "name": case["name"],
                "kernel_s": case["kernel_s"],
                "by_kind_s": {k: v[0] for k, v in by.items()},
                "predicted_step_s": est.step_time_s,
                "predicted_breakdown_s": est.breakdown_s,
                "longest": case["kernels"][:15],
            }
        )
        for k, (s, c) in sorted(by.items(), key=lambda kv: -kv[1][0]):
            table.add_row(k, f"{s * 1e3:.2f}", f"{c:.0f}", f"{s / case['kernel_s']:.0%}")
        table.add_row("all kernels", f"{case['kernel_s'] * 1e3:.2f}", f"{case['kernels_per_step']:.0f}", "")
        table.add_row("step (traced)", f"{case['traced_wall_s'] * 1e3:.2f}", "", "")
        table.add_row(f"cost model ({preset})", f"{est.step_time_s * 1e3:.2f}", "", "")
        console.print(table)
        top = Table(title="the longest kernels")
        for col in ("kernel", "kind", "ms", "a step"):
            top.add_column(col, justify="left" if col in ("kernel", "kind") else "right")
        for k in case["kernels"][:15]:
            top.add_row(k["name"][:90], kind(k["name"]), f"{k['s'] * 1e3:.2f}", f"{k['count']:.0f}")
        console.print(top)
    write_json(out, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    m = sub.add_parser("measure", help="profile cases on this machine's GPU")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--cases", nargs="+", required=True, choices=list(gpu_step.CASES), metavar="NAME")
    m.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.mode == "measure":
        measure(args.out, args.cases, steps=args.steps)
        return 0
    return gpu_step.each_measured("profile", report, Path(__file__).name)


if __name__ == "__main__":
    sys.exit(main())
