"""Hyperjax models as Hugging Face ``config.json`` files: :func:`hf_model_type` names the type that describes a
model exactly, or refuses one no type describes (naming the part that differs), and :func:`hf_from_model`
writes its ``config.json``."""

from __future__ import annotations

from typing import Any

from hyperjax.config.hf import ARCHITECTURES
from hyperjax.config.model import ModelConfig
from hyperjax.errors import ConfigError


def hf_model_type(m: ModelConfig) -> str:
    """The Hugging Face ``model_type`` that describes ``m`` exactly: what ``transformers`` computes with the
    written ``config.json`` and weights is what hyperjax computes.

    Raises:
      ConfigError: a model no supported type describes (the part that differs is named).
    """
    if m.attention == "mla":
        return _deepseek_type(m)
    why = _unwritable(m)
    if why:
        raise ConfigError(f"no Hugging Face model_type hyperjax writes describes this model: {why}")
    gpt2 = ("layernorm", "gelu", "learned", True, True, False)
    if (m.norm, m.mlp, m.positions, m.bias, m.qkv_bias, m.qk_norm) == gpt2:
        return "gpt2"
    if m.moe is not None:
        return "qwen3_moe" if m.qk_norm else "mixtral"
    if m.qk_norm:
        return "qwen3"
    return "qwen2" if m.qkv_bias and not m.bias else "llama"


def _unwritable(m: ModelConfig) -> str | None:
    """What of multi-head model ``m`` no supported type expresses, or ``None``."""
    moe = m.moe
    if m.vision is not None or m.block != "sequential":
        return f"block={m.block}, vision={'yes' if m.vision else 'no'}"
    if m.rope_interleave:
        return "model.rope_interleave with multi-head attention (only deepseek_v3 interleaves rotary pairs)"
    if m.norm == "layernorm":
        gpt2 = (m.mlp, m.positions, m.bias, m.qkv_bias, m.qk_norm) == ("gelu", "learned", True, True, False)
        if not gpt2 or moe is not None or m.kv_heads != m.heads or m.head_dim * m.heads != m.d_model:
            return (
                "layernorm outside gpt2's parts (gelu, learned positions, biases, multi-head attention of "
                "d_model / heads, no experts)"
            )
        return None
    if (m.norm, m.mlp, m.positions) != ("rmsnorm", "swiglu", "rope"):
        return f"norm={m.norm}, mlp={m.mlp}, positions={m.positions} (llama-like types: rmsnorm, swiglu, rope)"
    if m.bias and not m.qkv_bias:
        return "model.bias without model.qkv_bias"
    if (m.qk_norm or moe is not None) and (m.bias or m.qkv_bias):
        return "biases with qk_norm or experts (Qwen3, Qwen3-MoE and Mixtral have none)"
    if moe is None:
        return None
    if moe.shared_experts or moe.router != "softmax" or moe.capacity_factor is not None:
        return "model.moe with shared experts, a sigmoid router or a capacity factor"
    if moe.balance != "aux_loss" or moe.groups != 1 or moe.routed_scaling != 1.0:
        return "model.moe with a routing bias, expert groups or routed scaling (deepseek_v3's, with attention=mla)"
    if not m.qk_norm and (not moe.normalize_top_k or moe.first_dense or moe.every != 1):
        return (
            "model.moe without qk_norm (mixtral) must renormalise its top-k weights and have experts in every "
            "layer; with qk_norm it is qwen3_moe"
        )
    return None


def _deepseek_type(m: ModelConfig) -> str:
    moe = m.moe
    why = None
    if (m.norm, m.mlp, m.positions, m.block) != ("rmsnorm", "swiglu", "rope", "sequential") or m.vision:
        why = f"norm={m.norm}, mlp={m.mlp}, positions={m.positions}, block={m.block} with attention=mla"
    elif moe is None or moe.router != "sigmoid" or moe.balance != "bias" or moe.every != 1 or moe.capacity_factor:
        why = "attention=mla without model.moe of router sigmoid, balance bias, every 1 and dropless routing"
    if why:
        raise ConfigError(f"no Hugging Face model_type hyperjax writes describes this model: {why} (deepseek_v3)")
    return "deepseek_v3"


def hf_from_model(m: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``m`` as the Hugging Face type :func:`hf_model_type` names."""
    kind = hf_model_type(m)
    if kind == "gpt2":
        return {
            "architectures": [ARCHITECTURES[kind]],
            "model_type": kind,
            "n_embd": m.d_model,
            "n_layer": m.layers,
            "n_head": m.heads,
            "n_inner": m.d_ff,
            "n_positions": m.seq_len,
            "vocab_size": m.vocab,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": m.norm_eps,
            "tie_word_embeddings": m.tie_embeddings,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
        }
    if kind == "deepseek_v3":
        return _deepseek_config(m)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.d_ff,
        "vocab_size": m.vocab,
        "max_position_embeddings": m.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_dropout": 0.0,
    }
    out.update(_rope_fields(m))
    if kind in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = m.bias
    if kind == "llama":
        out["mlp_bias"] = m.bias
    if kind == "mixtral":
        out.update(num_local_experts=m.moe.experts, num_experts_per_tok=m.moe.top_k, intermediate_size=m.moe.d_ff)
        out["sliding_window"] = None
    if kind in ("mixtral", "qwen3_moe"):
        out["router_aux_loss_coef"] = m.moe.aux_loss_weight
    if kind == "qwen3_moe":
        out.update(
            num_experts=m.moe.experts,
            num_experts_per_tok=m.moe.top_k,
            moe_intermediate_size=m.moe.d_ff,
            norm_topk_prob=m.moe.normalize_top_k,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(m.layers) if not m.is_moe(i)],
        )
    return out


def _rope_fields(m: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": m.rope_theta}
    s = m.rope_scaling
    if s is None:
        return out
    out["rope_scaling"] = {"rope_type": s.type, "factor": s.factor}
    if s.type == "llama3":
        out["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.type == "yarn":
        out["rope_scaling"].update(beta_fast=s.beta_fast, beta_slow=s.beta_slow)
        out["rope_scaling"].update({k: getattr(s, k) for k in ("mscale", "mscale_all_dim") if getattr(s, k)})
    if s.type != "linear":
        out["rope_scaling"]["original_max_position_embeddings"] = s.original_max_position
    return out


def _deepseek_config(m: ModelConfig) -> dict[str, Any]:
    moe = m.moe
    return {
        "architectures": [ARCHITECTURES["deepseek_v3"]],
        "model_type": "deepseek_v3",
        "hidden_size": m.d_model,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.heads,
        "intermediate_size": m.d_ff,
        "moe_intermediate_size": moe.d_ff,
        "vocab_size": m.vocab,
        "max_position_embeddings": m.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.head_dim,
        "qk_rope_head_dim": m.rope_head_dim,
        "v_head_dim": m.head_dim,
        "head_dim": m.rope_head_dim,
        "rope_interleave": m.rope_interleave,
        "n_routed_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts,
        "n_group": moe.groups,
        "topk_group": moe.group_top_k or moe.groups,
        "routed_scaling_factor": moe.routed_scaling,
        "norm_topk_prob": moe.normalize_top_k,
        "first_k_dense_replace": moe.first_dense,
        "num_nextn_predict_layers": 0,
        **_rope_fields(m),
    }
