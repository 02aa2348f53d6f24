"""One mixture-of-experts block as one expert-parallel rank of Megatron-Core runs it, timed on one GPU
(run where a GPU and PyTorch are).

The block is a rank's share of the published MoE runs (``benchmarks/validation``): RMSNorm, QKV (with
biases for GPT-OSS), rotary positions, GQA attention through SDPA's fused kernels, the output projection,
then the router (float32 logits over all experts, top-k, softmax over the chosen), the permutation of the
token copies by expert, the regrouping of the received copies by local expert (what Megatron's all-to-all
dispatcher does after its exchange), the local experts' two grouped products (``torch._grouped_mm``, the
CUTLASS grouped kernel) around the gated activation (weighted by the routing probabilities, as Megatron's
fused ``weighted_bias_*`` kernels do), the reverse regrouping and the weighted un-permutation. The
all-to-alls themselves are left out (one GPU): ``cost.layer.price_layer`` prices them apart
(``expert_comm_s``). Routing is forced balanced, as the benchmarks force it: the rank receives
``tokens x top_k`` copies, ``tokens x top_k x ep / experts`` per local expert.

Four such blocks run in a row (``LAYERS``; every figure is for the four). Each case runs three ways:
element-wise work compiled (Megatron-Core runs fused kernels for the norms, rotary, permutation and
activation) with the host reading the token counts every layer (the all-to-all dispatcher sizes its
exchange and grouped products from them), compiled without that read, and eager with it. A control runs
each case's block with one dense MLP as wide as a token's experts together (``top_k x ff``: the same
products' work, no router and no permutation). Forward and backward are timed with CUDA events (median
of 5); one step runs under PyTorch's profiler, whose kernels are summed by kind (products, attention, the
rest); ``idle_s`` is the step's time the GPU ran no kernel.

A decode step's grouped products close it: a few token copies routed at random over all of a model's
experts (Mixtral, Qwen3-30B-A3B, DeepSeek-V3 shapes), most groups empty, timed as CUDA graphs.

    python benchmarks/gpu_moe_measure.py --out moe.json

Save the result as ``benchmarks/results/moe-<gpu>-measured.json``; ``benchmarks/gpu_moe.py`` sets it
beside ``price_layer`` on the matching preset.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_block_measure import profiled
from gpu_kernels_measure import device_record, event_time, graph_time, need_cuda

CASES = {
    # a rank of Megatron Bridge's GPT-OSS 120B run (EP 8): 16 local experts, 1,024 copies each
    "gpt-oss-120b-ep8": dict(
        d=2880, heads=64, kv=8, hd=64, experts=128, ep=8, top_k=4, ff=2880, bias=True, act="gpt-oss"
    ),
    # a rank of Megatron Bridge's Qwen3-30B-A3B run (EP 16): 8 local experts, 4,096 copies each
    "qwen3-30b-a3b-ep16": dict(
        d=2048, heads=32, kv=4, hd=128, experts=128, ep=16, top_k=8, ff=768, bias=False, act="swiglu"
    ),
    # Qwen3-235B-A22B's block at EP 32 (4 local experts, 8,192 copies each), attention unsplit
    "qwen3-235b-a22b-ep32": dict(
        d=4096, heads=64, kv=4, hd=128, experts=128, ep=32, top_k=8, ff=1536, bias=False, act="swiglu"
    ),
}
TOKENS = 4096  # one sequence of 4,096 tokens: the runs' micro-batch
LAYERS = 4  # blocks in a row, so the host's launches meet a GPU already busy, as in a stage of a real run


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w


def rope(x, cos, sin):
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


def swiglu(h, b, p):
    g, u = (h if b is None else h + b).chunk(2, dim=-1)
    return (F.silu(g) * u * (1.0 if p is None else p)).type_as(h)


def gpt_oss(h, b, p):
    """GPT-OSS's gate: quick-GELU of the clamped gate times the clamped linear half plus one."""
    g, u = (h if b is None else h + b).chunk(2, dim=-1)
    g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return (g * torch.sigmoid(1.702 * g) * (u + 1.0) * (1.0 if p is None else p)).type_as(h)


class Gather(torch.autograd.Function):
    """Rows ``x[index]`` (a permutation, or each row's ``k`` copies: ``index = order // k``), whose
    backward gathers too: the gradients of a row's copies read and summed, no atomic adds (as the fused
    permutation kernels of Megatron-Core and Transformer Engine do)."""

    @staticmethod
    def forward(ctx, x, index, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        g = g.index_select(0, inverse)
        return (g.view(-1, ctx.k, g.shape[-1]).sum(1) if ctx.k > 1 else g), None, None, None


def combine(y, index, inverse, k):
    """Each token's ``k`` weighted copies summed (the un-permutation), a gather and a sum both ways."""
    return Gather.apply(y, inverse, index, 1).view(-1, k, y.shape[-1]).sum(1)


class MoEBlock(torch.nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        d, hd, ff = c["d"], c["hd"], c["ff"]
        self.c = c
        self.dense = c.get("dense", False)  # the control: one dense MLP of top_k x ff, no routing
        self.local = 1 if self.dense else c["experts"] // c["ep"]
        ff = c["top_k"] * ff if self.dense else ff
        lin = lambda i, o: torch.nn.Linear(i, o, bias=c["bias"])
        self.wqkv, self.wo = lin(d, (c["heads"] + 2 * c["kv"]) * hd), lin(c["heads"] * hd, d)
        self.router = torch.nn.Linear(d, c["experts"], bias=False)
        init = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.02)
        self.w1, self.w2 = init(self.local, 2 * ff, d), init(self.local, d, ff)  # (out, in): the kernel's layout
        self.b1, self.b2 = init(self.local, 2 * ff), init(self.local, d)
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))

    def forward(self, x, cos, sin, ops, sync: bool):
        c, t = self.c, x.shape[0]
        h = ops["rms"](x, self.n1)
        q, k, v = self.wqkv(h).split([c["heads"] * c["hd"], c["kv"] * c["hd"], c["kv"] * c["hd"]], dim=-1)
        q = ops["rope"](q.view(t, c["heads"], c["hd"]), cos, sin).transpose(0, 1)
        k = ops["rope"](k.view(t, c["kv"], c["hd"]), cos, sin).transpose(0, 1)
        v = v.view(t, c["kv"], c["hd"]).transpose(0, 1)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        x = x + self.wo(o.transpose(0, 1).reshape(t, -1))
        h = ops["rms"](x, self.n2)
        if self.dense:
            a = ops["act"](F.linear(h, self.w1[0]), self.b1[0] if c["bias"] else None, None)
            return x + F.linear(a, self.w2[0], self.b2[0] if c["bias"] else None)
        logits = F.linear(h.float(), self.router.weight.float())
        # forced balance: token i's j-th copy goes to expert (i * top_k + j) mod experts; its weight is the
        # softmax of its logits there (the router's gradient flows as in a real step)
        kk = c["top_k"]
        chosen = (torch.arange(t * kk, device=x.device) % c["experts"]).view(t, kk)
        probs = torch.softmax(logits.gather(1, chosen), dim=-1).to(x.dtype)
        expert = chosen.flatten()
        order = torch.argsort(expert, stable=True)  # the copies by global expert: the dispatch order
        inv = torch.argsort(order)
        xs = Gather.apply(h, order // kk, inv, kk)  # permute
        ps = probs.flatten().index_select(0, order)
        # the copies a rank receives, by (source rank, local expert), regrouped by local expert
        local = expert.index_select(0, order) % self.local
        regroup = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.local)
        if sync:  # the all-to-all dispatcher reads the token counts on the host every layer
            offs = torch.tensor(counts.cumsum(0).tolist(), device=x.device, dtype=torch.int32)
        else:
            offs = counts.cumsum(0).to(torch.int32)
        back = torch.argsort(regroup)
        xs, ps = Gather.apply(xs, regroup, back, 1), ps.index_select(0, regroup)
        g = self.local  # balanced: every local expert holds the same number of copies
        h1 = torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs).view(g, -1, self.w1.shape[1])
        b1 = self.b1[:, None, :] if c["bias"] else None
        a = ops["act"](h1, b1, ps.view(g, -1, 1)).flatten(0, 1)
        y = torch._grouped_mm(a, self.w2.transpose(-2, -1), offs=offs)
        if c["bias"]:
            y = (y.view(g, -1, c["d"]) + self.b2[:, None, :] * ps.view(g, -1, 1)).flatten(0, 1)
        y = Gather.apply(y, back, regroup, 1)  # the reverse regrouping
        return x + combine(y, order, inv, kk)


def rotary(hd: int, t: int):
    inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    ang = torch.outer(torch.arange(t, device="cuda").float(), inv)[:, None, :]
    return ang.cos(), ang.sin()


VARIANTS = {"fused+sync": ("fused", True), "fused": ("fused", False), "eager+sync": ("eager", True)}


def run_case(name: str, c: dict, variants: tuple[str, ...]) -> list[dict]:
    torch.manual_seed(0)
    blocks = [MoEBlock(c).cuda().to(torch.bfloat16) for _ in range(LAYERS)]
    cos, sin = rotary(c["hd"], TOKENS)
    x = torch.randn(TOKENS, c["d"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    act = gpt_oss if c["act"] == "gpt-oss" else swiglu
    eager = {"rms": rms, "rope": rope, "act": act}
    forms = {"eager": eager, "fused": {k: torch.compile(f, dynamic=False) for k, f in eager.items()}}
    rows = []
    for label in variants:
        ops, sync = forms[VARIANTS[label][0]], VARIANTS[label][1]

        def step(ops=ops, sync=sync):
            y = x
            for m in blocks:
                y = m(y, cos, sin, ops, sync)
            y.backward(torch.ones_like(y))

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            s = event_time(step, n=5)
            by_kind, kernels, by_name = profiled(step)
        busy = sum(by_kind.values())
        top = sorted(by_name.items(), key=lambda kv: -kv[1])
        row = {
            "case": name,
            "variant": label,
            "dense": bool(c.get("dense")),
            "tokens": TOKENS,
            **c,
            "layers": LAYERS,
            "s": s,
            "first_call_s": first,
            "kernel_s": by_kind,
            "kernels": kernels,
            "idle_s": max(0.0, s - busy),
            "top_kernels": [{"name": k, "s": v} for k, v in top],
        }
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        rows.append(row)
    return rows


DECODE_SHAPES = (
    (4096, 14336, 8),
    (2048, 768, 128),
    (7168, 2048, 256),
)  # (k, n, experts): Mixtral, Qwen3-30B, DeepSeek-V3


def decode_grouped(k: int, n: int, experts: int, rows: int, draws: int = 4) -> dict:
    """A decode step's grouped product: ``rows`` token copies routed at random over ``experts`` groups (most
    of them empty at a small batch), as one CUDA graph of back-to-back products; mean over ``draws``
    routings. An empty group's weight is never read, so the time follows the groups the copies reach."""
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(rows * experts)
    times, touched = [], []
    for _ in range(draws):
        counts = torch.bincount(torch.randint(0, experts, (rows,), generator=gen), minlength=experts)
        offs = counts.cumsum(0).to(torch.int32).cuda()
        times.append(graph_time(lambda i, o=offs: torch._grouped_mm(a, w.transpose(-2, -1), offs=o), 16))
        touched.append(int((counts > 0).sum()))
    return {"k": k, "n": n, "experts": experts, "rows": rows, "s": sum(times) / draws, "touched": sum(touched) / draws}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decode grouped products")
    args = p.parse_args()
    need_cuda(p)
    method = (
        "one block forward and backward, CUDA events, median of 5 eager calls after one; one more under "
        "PyTorch's profiler, kernels summed by kind"
    )
    res: dict = {**device_record(method), "blocks": [], "errors": {}}
    for name in args.cases:
        t0 = time.perf_counter()
        try:
            res["blocks"] += run_case(name, CASES[name], tuple(VARIANTS))
            # the control: the same block with one dense MLP as wide as a token's experts together
            res["blocks"] += run_case(name, {**CASES[name], "dense": True}, ("fused+sync",))
        except Exception as e:  # one case that fails must not lose the others
            res["errors"][name] = f"{type(e).__name__}: {str(e)[:400]}"
            print(name, res["errors"][name], flush=True)
        torch.cuda.empty_cache()
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        args.out.write_text(json.dumps(res, indent=1))
    if args.decode:
        t0 = time.perf_counter()
        try:
            res["decode_grouped"] = [
                decode_grouped(k, n, e, r) for k, n, e in DECODE_SHAPES for r in (1, 2, 8, 32, 128, 512)
            ]
        except Exception as e:
            res["errors"]["decode_grouped"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(f"decode_grouped: {time.perf_counter() - t0:.0f} s", flush=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
