"""A model described by its parts, counted once: its tensors, its products, its FLOPs and its activations.

Everything else reads these counts: the estimate prices the products and streams the activations, the
pipeline balancer in :func:`hyperjax.resolve` weighs layers by their FLOPs, the resolver checks every
tensor's sharding before anything compiles, and the inventories compare them with compiled programs.
The tensors listed here are exactly the NNX models' parameters (path, shape, logical axes); a test holds
the two equal for every architecture.

Conventions (Megatron's, so published runs compare directly): FLOPs count attention scores over the full
``s x s`` square; activation bytes follow Korthikanti et al. (2022), ``34 s b h + 5 a s^2 b`` per layer
for GPT in 16-bit, generalised to the parts (grouped keys and values, head width, gated MLPs, parallel
blocks) and split by name into the groups the models tag with ``checkpoint_name``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator
from typing import Literal

from hyperjax.config import Activation, ModelConfig, VisionConfig

TENSOR_SPLIT = ("heads", "kv_heads", "mlp", "vocab", "expert_mlp")
"""Logical axes of parameters that tensor parallelism splits."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: its key path in the model's state, shape and logical axes."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def tensor_split(self) -> bool:
        """Whether tensor parallelism splits it (under the standard rules)."""
        return any(a in TENSOR_SPLIT for a in self.axes)

    @property
    def expert(self) -> bool:
        """Whether it is a routed expert's weight (sharded over the expert axis)."""
        return "experts" in self.axes

    def local_size(self, *, tensor: int = 1, expert: int = 1, expert_tensor: bool = True) -> float:
        """Elements one device holds under the standard rules, before FSDP: split over ``tensor`` ranks
        where a logical axis tensor parallelism splits is present, routed experts over ``expert`` ranks.
        ``expert_tensor=False`` (``parallel.expert_tensor: 1``) spreads the experts over the tensor ranks
        instead of splitting each expert's hidden width."""
        if not self.expert:
            return self.size / (tensor if self.tensor_split else 1)
        if not expert_tensor:
            return self.size / (expert * tensor)
        return self.size / (expert * (tensor if self.tensor_split else 1))


@dataclasses.dataclass(frozen=True)
class Product:
    """A matrix product of tokens with a weight: ``(tokens x rate, k) x (k, n)``.

    ``split`` is the dimension tensor parallelism divides: ``n`` for a column split (the output's
    features), ``k`` for a row split (the contraction, whose partial sums are then reduced), ``none`` for a
    weight every tensor-parallel rank applies whole (a router, MLA's down-projections). ``rate`` is the
    rows per token: ``top_k`` for routed experts (each token visits that many), 1 otherwise. ``group`` is
    the activation it produces or reads, by the models' ``checkpoint_name`` (``qkv``, ``attn_out``,
    ``mlp_hidden``), or ``router``.
    """

    name: str
    n: int
    k: int
    split: Literal["n", "k", "none"]
    group: str
    rate: float = 1.0

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per token."""
        return 2.0 * self.n * self.k * self.rate


def norm_tensors(m: ModelConfig, d: int, prefix: str, axis: str | None = "embed") -> list[Tensor]:
    """A norm's scale, and a LayerNorm's shift when the model has biases."""
    out = [Tensor(f"{prefix}/scale", (d,), (axis,))]
    if m.norm == "layernorm" and m.bias:
        out.append(Tensor(f"{prefix}/bias", (d,), (axis,)))
    return out


def attention_tensors(m: ModelConfig, p: str) -> list[Tensor]:
    """Attention's parameters: multi-head (or grouped-query), or DeepSeek's latent attention."""
    h, a, kv, hd = m.d_model, m.heads, m.kv_heads, m.head_dim
    if m.attention == "mla":
        rd, c = m.rope_head_dim, m.kv_lora_rank
        out = []
        if m.q_lora_rank is not None:
            out += [Tensor(f"{p}attn/q_down", (h, m.q_lora_rank), ("embed", None))]
            out += norm_tensors(m, m.q_lora_rank, f"{p}attn/q_norm", None)
            out += [Tensor(f"{p}attn/q_up", (m.q_lora_rank, a, hd + rd), (None, "heads", "head_dim"))]
        else:
            out += [Tensor(f"{p}attn/q_proj", (h, a, hd + rd), ("embed", "heads", "head_dim"))]
        out += [Tensor(f"{p}attn/kv_down", (h, c + rd), ("embed", None))]
        out += norm_tensors(m, c, f"{p}attn/kv_norm", None)
        out += [
            Tensor(f"{p}attn/k_up", (c, a, hd), (None, "heads", "head_dim")),
            Tensor(f"{p}attn/v_up", (c, a, hd), (None, "heads", "head_dim")),
            Tensor(f"{p}attn/o_proj", (a, hd, h), ("heads", "head_dim", "embed")),
        ]
        return out
    out = [
        Tensor(f"{p}attn/q_proj", (h, a, hd), ("embed", "heads", "head_dim")),
        Tensor(f"{p}attn/k_proj", (h, kv, hd), ("embed", "kv_heads", "head_dim")),
        Tensor(f"{p}attn/v_proj", (h, kv, hd), ("embed", "kv_heads", "head_dim")),
        Tensor(f"{p}attn/o_proj", (a, hd, h), ("heads", "head_dim", "embed")),
    ]
    if m.qkv_bias:
        out += [
            Tensor(f"{p}attn/q_bias", (a, hd), ("heads", "head_dim")),
            Tensor(f"{p}attn/k_bias", (kv, hd), ("kv_heads", "head_dim")),
            Tensor(f"{p}attn/v_bias", (kv, hd), ("kv_heads", "head_dim")),
        ]
    if m.bias:
        out.append(Tensor(f"{p}attn/o_bias", (h,), ("embed",)))
    if m.qk_norm:
        out += norm_tensors(m, hd, f"{p}attn/q_norm", None) + norm_tensors(m, hd, f"{p}attn/k_norm", None)
    return out


def mlp_tensors(m: ModelConfig, p: str, d_ff: int) -> list[Tensor]:
    """A dense MLP's parameters (``p`` ends with its name and a slash)."""
    h = m.d_model
    out = [Tensor(f"{p}w_in", (h, d_ff), ("embed", "mlp"))]
    if m.gated:
        out.append(Tensor(f"{p}w_gate", (h, d_ff), ("embed", "mlp")))
    out.append(Tensor(f"{p}w_out", (d_ff, h), ("mlp", "embed")))
    if m.bias:
        out.append(Tensor(f"{p}b_in", (d_ff,), ("mlp",)))
        if m.gated:
            out.append(Tensor(f"{p}b_gate", (d_ff,), ("mlp",)))
        out.append(Tensor(f"{p}b_out", (h,), ("embed",)))
    return out


def moe_tensors(m: ModelConfig, p: str) -> list[Tensor]:
    """A mixture-of-experts MLP's parameters: the router (and its balancing bias), the routed experts
    stacked on a leading ``experts`` axis, and the shared experts as one dense MLP."""
    h, e, f = m.d_model, m.moe.experts, m.moe.d_ff
    out = [Tensor(f"{p}router", (h, e), ("embed", None))]
    if m.moe.balance == "bias":
        out.append(Tensor(f"{p}router_bias", (e,), (None,)))
    out.append(Tensor(f"{p}w_in", (e, h, f), ("experts", "embed", "expert_mlp")))
    if m.gated:
        out.append(Tensor(f"{p}w_gate", (e, h, f), ("experts", "embed", "expert_mlp")))
    out.append(Tensor(f"{p}w_out", (e, f, h), ("experts", "expert_mlp", "embed")))
    if m.bias:
        out.append(Tensor(f"{p}b_in", (e, f), ("experts", "expert_mlp")))
        if m.gated:
            out.append(Tensor(f"{p}b_gate", (e, f), ("experts", "expert_mlp")))
        out.append(Tensor(f"{p}b_out", (e, h), ("experts", "embed")))
    if m.moe.shared_experts:
        out += mlp_tensors(m, f"{p}shared/", m.moe.shared_experts * f)
    return out


def block_tensors(m: ModelConfig, prefix: str = "", *, moe: bool = False) -> list[Tensor]:
    """The parameters of one block (``moe``: one whose MLP is a mixture of experts), as
    :mod:`hyperjax.models` creates them."""
    h = m.d_model
    p = f"{prefix}/" if prefix else ""
    out = norm_tensors(m, h, f"{p}norm1" if m.block == "sequential" else f"{p}norm")
    out += attention_tensors(m, p)
    if m.block == "sequential":
        out += norm_tensors(m, h, f"{p}norm2")
    return out + (moe_tensors(m, f"{p}mlp/") if moe else mlp_tensors(m, f"{p}mlp/", m.d_ff))


def decoder_tensors(m: ModelConfig, prefix: str = "", layers: Iterable[int] | None = None) -> list[Tensor]:
    """Every parameter of a decoder (the embedding, ``layers`` blocks, the final norm and a separate head)."""
    p = f"{prefix}/" if prefix else ""
    out = [Tensor(f"{p}embed", (m.vocab, m.d_model), ("vocab", "embed"))]
    if m.positions == "learned":
        out.append(Tensor(f"{p}pos_embed", (m.seq_len, m.d_model), (None, "embed")))
    for i in range(m.layers) if layers is None else layers:
        out += block_tensors(m, f"{p}blocks/{i}", moe=m.is_moe(i))
    out += norm_tensors(m, m.d_model, f"{p}final_norm")
    if not m.tie_embeddings:
        out.append(Tensor(f"{p}lm_head", (m.d_model, m.vocab), ("embed", "vocab")))
    return out


def encoder_tensors(v: VisionConfig, d_out: int, prefix: str = "encoder") -> list[Tensor]:
    """Every parameter of a ViT encoder projecting to ``d_out``."""
    enc = v.as_model()
    p = f"{prefix}/" if prefix else ""
    out = [
        Tensor(f"{p}patch_embed", (v.patch_dim, v.d_model), (None, "embed")),
        Tensor(f"{p}pos_embed", (v.patches, v.d_model), (None, "embed")),
    ]
    for i in range(v.layers):
        out += block_tensors(enc, f"{p}blocks/{i}")
    out += norm_tensors(enc, v.d_model, f"{p}final_norm")
    out.append(Tensor(f"{p}project", (v.d_model, d_out), (None, "embed")))
    return out


def model_tensors(m: ModelConfig) -> list[Tensor]:
    """Every parameter of the model :func:`hyperjax.build_model` builds for ``m``."""
    if m.vision is None:
        return decoder_tensors(m)
    return encoder_tensors(m.vision, m.d_model) + decoder_tensors(m, "language_model")


def count_params(m: ModelConfig) -> int:
    """Parameters of the model (a tied embedding once)."""
    return sum(t.size for t in model_tensors(m))


def active_params(m: ModelConfig) -> float:
    """Parameters a token meets: every routed expert but its ``top_k`` left out (all of them, dense)."""
    if m.moe is None:
        return count_params(m)
    idle = (m.moe.experts - m.moe.top_k) * (3 if m.gated else 2) * m.d_model * m.moe.d_ff
    return count_params(m) - m.moe_layers * idle


def attention_products(m: ModelConfig) -> tuple[Product, ...]:
    """Attention's weight products per token. Query, key and value are one product (one GEMM on the
    concatenated weights); latent attention adds its down-projections, applied whole on every rank."""
    h, a, kv, hd = m.d_model, m.heads, m.kv_heads, m.head_dim
    out = (Product("attn_out", h, a * hd, "k", "attn_out"),)
    if m.attention == "mha":
        return (Product("qkv", (a + 2 * kv) * hd, h, "n", "qkv"), *out)
    rd, c, q = m.rope_head_dim, m.kv_lora_rank, m.q_lora_rank
    down = (Product("kv_down", c + rd + (q or 0), h, "none", "qkv"),)  # with the queries' when compressed
    query = Product("q_up", a * (hd + rd), q if q is not None else h, "n", "qkv")
    return (*down, query, Product("kv_up", 2 * a * hd, c, "n", "qkv"), *out)


def mlp_products(m: ModelConfig, d_ff: int, *, rate: float = 1.0, prefix: str = "mlp") -> tuple[Product, ...]:
    """A dense MLP's two products (a gated MLP's input and gate are one GEMM) for ``rate`` rows a token."""
    return (
        Product(f"{prefix}_in", d_ff * (2 if m.gated else 1), m.d_model, "n", "mlp_hidden", rate),
        Product(f"{prefix}_out", m.d_model, d_ff, "k", "mlp_hidden", rate),
    )


def block_products(m: ModelConfig, *, moe: bool = False) -> tuple[Product, ...]:
    """The weight products of one block per token: attention's, then the MLP's (an MoE block's: the router,
    the routed experts at ``top_k`` rows a token, and the shared experts)."""
    if not moe:
        return (*attention_products(m), *mlp_products(m, m.d_ff))
    x = m.moe
    out = [*attention_products(m), Product("router", x.experts, m.d_model, "none", "router")]
    out += mlp_products(m, x.d_ff, rate=x.top_k, prefix="experts")
    if x.shared_experts:
        out += mlp_products(m, x.shared_experts * x.d_ff, prefix="shared")
    return tuple(out)


def is_tail(m: ModelConfig, p: Product) -> bool:
    """``p`` (of :func:`block_products`) only adds into the block's output, which the block's backward pass
    does not read: the MLP's output products (a shared expert's), and in a parallel block the attention's
    output product too. A rematerialised block's re-forward drops them. Routed experts' outputs are not among
    them: the routing weights' gradient reads them."""
    if p.group == "attn_out":
        return m.block == "parallel"
    return p.group == "mlp_hidden" and p.name.endswith("_out") and not p.name.startswith("experts_")


def rebuilds(m: ModelConfig, p: Product) -> Activation | None:
    """The kept activation whose recomputation re-runs ``p`` (of :func:`block_products`) in the block's
    backward pass, or ``None`` for a :func:`is_tail` product, which no re-forward runs: the query, key and
    value products rebuild ``qkv``; a sequential block's attention output product the mid-block residual the
    ``norms`` read; the MLP's input products, the router's (its float32 scores are kept there) and the
    routed experts' (their outputs, read back home by the routing weights' gradient) ``mlp_hidden``. The cost
    model prices these seconds and the emulation's inventory counts these FLOPs."""
    if is_tail(m, p):
        return None
    return {"qkv": "qkv", "attn_out": "norms"}.get(p.group, "mlp_hidden")


def attention_flops_per_token(m: ModelConfig, seq: int | None = None) -> float:
    """Forward FLOPs of the attention core (scores and values over the full square) per token."""
    s = m.seq_len if seq is None else seq
    if m.attention == "mla":  # scores over head_dim + rope_head_dim, values over head_dim
        return 2.0 * s * m.heads * (2 * m.head_dim + m.rope_head_dim)
    return 4.0 * s * m.heads * m.head_dim


def scores_share(m: ModelConfig) -> float:
    """The scores' product's share of the attention core's FLOPs (the values' product has the rest): half,
    or with latent attention the scores over ``head_dim + rope_head_dim`` against values over ``head_dim``."""
    return 1.0 - 2.0 * m.heads * m.head_dim / (attention_flops_per_token(m) / m.seq_len)


def block_flops_per_token(m: ModelConfig, seq: int | None = None, *, moe: bool = False) -> float:
    """Training FLOPs (forward and backward, no recomputation) of one block per token of a ``seq``-long input."""
    return 3 * sum(p.flops_per_token for p in block_products(m, moe=moe)) + 3 * attention_flops_per_token(m, seq)


@functools.lru_cache(maxsize=1024)
def layer_flops_per_token(m: ModelConfig, seq: int | None = None) -> tuple[float, ...]:
    """:func:`block_flops_per_token` of every block in order (dense and MoE blocks differ)."""
    dense = block_flops_per_token(m, seq)
    sparse = block_flops_per_token(m, seq, moe=True) if m.moe is not None else dense
    return tuple(sparse if m.is_moe(i) else dense for i in range(m.layers))


def embed_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs charged to the embedding lookup per token (used to balance pipeline stages)."""
    return 6.0 * m.d_model


def head_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs of the output projection (with the loss) per token."""
    return 6.0 * m.d_model * m.vocab


def module_flops(m: ModelConfig) -> dict[str, float]:
    """Training FLOPs per sequence of each module: the ``decoder`` alone, or a vision-language model's
    ``encoder`` (over its patches, with the patch embedding and the projection) and ``language_model``
    (over image and text tokens, the head over the text)."""
    s = m.seq_len
    if m.vision is None:
        return {"decoder": s * sum(layer_flops_per_token(m)) + s * head_flops_per_token(m)}
    v = m.vision
    encoder = v.patches * (
        v.layers * block_flops_per_token(v.as_model()) + 6.0 * v.patch_dim * v.d_model + 6.0 * v.d_model * m.d_model
    )
    tokens = s + v.patches
    language = tokens * sum(layer_flops_per_token(m, tokens)) + s * head_flops_per_token(m)
    return {"encoder": encoder, "language_model": language}


def model_flops_per_sequence(m: ModelConfig) -> float:
    """Forward and backward FLOPs of one sequence, recomputation excluded (Korthikanti eq. 7 for GPT); a
    mixture of experts counts the experts a token visits (its active parameters)."""
    return sum(module_flops(m).values())


def activation_units(m: ModelConfig, *, moe: bool = False, imbalance: float = 1.0) -> dict[str, float]:
    """Bytes per token of one layer's stored activations in 16-bit, by the names the models tag.

    For GPT (``heads x head_dim = d_model``, ``d_ff = 4 d_model``, sequential blocks) these are
    Korthikanti's ``34 h`` split as block input 2, norms 8 (the norms' inputs and outputs, the mid-block
    residual and dropout masks), Q/K/V 6, the output projection's input 2, the MLP's input projection 8
    and its activation 8; the attention core's ``5 a s`` is per token too. A gated MLP keeps its input and
    gate projections (``mlp_hidden``) and their product (``mlp_act``), a parallel block has one norm and no
    mid-block residual. Latent attention keeps its latents and its wider queries and keys. An MoE block
    keeps, per routed copy of a token (``top_k``), the dispatched input and the expert's output beside the
    expert's hidden, and the router's scores in float32; ``imbalance`` scales the routed copies a device
    holds (its busiest-device load over the mean).
    """
    h, a, hd = m.d_model, m.heads, m.head_dim
    if m.attention == "mla":
        rd = m.rope_head_dim
        qkv = 2.0 * (2 * a * (hd + rd) + a * hd + m.kv_lora_rank + rd + (m.q_lora_rank or 0))
    else:
        qkv = 2.0 * (a + 2 * m.kv_heads) * hd
    inputs = 4.0 if m.gated else 2.0  # bytes per hidden unit of the input projections' outputs
    hidden, act = inputs * m.d_ff, 2.0 * m.d_ff
    if moe:
        x = m.moe
        copies = x.top_k * imbalance
        hidden = copies * (inputs * x.d_ff + 2.0 * 2 * h) + inputs * x.shared_experts * x.d_ff + 4.0 * x.experts
        act = copies * 2.0 * x.d_ff + 2.0 * x.shared_experts * x.d_ff
    return {
        "block_in": 2.0 * h,
        "norms": (8.0 if m.block == "sequential" else 4.0) * h,
        "qkv": qkv,
        "attn_out": 2.0 * a * hd,
        "mlp_hidden": hidden,
        "mlp_act": act,
        # materialized: Korthikanti's scores, softmax and dropout mask; fused: its float32 softmax statistics
        "attn_core": 5.0 * a * m.seq_len if m.attention_kernel == "materialized" else 4.0 * a,
    }


def tensors_by_axes(tensors: list[Tensor]) -> Iterator[tuple[tuple[str | None, ...], tuple[int, ...], str]]:
    """``(axes, shape, path)`` of the first tensor of each distinct (axes, shape): enough to check shardings."""
    seen: set[tuple] = set()
    for t in tensors:
        key = (t.axes, t.shape)
        if key not in seen:
            seen.add(key)
            yield t.axes, t.shape, t.path
