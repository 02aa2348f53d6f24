"""One Llama-3-8B block as torchtitan runs it, eager and compiled, with and without its op-level activation
checkpointing, timed and split by kernel kind on one GPU (run where a GPU and PyTorch are).

The block is ``gpu_kernels_measure.Block`` (torchtitan's code: float32 RMSNorm, complex rotary products,
``repeat_kv``, SDPA's FlashAttention-2, SwiGLU), at torchtitan's local batch of 2 x 8,192 tokens. The
checkpointing is torchtitan's ``selective_ac_option = 'op'`` policy: matrix products' and SDPA's outputs
saved except every second product's, everything else recomputed in the backward. Each variant's forward
and backward is timed with CUDA events; one step of it runs under PyTorch's profiler, whose kernels are
summed as products (cuBLAS/CUTLASS), attention (flash) and the rest (element-wise and reductions).

    python benchmarks/gpu_block_measure.py --out block.json
    python benchmarks/gpu_block_measure.py --block gpt --out block-gpt.json

``--block gpt`` times nanoGPT's GPT block instead (LayerNorm, one QKV product, SDPA, GELU MLP, biases; 4 x
4,096 tokens), eager and compiled, without checkpointing. Save the results as
``benchmarks/results/block-<gpu>-measured.json`` and ``block-gpt-<gpu>-measured.json``; the cost model's
``train.elementwise: eager`` takes its ratios from them (``hyperjax.cost.layer.eager_ratio``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gpu_kernels_measure import Block, event_time, need_cuda, rotary_table

SAVE = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default}


def op_policy(meta: dict, ctx, func, *args, **kwargs):
    """torchtitan's 'op' policy: save products' and attention's outputs, except every second product's."""
    mode = "recompute" if ctx.is_recompute else "forward"
    if func == torch.ops.aten.mm.default:
        meta[f"{mode}_mm_count"] += 1
    save = func in SAVE and not (func == torch.ops.aten.mm.default and meta[f"{mode}_mm_count"] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def contexts():
    return create_selective_checkpoint_contexts(partial(op_policy, defaultdict(int)))


class Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, freqs):
        return checkpoint(self.block, x, freqs, use_reentrant=False, context_fn=contexts)


class GPTBlock(torch.nn.Module):
    """A GPT-2/3 block as nanoGPT writes it: LayerNorm, one QKV product, SDPA, GELU MLP, biases."""

    def __init__(self, d: int = 4096, heads: int = 32):
        super().__init__()
        self.h, self.hd = heads, d // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.h, self.hd).transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


def kind(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_")):
        return "products"
    return "other"


def llama_step(checkpointed: bool, compiled: bool, batch: int = 2, seq: int = 8192):
    """One forward and backward of torchtitan's block (with its op-level checkpointing), as a callable."""
    torch.manual_seed(0)
    m = Block().cuda().to(torch.bfloat16)
    freqs = rotary_table(m.hd, seq)
    net = Checkpointed(m) if checkpointed else m
    fn = torch.compile(net) if compiled else net
    x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return lambda: fn(x, freqs).backward(torch.ones_like(x))


def measure(checkpointed: bool, compiled: bool, batch: int = 2, seq: int = 8192, gpt: bool = False) -> dict:
    if not gpt:
        return _timed(llama_step(checkpointed, compiled, batch, seq), checkpointed, compiled, batch, seq)
    torch.manual_seed(0)  # nanoGPT's block: no rotary table, plain input
    m = GPTBlock().cuda().to(torch.bfloat16)
    fn = torch.compile(m) if compiled else m
    x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return _timed(lambda: fn(x).backward(torch.ones_like(x)), checkpointed, compiled, batch, seq)


def profiled(step) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """One call of ``step`` under PyTorch's profiler: its kernels' seconds and counts by :func:`kind`, and
    their seconds by name (the first 90 characters)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    kernels: dict[str, int] = defaultdict(int)
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            dt = getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) / 1e6
            by_kind[kind(e.name)] += dt
            kernels[kind(e.name)] += 1
            by_name[e.name[:90]] += dt
    return dict(by_kind), dict(kernels), dict(by_name)


def _timed(step, checkpointed: bool, compiled: bool, batch: int, seq: int) -> dict:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        t = event_time(step, n=5)
        by_kind, kernels, _ = profiled(step)
    row = {
        "checkpointed": checkpointed,
        "compiled": compiled,
        "batch": batch,
        "seq": seq,
        "s": t,
        "kernel_s": by_kind,
        "kernels": kernels,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--block", choices=("llama", "gpt"), default="llama")
    args = parser.parse_args()
    need_cuda(parser)
    gpt = args.block == "gpt"
    rows = []
    for checkpointed in (False,) if gpt else (False, True):
        for compiled in (False, True):
            try:
                rows.append(measure(checkpointed, compiled, *((4, 4096) if gpt else (2, 8192)), gpt=gpt))
            except Exception as err:  # a variant that fails is recorded, the others still run
                rows.append({"checkpointed": checkpointed, "compiled": compiled, "error": repr(err)[:500]})
                print(json.dumps(rows[-1]), flush=True)
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
