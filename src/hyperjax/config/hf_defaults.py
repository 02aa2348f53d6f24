"""What ``transformers`` (5.24) assumes for a field a ``config.json`` leaves out, per ``model_type``: an
import reads a missing field as the model ``from_pretrained`` builds would have it, so a published config
that relies on a default imports as the model it describes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_QWEN = {
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "llama": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "mixtral": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "router_aux_loss_coef": 0.001,
    },
    "qwen3_moe": {
        **_QWEN,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "attention_bias": False,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "router_aux_loss_coef": 0.001,
    },
    "deepseek_v3": {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_experts_per_tok": 8,
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "rope_interleave": True,
    },
    "gpt2": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    },
}
"""Per ``model_type``, the default of each field an import reads (the config classes' own)."""
