"""Small randomly initialised Hugging Face models, one per architecture hyperjax imports, written by
``transformers``' own ``save_pretrained`` (no hub is reachable)."""

from pathlib import Path
from typing import Any

VOCAB = 64

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                              "num_key_value_heads": 2}),
    "llama3-scaled": ("LlamaConfig", {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "rope_scaling": {
                                          "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                          "rope_theta": 500000.0}}),
    "qwen2": ("Qwen2Config", {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                              "num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 16}),
    "mixtral": ("MixtralConfig", {"hidden_size": 32, "intermediate_size": 24, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                     "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                                     "norm_topk_prob": True}),
    "deepseek_v3": ("DeepseekV3Config", {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                                         "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                                         "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                                         "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 8,
                                         "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                         "n_shared_experts": 1, "num_nextn_predict_layers": 0}),
    "deepseek_v3-yarn": ("DeepseekV3Config", {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                                              "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
                                              "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                                              "first_k_dense_replace": 0, "q_lora_rank": None, "kv_lora_rank": 8,
                                              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                              "n_shared_experts": 2, "num_nextn_predict_layers": 0,
                                              "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                                                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                               "original_max_position_embeddings": 16,
                                                               "rope_theta": 10000.0}}),
    "qwen3-yarn": ("Qwen3Config", {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "head_dim": 16,
                                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_head": 4, "n_positions": 64, "attn_pdrop": 0.0,
                            "embd_pdrop": 0.0, "resid_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
}  # fmt: skip
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")


def make(arch: str, folder: Path, *, seed: int = 0) -> Any:
    """A 2-layer ``arch`` model with every weight random (norms near 1), saved in ``folder``; returns it."""
    import torch
    import transformers

    name, kwargs = ARCHS[arch]
    layers = {"n_layer": 2} if arch == "gpt2" else {"num_hidden_layers": 2}
    config = getattr(transformers, name)(vocab_size=VOCAB, **layers, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or ".ln_" in key:
                p.copy_(1 + 0.1 * torch.randn_like(p) if key.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def greedy(model: Any, ids: list[int], new: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: ``new`` tokens, no end-of-sequence stop."""
    import torch

    out = model.generate(
        torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def logits(model: Any, tokens: Any) -> Any:
    """transformers' float32 logits of ``tokens`` ``(batch, seq)``, as NumPy."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()
