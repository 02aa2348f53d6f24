"""Power, clock and throughput of one GPU under sustained products and streaming (run where a GPU and PyTorch are).

A power-capped part's sustained rate is its clock under load. This reads what the part does at its own
cap: the SM clock, board power and throughput while BF16 products of two shapes (8192^3 and a Llama-3-8B MLP
product, 16384 x 14336 x 4096), a device-to-device copy and torchtitan's Llama-3-8B training block (compiled
and eager; ``gpu_block_measure.py``) run back to back for some seconds each, with nvidia-smi sampled beside
them, and the idle draw before them. The power cap is read, never changed.

    python benchmarks/gpu_power_measure.py --out power.json [--seconds 20]

Save the result as ``benchmarks/results/power-<gpu>-measured.json``; ``configs/hardware/h100-96g-500w.yaml``
derives its peak from it (see the preset's comment).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_block_measure import llama_step

FIELDS = (
    "power.draw",
    "power.draw.instant",
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "temperature.gpu",
    "power.limit",
    "enforced.power.limit",
    "clocks_event_reasons.active",
    "clocks_throttle_reasons.active",
)


def fields() -> list[str]:
    """The query fields this driver knows."""
    ok = []
    for f in FIELDS:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={f}", "--format=csv,noheader,nounits"], capture_output=True)
        if r.returncode == 0 and b"Field" not in r.stdout:
            ok.append(f)
    return ok


class Sampler:
    """nvidia-smi read every ``period`` seconds on a thread, each row stamped with the wall time."""

    def __init__(self, names: list[str], period: float = 0.1):
        self.names, self.period, self.rows, self.stop = names, period, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        q = ["nvidia-smi", f"--query-gpu={','.join(self.names)}", "--format=csv,noheader,nounits"]
        while not self.stop.is_set():
            out = subprocess.run(q, capture_output=True, text=True).stdout.strip().split(", ")
            self.rows.append((time.time(), out))
            time.sleep(self.period)

    def window(self, t0: float, t1: float) -> dict:
        """Each numeric field's median over rows in ``[t0, t1]`` and the throttle reasons seen."""
        rows = [r for t, r in self.rows if t0 <= t <= t1]
        got: dict = {"samples": len(rows)}
        for i, name in enumerate(self.names):
            vals = [r[i] for r in rows if i < len(r)]
            try:
                nums = [float(v) for v in vals]
                got[name] = statistics.median(nums) if nums else None
            except ValueError:
                got[name] = sorted(set(vals))
        return got


def sustained(name: str, step, flops: float, nbytes: float, seconds: float, sampler: Sampler) -> dict:
    """Run ``step`` back to back for ``seconds`` (after 3 s of warm-up, which the window skips), timing
    batches of calls with CUDA events."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t_start = time.time()
    rates, t_measure = [], t_start + 3.0
    while time.time() < t_start + 3.0 + seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            step()
        b.record()
        b.synchronize()
        if time.time() >= t_measure:
            rates.append(20 / (a.elapsed_time(b) / 1e3))
    t_end = time.time()
    calls = statistics.median(rates)
    row = {"name": name, "calls_per_s": calls, "seconds": seconds}
    if flops:
        row["tflops"] = calls * flops / 1e12
    if nbytes:
        row["tb_per_s"] = calls * nbytes / 1e12
    row["smi"] = sampler.window(t_measure, t_end)
    print(json.dumps(row), flush=True)
    return row


def product(name: str, m: int, k: int, n: int, seconds: float, sampler: Sampler) -> dict:
    """An ``m x k`` by ``k x n`` BF16 product, sustained."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    return sustained(name, lambda: torch.mm(a, b, out=out), 2 * m * k * n, 0, seconds, sampler)


def copy(name: str, nbytes: int, seconds: float, sampler: Sampler) -> dict:
    """A device-to-device copy of ``nbytes``, sustained (bytes read and written counted)."""
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    return sustained(name, lambda: dst.copy_(src), 0, 2 * nbytes, seconds, sampler)


def block(name: str, compiled: bool, seconds: float, sampler: Sampler) -> dict:
    """torchtitan's Llama-3-8B block (2 x 8,192 tokens, op-level checkpointing), forward and backward,
    sustained: products, attention and element-wise work sharing the power budget as in a training step."""
    step = llama_step(checkpointed=True, compiled=compiled)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sustained(name, step, 0, 0, seconds, sampler)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None or not torch.cuda.is_available():
        parser.error("needs an NVIDIA GPU that PyTorch sees and nvidia-smi on PATH to sample its power; run it there")
    names = fields()
    sampler = Sampler(names)
    sampler.thread.start()
    time.sleep(4.0)
    idle = sampler.window(time.time() - 3.5, time.time())
    print(json.dumps({"idle": idle}), flush=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fields": names, "idle": idle}
    runs = [
        product("gemm_8192", 8192, 8192, 8192, args.seconds, sampler),
        product("gemm_llama8b_mlp", 16384, 4096, 14336, args.seconds, sampler),
        copy("copy_2gib", 2 * 2**30, args.seconds / 2, sampler),
        block("llama8b_block_compiled", True, args.seconds, sampler),
        block("llama8b_block_eager", False, args.seconds, sampler),
    ]
    sampler.stop.set()
    results["runs"] = runs
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
