"""Kernels of the published GPU runs, measured on one GPU with PyTorch (run where a GPU and PyTorch are).

What the frameworks behind ``benchmarks/validation`` call: cuBLAS products of the shapes a transformer's
layers multiply (large, skinny, per-expert), FlashAttention through ``scaled_dot_product_attention``,
PyTorch's grouped GEMM for experts, FP8 ``_scaled_mm``, HBM streaming, and one Llama-3-8B block
forward and backward in eager PyTorch and under ``torch.compile``. Products are timed as CUDA graphs of
back-to-back launches over operands rotated past the L2 cache, so a figure is the kernel's own rate.

    python benchmarks/gpu_kernels_measure.py --out measured.json [--budget-s 240]

Save the result as ``benchmarks/results/kernels-<gpu>-measured.json``: ``benchmarks/gpu_kernels.py`` sets it
beside the cost model's prices.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

L2_ROTATE_BYTES = 256 * 2**20  # operands cycled through more than the L2 holds (50 MB on an H100)


def graph_time(fn, n: int) -> float:
    """Seconds per call of ``fn`` (which takes the call's index), replayed as one CUDA graph of ``n`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) / 1e3 / n)
    return sorted(runs)[len(runs) // 2]


def event_time(fn, n: int = 5) -> float:
    """Seconds per call of ``fn`` launched eagerly (for kernels of milliseconds)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) / 1e3)
    return sorted(runs)[len(runs) // 2]


def copies(m: int, k: int, n: int) -> int:
    return max(1, min(16, L2_ROTATE_BYTES // max(1, 2 * (m * k + k * n))))


def gemm(m: int, k: int, n: int) -> dict:
    c = copies(m, k, n)
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(c)]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    reps = max(4, min(64, int(2e12 / (2 * m * n * k))))
    t = graph_time(lambda i: torch.matmul(a[i % c], b[i % c], out=out), reps)
    return {"m": m, "k": k, "n": n, "s": t, "tflops": 2 * m * n * k / t / 1e12}


def grouped(groups: int, rows: int, k: int, n: int) -> dict:
    a = torch.randn(groups * rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
    t = graph_time(lambda i: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs), 16)
    return {"groups": groups, "rows": rows, "k": k, "n": n, "s": t, "tflops": 2 * groups * rows * k * n / t / 1e12}


def scaled_mm(m: int, k: int, n: int, a_fmt: str = "e4m3", b_fmt: str = "e4m3") -> dict:
    """cuBLASLt's FP8 product of an ``(m, k)`` by a ``(k, n)`` operand in the given formats (Transformer
    Engine's hybrid recipe multiplies an E5M2 gradient by an E4M3 weight or activation), bf16 out, operands
    rotated past L2 as :func:`gemm`'s are."""
    fmt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    c = max(1, min(16, L2_ROTATE_BYTES // max(1, m * k + k * n)))
    a = [torch.randn(m, k, device="cuda").to(fmt[a_fmt]) for _ in range(c)]
    b = [torch.randn(n, k, device="cuda").to(fmt[b_fmt]).t() for _ in range(c)]
    one = torch.tensor(1.0, device="cuda")
    fn = lambda i: torch._scaled_mm(a[i % c], b[i % c], scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    t = graph_time(fn, 16)
    return {"m": m, "k": k, "n": n, "formats": [a_fmt, b_fmt], "s": t, "tflops": 2 * m * n * k / t / 1e12}


FP8_ROWS = {  # tokens a micro-batch (over context ranks), width, heads, key-value heads, head width, MLP, gated, TP
    "GPT-3 5B": (8192, 4096, 32, 32, 128, 16384, False, 1),
    "GPT-3 20B, TP 2": (4096, 6144, 48, 48, 128, 24576, False, 2),
    "GPT-3 175B, TP 4 (128 GPUs)": (2048, 12288, 96, 96, 128, 49152, False, 4),
    "GPT-3 175B, TP 4 (512 GPUs)": (4096, 12288, 96, 96, 128, 49152, False, 4),
    "Llama 2 7B": (4096, 4096, 32, 32, 128, 11008, True, 1),
    "Llama 2 13B": (4096, 5120, 40, 40, 128, 13824, True, 1),
    "Llama 2 70B, TP 4": (4096, 8192, 64, 8, 128, 28672, True, 4),
    "Llama 3 8B, CP 2": (4096, 4096, 32, 8, 128, 14336, True, 1),
    "Llama 3 70B, TP 4 x CP 2": (4096, 8192, 64, 8, 128, 28672, True, 4),
    "Nemotron-3 8B, TP 2": (16384, 4096, 32, 32, 128, 16384, False, 2),
    "Nemotron-3 22B, TP 2": (8192, 6144, 48, 48, 128, 24576, False, 2),
    "Nemotron-4 340B, TP 8": (4096, 18432, 96, 8, 192, 73728, False, 8),
}
"""The per-GPU layer products of NeMo 24.07's FP8 runs (``benchmarks/validation/fp8``), from their configs."""


def fp8_rows() -> list[dict]:
    """Each FP8 run's four layer products (QKV, attention out, MLP in, MLP out), forward, data gradient and
    weight gradient, in BF16 (``torch.matmul``) and FP8 (``_scaled_mm``: E4M3 forward, E5M2 gradients by E4M3
    backward, Transformer Engine's hybrid format)."""
    out, seen = [], {}
    for row, (tokens, d, h, kv, hd, ff, gated, tp) in FP8_ROWS.items():
        layer = {
            "qkv": (d, (h + 2 * kv) * hd // tp),
            "out": (h * hd // tp, d),
            "mlp_in": (d, (2 if gated else 1) * ff // tp),
            "mlp_out": (ff // tp, d),
        }
        for product, (k, n) in layer.items():
            passes = {
                "forward": ((tokens, k, n), ("e4m3", "e4m3")),
                "data_grad": ((tokens, n, k), ("e5m2", "e4m3")),
                "weight_grad": ((k, tokens, n), ("e4m3", "e5m2")),
            }
            for name, (shape, fmts) in passes.items():
                if (shape, fmts) not in seen:
                    seen[shape, fmts] = (tried(gemm, *shape), tried(scaled_mm, *shape, *fmts))
                bf16, fp8 = seen[shape, fmts]
                out.append({"row": row, "product": product, "pass": name, "bf16": bf16, "fp8": fp8})
    return out


def attention(batch: int, heads: int, seq: int, dim: int, backend: str) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = (
        torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    flops = 4 * batch * heads * seq * seq * dim / 2  # causal: half the score matrix
    with sdpa_kernel(kind):
        fwd = event_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g = torch.randn_like(o)
        both = event_time(
            lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)
        )
    bwd = both - fwd
    return {
        "backend": backend,
        "batch": batch,
        "heads": heads,
        "seq": seq,
        "dim": dim,
        "fwd_s": fwd,
        "bwd_s": bwd,
        "fwd_tflops": flops / fwd / 1e12,
        "bwd_tflops": 2.5 * flops / bwd / 1e12,
    }


def tried(fn, *args) -> dict:
    """``fn(*args)``, or the error it raised (a kernel that does not take a shape loses only its row)."""
    try:
        return fn(*args)
    except Exception as e:
        return {"args": list(args), "error": f"{type(e).__name__}: {str(e)[:200]}"}


def stream() -> dict:
    x = torch.empty(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = event_time(lambda: y.copy_(x))
    t3 = event_time(lambda: torch.add(x, y, out=y))
    return {"copy_bytes_per_s": 2 * x.nbytes / t, "add_bytes_per_s": 3 * x.nbytes / t3}


class Block(torch.nn.Module):
    """A Llama-3 block as torchtitan writes it: float32 RMSNorm, rotary embedding by complex products,
    key-value heads repeated, SDPA (flash), SwiGLU MLP."""

    def __init__(self, d: int = 4096, heads: int = 32, kv: int = 8, ff: int = 14336):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv, d // heads
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.wq, self.wk, self.wv, self.wo = lin(d, d), lin(d, kv * self.hd), lin(d, kv * self.hd), lin(d, d)
        self.w1, self.w3, self.w2 = lin(d, ff), lin(d, ff), lin(ff, d)
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))

    @staticmethod
    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w

    @staticmethod
    def rope(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        h = self.norm(x, self.n1)
        q = self.wq(h).view(b, s, self.h, self.hd)
        k = self.wk(h).view(b, s, self.kv, self.hd)
        v = self.wv(h).view(b, s, self.kv, self.hd)
        q, k = self.rope(q, freqs), self.rope(k, freqs)
        rep = self.h // self.kv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        h = self.norm(x, self.n2)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rotary_table(head_dim: int, seq: int) -> torch.Tensor:
    """torchtitan's rotary table (theta 500,000) for ``seq`` positions, shaped to broadcast over heads."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.outer(torch.arange(seq, device="cuda").float(), inv)
    return torch.polar(torch.ones_like(angles), angles).view(1, seq, 1, head_dim // 2)


def block(batch: int, seq: int, compiled: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    m = Block().cuda().to(torch.bfloat16)
    freqs = rotary_table(m.hd, seq)
    x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(m) if compiled else m
    start = time.perf_counter()

    def step():
        y = fn(x, freqs)
        y.backward(torch.ones_like(y))

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        step()
        torch.cuda.synchronize()
        warm = time.perf_counter() - start
        t = event_time(step, n=5)
    return {"batch": batch, "seq": seq, "compiled": compiled, "s": t, "first_call_s": warm}


def device_record(method: str) -> dict:
    """What a result file says of where and how it was measured: the GPU, its SMs, PyTorch, ``method``."""
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__, "method": method}


def need_cuda(parser: argparse.ArgumentParser) -> None:
    """Exit 2 naming what is missing where no CUDA GPU is visible to PyTorch (the timings would be nothing)."""
    if not torch.cuda.is_available():
        parser.error(
            "no CUDA GPU is visible to PyTorch here (torch.cuda.is_available() is False); run it on a machine "
            "with an NVIDIA GPU"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument(
        "--only", nargs="*", help="run only these sections (e.g. attention_widths), kept beside --out's others"
    )
    args = p.parse_args()
    need_cuda(p)
    start = time.perf_counter()
    res = device_record(
        "CUDA graphs of back-to-back products over operands rotated past L2, median of 5 replays; "
        "attention and blocks: CUDA events, median of 5 eager calls"
    )
    if args.only and args.out.exists():  # the other sections of an earlier run on the same device are kept
        earlier = json.loads(args.out.read_text())
        res = {**earlier, **res} if earlier.get("device") == res["device"] else res
    tokens = 16384  # torchtitan's Llama 3.1 8B: local batch 2 x 8192
    sections = {
        "attention": lambda: [
            attention(b, 32, s, 128, be) for be in ("flash", "cudnn") for b, s in ((8, 2048), (4, 4096), (2, 8192))
        ],
        "gemm": lambda: [
            gemm(*s)
            for s in [
                *[(n, n, n) for n in (512, 1024, 2048, 4096, 8192, 16384)],
                *[(tokens, 4096, n) for n in (1024, 4096, 14336, 128256)],
                (tokens, 14336, 4096),
                (4096, tokens, 14336),
                (14336, tokens, 4096),
                (4096, tokens, 1024),
                *[(m, 4096, n) for m in (1, 8, 32, 128, 512, 2048) for n in (4096, 14336)],
                *[(m, 8192, 8192) for m in (1, 16, 64, 256, 1024)],
                *[(8192, 768, n) for n in (768, 2304, 3072)],
                (8192, 3072, 768),
                *[(r, 2048, 768) for r in (128, 512, 2048, 8192)],
                *[(r, 7168, 2048) for r in (128, 512, 2048, 8192)],
            ]
        ],
        "grouped": lambda: [
            grouped(g, r, k, n) for (k, n) in ((2048, 768), (7168, 2048)) for g in (8, 32, 128) for r in (64, 256, 1024)
        ],
        "stream": stream,
        "block_eager": lambda: [block(2, 8192, False), block(1, 8192, False)],
        "fp8": lambda: [
            scaled_mm(*s)
            for s in ((8192, 8192, 8192), (tokens, 4096, 14336), (tokens, 14336, 4096), (tokens, 4096, 4096))
        ],
        "fp8_rows": fp8_rows,
        "block_compiled": lambda: [block(2, 8192, True)],
        # head widths other than 128 (GPT-OSS's 64; 256), as many query heads as a 4,096-wide model has
        "attention_widths": lambda: [
            tried(attention, 16384 // s, 4096 // d, s, d, be)
            for be in ("flash", "cudnn")
            for d in (64, 128, 256)
            for s in (2048, 4096, 8192)
        ],
    }
    for name, run in sections.items():
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - start > args.budget_s:
            res[name] = {"error": "skipped: time budget spent"}
            continue
        t0 = time.perf_counter()
        try:
            res[name] = run()
        except Exception as e:  # one section that fails must not lose the others
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        torch.cuda.empty_cache()
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
