"""What one block costs, one micro-batch on one device (:func:`hyperjax.cost.layer.price_layer` prices it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One block, one micro-batch, one device.

    Attributes:
      products_s: the weight products by the activation group they produce (``qkv``, ``attn_out``,
        ``mlp_hidden``: the MLP's two or three matrices, or a mixture of experts' router, routed and shared
        experts).
      core_s: the attention core's two batched products.
      forward_s: the forward pass (products, core, element-wise work).
      backward_s: the backward pass (twice the forward).
      recompute_s: what ``recompute`` adds to the backward.
      tensor_comm_s: tensor-parallel collectives of forward, backward and recomputation.
      context_comm_s: context-parallel key/value gathers (or a ring's transfers), what waits of them in forward,
        backward and recomputation.
      context_forward_s: what waits of them in one forward.
      expert_comm_s: a mixture of experts' dispatch and combine all-to-alls of forward, backward and
        recomputation (0 for a dense block).
      exchange_s: one of those all-to-alls (a dispatch, or a combine).
      fsdp_gather_s: one all-gather of the layer's parameters over the fsdp axis.
      fsdp_scatter_s: one reduce-scatter of its gradients.
      fsdp_exposed_s: what two gathers and a scatter add beyond the layer's compute.
      stored_bytes: activations kept for the backward under ``recompute``.
      activation_bytes: the activations kept without recomputation, by name (``block_in`` included).
      recompute_by_name_s: recomputing each named activation: the forward ops that produce or read it.
      recompute_keeps_bytes: what of a named activation a selective recomputation of it still keeps (a
        PyTorch checkpoint's input: the norms' inputs under ``reforward: whole``); absent names keep nothing.
      params: the layer's parameters held by one device.
      expert_params: those of them that are routed experts' (their gradients are reduced over the data
        axes but not the expert axis, which holds other experts).
      param_transfer_bytes: one copy of those parameters in the compute dtype (what a host fetch moves).
      fp8_products_s: the FP8 products of forward and backward (0 without ``train.fp8``).
      cast_s: the casts to FP8 of activations and gradients, forward and backward (in ``forward_s`` and
        ``backward_s``).
      weight_cast_s: casting the layer's weights to FP8, once per step.
      fp8_weights: elements of the layer's FP8 weights on one device before FSDP.
      largest_param: the layer's largest tensor on one device before FSDP (what FSDP gathers at once
        when its unit is one tensor).
    """

    products_s: Mapping[str, float]
    core_s: float
    forward_s: float
    backward_s: float
    recompute_s: float
    tensor_comm_s: float
    context_comm_s: float
    context_forward_s: float
    fsdp_gather_s: float
    fsdp_scatter_s: float
    fsdp_exposed_s: float
    stored_bytes: float
    activation_bytes: Mapping[str, float]
    recompute_by_name_s: Mapping[str, float]
    params: float
    param_transfer_bytes: float
    expert_comm_s: float = 0.0
    exchange_s: float = 0.0
    expert_params: float = 0.0
    largest_param: float = 0.0
    fp8_products_s: float = 0.0
    cast_s: float = 0.0
    weight_cast_s: float = 0.0
    fp8_weights: float = 0.0
    recompute_keeps_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def weight_s(self) -> float:
        """The weight-gradient GEMMs alone (a split backward's ``W``): as many FLOPs as the products."""
        return sum(self.products_s.values())

    @property
    def on_path_comm_s(self) -> float:
        """The communication the block's compute waits for: tensor, context, expert and exposed FSDP."""
        return self.tensor_comm_s + self.context_comm_s + self.expert_comm_s + self.fsdp_exposed_s
