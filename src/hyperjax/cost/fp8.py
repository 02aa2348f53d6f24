"""What FP8 products (``train.fp8``) cost beside the products themselves: the casts, the weight copies and the
activations a recipe keeps in FP8.

An FP8 product runs at the device's FP8 peak (``peak_flops.fp8``) with one-byte operands. Before it, every
operand is cast: a memory-bound kernel that reads the operand in the compute dtype and writes it in FP8
(and its scales). How many passes a recipe makes, per element, is what the frameworks' kernels do on
Hopper, whose FP8 tensor-core products take both operands K-major, so an operand used transposed in the
backward is written a second time, transposed:

- ``tensorwise`` (Transformer Engine's current scaling, torchao's tensorwise): an amax pass over the whole
  tensor, then a fused cast-and-transpose (two FP8 outputs);
- ``delayed`` (TE's delayed scaling): the scale is known before the pass, so the amax is taken during one
  fused cast-and-transpose;
- ``rowwise`` (torchao): the backward products contract other axes, so activations, gradients and weights
  are each cast twice, along each axis, from high precision;
- ``blockwise`` (DeepSeek-V3): activations cast once in 1 x 128 tiles, then re-tiled from FP8 for the
  weight gradient; gradients cast along each axis; weights once in 128 x 128 blocks (usable transposed).

Frameworks cast a layer's weights once per step and keep the FP8 copy across micro-batches (TE's
``is_first_microbatch``, DeepSeek's cached weights): that copy (two bytes a weight with its transpose,
one for blockwise and rowwise) stays on the device through the step. Recipes that keep the forward's FP8
operands for the backward (all but ``rowwise``) keep the linear layers' inputs at one byte an element.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hyperjax.config import Fp8Config, ModelConfig
from hyperjax.cost.compute import stream_time
from hyperjax.cost.counts import block_products
from hyperjax.topology import Hardware


@dataclasses.dataclass(frozen=True)
class CastPasses:
    """Bytes one element moves through HBM in the casts of one operand role, and the kernels launched.

    Attributes:
      activation, gradient, weight: bytes per element read and written (the compute dtype's ``e`` bytes
        read per pass, one byte written per FP8 output).
      kernels: kernels per product for activation, gradient and weight together.
    """

    activation: float
    gradient: float
    weight: float
    kernels: int


def cast_passes(recipe: str, e: int) -> CastPasses:
    """The casts of ``recipe`` for operands stored in ``e``-byte elements (see the module docstring)."""
    if recipe == "tensorwise":
        return CastPasses(activation=2 * e + 2, gradient=2 * e + 2, weight=2 * e + 2, kernels=6)
    if recipe == "delayed":
        return CastPasses(activation=e + 2, gradient=e + 2, weight=e + 2, kernels=3)
    if recipe == "rowwise":
        return CastPasses(activation=2 * e + 2, gradient=2 * e + 2, weight=2 * e + 2, kernels=6)
    return CastPasses(activation=e + 3, gradient=2 * e + 2, weight=e + 1, kernels=5)  # blockwise


def weight_copy_bytes(fp8: Fp8Config) -> float:
    """Bytes per weight of the FP8 copy kept through a step: with its transpose for the per-tensor recipes."""
    return 2.0 if fp8.recipe in ("tensorwise", "delayed") else 1.0


def keeps_fp8_inputs(fp8: Fp8Config) -> bool:
    """Whether the linear layers' inputs are kept for the backward in FP8 (the forward's operands reused)."""
    return fp8.recipe != "rowwise"


def fp8_input_units(m: ModelConfig, *, moe: bool = False, imbalance: float = 1.0) -> dict[str, float]:
    """Per token, the 16-bit bytes of each named activation that are a linear layer's input (what FP8
    recipes keep at one byte instead): the norms' outputs, the output projection's input, the MLP's
    second product's input (a routed copy's dispatched row and hidden, ``top_k`` of them), latent
    attention's latents."""
    h, a, hd = m.d_model, m.heads, m.head_dim
    qkv = 2.0 * (m.kv_lora_rank + (m.q_lora_rank or 0)) if m.attention == "mla" else 0.0
    dispatched, act = 0.0, 2.0 * m.d_ff
    if moe:
        x = m.moe
        dispatched = x.top_k * imbalance * 2.0 * h
        act = x.top_k * imbalance * 2.0 * x.d_ff + 2.0 * x.shared_experts * x.d_ff
    return {
        "norms": (4.0 if m.block == "sequential" else 2.0) * h,
        "qkv": qkv,
        "attn_out": 2.0 * a * hd,
        "mlp_hidden": dispatched,
        "mlp_act": act,
    }


def history_bytes(fp8: Fp8Config, products: int) -> float:
    """Delayed scaling's amax histories of ``products`` products: three tensors each, float32."""
    return 3.0 * products * fp8.amax_history * 4 if fp8.recipe == "delayed" else 0.0


def cast_time(fp8: Fp8Config, e: int, tokens: float, k: float, n: float, hardware: Hardware) -> float:
    """Casting one product's operands to FP8, forward and backward: ``tokens x k`` activations, ``tokens x n``
    gradients and a ``k x n`` weight."""
    casts = cast_passes(fp8.recipe, e)
    moved = tokens * k * casts.activation + tokens * n * casts.gradient + k * n * casts.weight
    return stream_time(moved, ops=casts.kernels, hardware=hardware)


def held_bytes(fp8: Fp8Config, m: ModelConfig, parts: Sequence[Any], fsdp: int) -> float:
    """What FP8 keeps on a device of a stage with ``parts`` through a step: the FP8 weight copies (of a shard
    under FSDP) and delayed scaling's amax histories."""
    copies = sum(p.layers * p.layer.fp8_weights for p in parts) / fsdp * weight_copy_bytes(fp8)
    products = sum(p.layers * sum(q.group != "router" for q in block_products(m, moe=p.moe)) for p in parts)
    return copies + history_bytes(fp8, products)
