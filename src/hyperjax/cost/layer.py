"""One block of a model, one micro-batch, one device: its time, its communication and what it keeps.

The block's products (:func:`hyperjax.cost.counts.block_products`) are priced on the roofline at their
tensor-parallel shapes, the attention core as one batched product per micro-batch, and element-wise work
as the stored activations streamed through HBM. The backward costs twice the forward. Tensor- and
context-parallel collectives sit on the critical path; FSDP's gathers and scatters overlap the layer's
compute and only what exceeds it is exposed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from hyperjax.config import ModelConfig, Recompute
from hyperjax.cost.collectives import collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.cost.counts import activation_units, block_products, block_tensors
from hyperjax.topology import AxisSpan, Hardware


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One block, one micro-batch, one device.

    Attributes:
      products_s: the weight products by name (``qkv``, ``attn_out``, ``mlp_hidden``: the MLP's two or
        three matrices).
      core_s: the attention core's two batched products.
      forward_s: the forward pass (products, core, element-wise work).
      backward_s: the backward pass (twice the forward).
      recompute_s: what ``recompute`` adds to the backward.
      tensor_comm_s: tensor-parallel collectives of forward, backward and recomputation.
      context_comm_s: context-parallel key/value gathers.
      fsdp_gather_s: one all-gather of the layer's parameters over the fsdp axis.
      fsdp_scatter_s: one reduce-scatter of its gradients.
      fsdp_exposed_s: what two gathers and a scatter add beyond the layer's compute.
      stored_bytes: activations kept for the backward under ``recompute``.
      activation_bytes: the activations kept without recomputation, by name (``block_in`` included).
      recompute_by_name_s: recomputing each named activation: the forward ops that produce or read it.
      params: the layer's parameters held by one device.
      param_transfer_bytes: one copy of those parameters in the compute dtype (what a host fetch moves).
    """

    products_s: Mapping[str, float]
    core_s: float
    forward_s: float
    backward_s: float
    recompute_s: float
    tensor_comm_s: float
    context_comm_s: float
    fsdp_gather_s: float
    fsdp_scatter_s: float
    fsdp_exposed_s: float
    stored_bytes: float
    activation_bytes: Mapping[str, float]
    recompute_by_name_s: Mapping[str, float]
    params: float
    param_transfer_bytes: float

    @property
    def weight_s(self) -> float:
        """The weight-gradient GEMMs alone (a split backward's ``W``): as many FLOPs as the products."""
        return sum(self.products_s.values())


def price_layer(
    m: ModelConfig,
    *,
    micro: float,
    axes: Mapping[str, int],
    spans: Mapping[str, AxisSpan],
    dtype: str,
    recompute: Recompute,
    sequence_parallel: bool,
    hardware: Hardware,
) -> LayerCost:
    """Price one block of ``m`` for ``micro`` sequences on one device of a mesh with ``axes``.

    Results are remembered: a search prices the same few layers thousands of times.

    Args:
      m: the block's model (its ``seq_len`` is the tokens per sequence the block sees).
      micro: sequences of one micro-batch on one data-parallel replica.
      axes: the stage's mesh axes (``data``, ``fsdp``, ``context``, ``tensor``).
      spans: the tiers each axis spans.
      dtype: compute dtype.
      recompute: activation recomputation.
      sequence_parallel: the residual stream split over the tensor axis.
      hardware: the machine.
    """
    return _price_layer(
        m, micro, tuple(axes.items()), tuple(spans.items()), dtype, recompute, sequence_parallel, hardware
    )


@functools.lru_cache(maxsize=65536)
def _price_layer(
    m: ModelConfig,
    micro: float,
    axes_items: tuple[tuple[str, int], ...],
    span_items: tuple[tuple[str, AxisSpan], ...],
    dtype: str,
    recompute: Recompute,
    sequence_parallel: bool,
    hardware: Hardware,
) -> LayerCost:
    axes, spans = dict(axes_items), dict(span_items)
    tp, cp, fsdp = axes["tensor"], axes["context"], axes["fsdp"]
    e = 2 if dtype == "bfloat16" else 4  # activation and matmul operand bytes
    s, a, hd = m.seq_len, m.heads, m.head_dim
    tokens = micro * s / cp  # tokens of one micro-batch on one device

    def gemm(mm: float, nn: float, kk: float, count: float = 1) -> float:
        return gemm_time(mm, nn, kk, count=count, bytes_per_element=e, dtype=dtype, hardware=hardware)

    def product(p) -> float:
        return gemm(tokens, p.n / tp, p.k) if p.split == "n" else gemm(tokens, p.n, p.k / tp)

    qkv, attn_out, mlp_in, mlp_out = block_products(m)
    products = {
        "qkv": product(qkv),
        "attn_out": product(attn_out),
        "mlp_hidden": product(mlp_in) + product(mlp_out),
    }
    proj = sum(products.values())
    core = 2 * gemm(s / cp, s, hd, count=micro * a / tp)  # scores and attention-weighted values
    units = activation_units(m)
    scale = e / 2  # the byte counts are for 16-bit activations
    per_token = micro * (s / cp) * scale
    rep = tp if sequence_parallel else 1
    acts = {
        "block_in": units["block_in"] * per_token / rep,
        "norms": units["norms"] * per_token / rep,
        "qkv": units["qkv"] * per_token / tp,
        "attn_out": units["attn_out"] * per_token / tp,
        "mlp_hidden": units["mlp_hidden"] * per_token / tp,
        "attn_core": units["attn_core"] * per_token / tp,
    }
    replicated = acts["block_in"] + acts["norms"]
    split = acts["qkv"] + acts["attn_out"] + acts["mlp_hidden"]
    ew_fwd = stream_time(2 * (replicated + split), ops=12, hardware=hardware)
    ew_core_fwd = stream_time(2 * acts["attn_core"], ops=4, hardware=hardware)
    fwd = proj + core + ew_fwd + ew_core_fwd
    bwd = 2 * (proj + core) + 2 * (ew_fwd + ew_core_fwd)
    stored = {
        "none": replicated + split + acts["attn_core"],
        "selective": replicated + split,
        "full": acts["block_in"],
    }[recompute]
    ew_share = lambda name: ew_fwd * acts[name] / (replicated + split)
    by_name = {
        "norms": ew_fwd * (acts["norms"] + acts["block_in"]) / (replicated + split),
        "qkv": products["qkv"] + ew_share("qkv"),
        "attn_out": products["attn_out"] + ew_share("attn_out"),
        "mlp_hidden": products["mlp_hidden"] + ew_share("mlp_hidden"),
        "attn_core": core + ew_core_fwd,
    }
    extra = {"none": 0.0, "selective": core + ew_core_fwd, "full": fwd}[recompute]

    act_bytes = micro * (s / cp) * m.d_model * e
    tp_calls = 4 + (2 if recompute == "full" else 0)  # fwd 2, bwd 2, re-forward 2 (all-reduce or AG+RS pairs)
    tensor_comm = tp_calls * collective_time("all_reduce", act_bytes, spans["tensor"], hardware)
    kv_bytes = 2 * micro * s * m.kv_heads * hd * e / tp
    cp_calls = 2 + (1 if recompute == "full" else 0)
    context_comm = cp_calls * collective_time("all_gather", kv_bytes, spans["context"], hardware)

    params = sum(t.size / (tp if t.tensor_split else 1) for t in block_tensors(m))
    gather = collective_time("all_gather", params * e, spans["fsdp"], hardware)
    scatter = collective_time("reduce_scatter", params * 4, spans["fsdp"], hardware)
    exposed = max(0.0, 2 * gather + scatter - (fwd + bwd + extra))
    return LayerCost(
        products_s=products,
        core_s=core,
        forward_s=fwd,
        backward_s=bwd,
        recompute_s=extra,
        tensor_comm_s=tensor_comm,
        context_comm_s=context_comm,
        fsdp_gather_s=gather,
        fsdp_scatter_s=scatter,
        fsdp_exposed_s=exposed,
        stored_bytes=stored,
        activation_bytes=acts,
        recompute_by_name_s=by_name,
        params=params / fsdp,
        param_transfer_bytes=params / fsdp * e,
    )
