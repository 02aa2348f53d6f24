"""Where each hyperjax parameter lives in a Hugging Face checkpoint, and how its axes are laid out there.

A hyperjax parameter is a *view* of one Hugging Face tensor (or of one per expert, stacked): the stored
tensor's axes split into the parameter's (``q_proj.weight`` of ``heads x head_dim`` rows splits its first
axis into two), then permuted (PyTorch's ``nn.Linear`` stores ``(out, in)``; hyperjax ``(in, ...out)``).
GPT-2 fuses the query, key and value projections into ``c_attn``: each is a range of its columns.
:class:`View` reads any block of a parameter from the block of the stored tensor that holds it, and writes
a whole parameter back into the stored layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hyperjax.config import ModelConfig
from hyperjax.config.hf_export import hf_model_type


@dataclasses.dataclass(frozen=True)
class View:
    """A hyperjax parameter as a view of stored tensors.

    Attributes:
      names: the stored tensor, or one per expert (stacked on a leading axis).
      split: for each axis of the (stacked) stored tensor, the sizes it splits into (the *split axes*).
      perm: the parameter's axis ``i`` is split axis ``perm[i]``.
      part: ``(split axis, start, stop)``: the parameter holds this range of one split axis (GPT-2's fused
        ``c_attn`` holds queries, keys and values; DeepSeek's ``kv_b_proj`` each head's keys and values).
    """

    names: tuple[str, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    part: tuple[int, int, int] | None = None

    @property
    def _full(self) -> list[int]:
        return [n for group in self.split for n in group]

    @property
    def _sizes(self) -> list[int]:
        """The split axes' sizes in the parameter (the part's axis restricted)."""
        sizes = self._full
        if self.part is not None:
            axis, start, stop = self.part
            sizes[axis] = stop - start
        return sizes

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape."""
        sizes = self._sizes
        return tuple(sizes[p] for p in self.perm)

    def read(self, index: tuple[slice, ...], fetch: Callable[[str, tuple[slice, ...]], np.ndarray]) -> np.ndarray:
        """Block ``index`` of the parameter, reading only the stored block that holds it (``fetch(name,
        slices)`` reads a block of a stored tensor)."""
        sizes = self._sizes
        want = [slice(None)] * len(sizes)
        for i, s in enumerate(index):
            want[self.perm[i]] = s
        want = [slice(*s.indices(n)[:2]) for s, n in zip(want, sizes, strict=True)]
        if self.part is not None:  # in the stored tensor's coordinates
            axis, start, _ = self.part
            want[axis] = slice(want[axis].start + start, want[axis].stop + start)
        stored, shape, after = [], [], []
        j = 0
        for group in self.split:
            first, inner = want[j], math.prod(group[1:])
            stored.append(slice(first.start * inner, first.stop * inner))
            shape += [first.stop - first.start, *group[1:]]
            after += [slice(None), *want[j + 1 : j + len(group)]]
            j += len(group)
        if len(self.names) > 1:
            rows = self.names[stored[0]]
            block = np.stack([fetch(n, tuple(stored[1:])) for n in rows]) if rows else np.zeros((0,))
        else:
            block = fetch(self.names[0], tuple(stored))
        block = block.reshape(shape)[tuple(after)]
        return np.ascontiguousarray(block.transpose(self.perm))

    def write(self, value: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        """Put the whole parameter ``value`` into ``tensors`` in the stored layout (a tensor several
        parameters share is made the first time one of its parts is written)."""
        flat = value.transpose(np.argsort(self.perm))
        full = self._full
        stored_shape = [math.prod(g) for g in self.split]
        if len(self.names) > 1:
            pieces = list(flat.reshape(stored_shape))
            for name, piece in zip(self.names, pieces, strict=True):
                tensors[name] = np.ascontiguousarray(piece)
            return
        if self.part is None:
            tensors[self.names[0]] = np.ascontiguousarray(flat.reshape(stored_shape))
            return
        whole = tensors.setdefault(self.names[0], np.zeros(stored_shape, value.dtype))
        axis, start, stop = self.part
        where = [slice(None)] * len(full)
        where[axis] = slice(start, stop)
        whole.reshape(full)[tuple(where)] = flat

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of one stored tensor."""
        sizes = [math.prod(g) for g in self.split]
        return tuple(sizes[1:] if len(self.names) > 1 else sizes)


def _same(name: str, shape: tuple[int, ...]) -> View:
    return View((name,), tuple((n,) for n in shape), tuple(range(len(shape))))


def _linear(name: str, out: tuple[int, ...], d_in: int) -> View:
    """``nn.Linear`` weight ``(prod(out), in)`` as hyperjax's ``(in, *out)``."""
    return View((name,), (out, (d_in,)), (len(out), *range(len(out))))


def _linear_in(name: str, d_out: int, ins: tuple[int, ...]) -> View:
    """``nn.Linear`` weight ``(out, prod(in))`` as hyperjax's ``(*in, out)`` (an output projection)."""
    return View((name,), ((d_out,), ins), (*range(1, len(ins) + 1), 0))


def _experts(names: tuple[str, ...], rows: int, cols: int) -> View:
    """Per-expert ``nn.Linear`` weights ``(rows, cols)`` stacked as hyperjax's ``(experts, cols, rows)``."""
    return View(names, ((len(names),), (rows,), (cols,)), (0, 2, 1))


def views(m: ModelConfig) -> Iterator[tuple[tuple[str, ...], View]]:
    """Each parameter of a hyperjax model of ``m`` (its path in the parameter tree) and where it is stored in
    the checkpoint of :func:`hyperjax.config.hf.hf_model_type` ``(m)``."""
    kind = hf_model_type(m)
    yield from (_gpt2 if kind == "gpt2" else _llama_like)(m, kind)


def _llama_like(m: ModelConfig, kind: str) -> Iterator[tuple[tuple[str, ...], View]]:
    d, f, v = m.d_model, m.d_ff, m.vocab
    yield ("embed",), _same("model.embed_tokens.weight", (v, d))
    for i in range(m.layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        a = f"{p}self_attn."
        yield (*b, "norm1", "scale"), _same(f"{p}input_layernorm.weight", (d,))
        yield (*b, "norm2", "scale"), _same(f"{p}post_attention_layernorm.weight", (d,))
        if m.attention == "mla":
            yield from _latent(m, a, b)
        else:
            yield from _attention(m, a, b)
        if m.is_moe(i):
            yield from _moe(m, kind, p, b)
            continue
        mp = f"{p}mlp."
        yield (*b, "mlp", "w_in"), _linear(f"{mp}up_proj.weight", (f,), d)
        yield (*b, "mlp", "w_gate"), _linear(f"{mp}gate_proj.weight", (f,), d)
        yield (*b, "mlp", "w_out"), _linear_in(f"{mp}down_proj.weight", d, (f,))
        if m.bias:
            for ours, theirs, n in (("b_in", "up_proj", f), ("b_gate", "gate_proj", f), ("b_out", "down_proj", d)):
                yield (*b, "mlp", ours), _same(f"{mp}{theirs}.bias", (n,))
    yield ("final_norm", "scale"), _same("model.norm.weight", (d,))
    if not m.tie_embeddings:
        yield ("lm_head",), _linear("lm_head.weight", (v,), d)


def _attention(m: ModelConfig, a: str, b: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], View]]:
    d, h, kv, hd = m.d_model, m.heads, m.kv_heads, m.head_dim
    yield (*b, "attn", "q_proj"), _linear(f"{a}q_proj.weight", (h, hd), d)
    yield (*b, "attn", "k_proj"), _linear(f"{a}k_proj.weight", (kv, hd), d)
    yield (*b, "attn", "v_proj"), _linear(f"{a}v_proj.weight", (kv, hd), d)
    yield (*b, "attn", "o_proj"), _linear_in(f"{a}o_proj.weight", d, (h, hd))
    if m.qkv_bias:
        for x, heads in (("q", h), ("k", kv), ("v", kv)):
            yield (*b, "attn", f"{x}_bias"), View((f"{a}{x}_proj.bias",), ((heads, hd),), (0, 1))
    if m.bias:
        yield (*b, "attn", "o_bias"), _same(f"{a}o_proj.bias", (d,))
    if m.qk_norm:
        yield (*b, "attn", "q_norm", "scale"), _same(f"{a}q_norm.weight", (hd,))
        yield (*b, "attn", "k_norm", "scale"), _same(f"{a}k_norm.weight", (hd,))


def _latent(m: ModelConfig, a: str, b: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], View]]:
    """DeepSeek's latent attention: ``kv_b_proj`` holds each head's keys then values (``hd`` rows each)."""
    d, h, hd, rd, c, q = m.d_model, m.heads, m.head_dim, m.rope_head_dim, m.kv_lora_rank, m.q_lora_rank
    if q is None:
        yield (*b, "attn", "q_proj"), _linear(f"{a}q_proj.weight", (h, hd + rd), d)
    else:
        yield (*b, "attn", "q_down"), _linear(f"{a}q_a_proj.weight", (q,), d)
        yield (*b, "attn", "q_norm", "scale"), _same(f"{a}q_a_layernorm.weight", (q,))
        yield (*b, "attn", "q_up"), _linear(f"{a}q_b_proj.weight", (h, hd + rd), q)
    yield (*b, "attn", "kv_down"), _linear(f"{a}kv_a_proj_with_mqa.weight", (c + rd,), d)
    yield (*b, "attn", "kv_norm", "scale"), _same(f"{a}kv_a_layernorm.weight", (c,))
    for j, name in enumerate(("k_up", "v_up")):
        yield (
            (*b, "attn", name),
            View((f"{a}kv_b_proj.weight",), ((h, 2 * hd), (c,)), (2, 0, 1), (1, j * hd, (j + 1) * hd)),
        )
    yield (*b, "attn", "o_proj"), _linear_in(f"{a}o_proj.weight", d, (h, hd))


def _moe(m: ModelConfig, kind: str, p: str, b: tuple[Any, ...]) -> Iterator[tuple[tuple[str, ...], View]]:
    d, e, f = m.d_model, m.moe.experts, m.moe.d_ff
    if kind == "mixtral":
        mp, up, gate, down = f"{p}block_sparse_moe.", "w3", "w1", "w2"
    else:
        mp, up, gate, down = f"{p}mlp.", "up_proj", "gate_proj", "down_proj"
    yield (*b, "mlp", "router"), _linear(f"{mp}gate.weight", (e,), d)
    if m.moe.balance == "bias":  # DeepSeek-V3's score-correction bias
        yield (*b, "mlp", "router_bias"), _same(f"{mp}gate.e_score_correction_bias", (e,))
    if m.moe.shared_experts:
        n = m.moe.shared_experts * f
        yield (*b, "mlp", "shared", "w_in"), _linear(f"{mp}shared_experts.up_proj.weight", (n,), d)
        yield (*b, "mlp", "shared", "w_gate"), _linear(f"{mp}shared_experts.gate_proj.weight", (n,), d)
        yield (*b, "mlp", "shared", "w_out"), _linear_in(f"{mp}shared_experts.down_proj.weight", d, (n,))
    names = lambda w: tuple(f"{mp}experts.{j}.{w}.weight" for j in range(e))
    yield (*b, "mlp", "w_in"), _experts(names(up), f, d)
    yield (*b, "mlp", "w_gate"), _experts(names(gate), f, d)
    yield (*b, "mlp", "w_out"), _experts(names(down), d, f)


def _gpt2(m: ModelConfig, kind: str) -> Iterator[tuple[tuple[str, ...], View]]:
    d, h, hd, f, v = m.d_model, m.heads, m.head_dim, m.d_ff, m.vocab
    yield ("embed",), _same("transformer.wte.weight", (v, d))
    yield ("pos_embed",), _same("transformer.wpe.weight", (m.seq_len, d))
    for i in range(m.layers):
        p, b = f"transformer.h.{i}.", ("blocks", i)
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            yield (*b, ours, "scale"), _same(f"{p}{theirs}.weight", (d,))
            yield (*b, ours, "bias"), _same(f"{p}{theirs}.bias", (d,))
        for j, x in enumerate("qkv"):  # Conv1D stores (in, out); c_attn's columns are q, k, v
            heads = (1, j * h, (j + 1) * h)
            yield (*b, "attn", f"{x}_proj"), View((f"{p}attn.c_attn.weight",), ((d,), (3 * h, hd)), (0, 1, 2), heads)
            yield (*b, "attn", f"{x}_bias"), View((f"{p}attn.c_attn.bias",), ((3 * h, hd),), (0, 1), (0, *heads[1:]))
        yield (*b, "attn", "o_proj"), View((f"{p}attn.c_proj.weight",), ((h, hd), (d,)), (0, 1, 2))
        yield (*b, "attn", "o_bias"), _same(f"{p}attn.c_proj.bias", (d,))
        yield (*b, "mlp", "w_in"), _same(f"{p}mlp.c_fc.weight", (d, f))
        yield (*b, "mlp", "b_in"), _same(f"{p}mlp.c_fc.bias", (f,))
        yield (*b, "mlp", "w_out"), _same(f"{p}mlp.c_proj.weight", (f, d))
        yield (*b, "mlp", "b_out"), _same(f"{p}mlp.c_proj.bias", (d,))
    yield ("final_norm", "scale"), _same("transformer.ln_f.weight", (d,))
    yield ("final_norm", "bias"), _same("transformer.ln_f.bias", (d,))
    if not m.tie_embeddings:
        yield ("lm_head",), _linear("lm_head.weight", (v,), d)


def stored_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every stored tensor of ``m``'s checkpoint."""
    return {n: view.stored_shape for _, view in views(m) for n in view.names}
