"""Which field of a Hugging Face ``config.json`` each imported ``model.*`` key was read from, so that a size the
model's checks refuse (``model.heads=5`` not dividing ``model.d_model=64``) is also named as the file names it
(``n_head``, ``n_embd``): the person fixes the file, or sets the key, knowing which field is at fault."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from hyperjax.errors import ConfigError

_LLAMA = {
    "layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "d_ff": "intermediate_size",
    "vocab": "vocab_size",
    "seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}
_MOE = {"moe.top_k": "num_experts_per_tok", "moe.aux_loss_weight": "router_aux_loss_coef"}

FIELDS: dict[str, dict[str, str]] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": {**_LLAMA, **_MOE, "moe.experts": "num_local_experts", "moe.d_ff": "intermediate_size"},
    "qwen3_moe": {**_LLAMA, **_MOE, "moe.experts": "num_experts", "moe.d_ff": "moe_intermediate_size"},  # or as
    # mixtral names it, which the import reads first when the file gives it
    "deepseek_v3": {
        **{k: v for k, v in _LLAMA.items() if k not in ("kv_heads", "head_dim")},
        "moe.top_k": "num_experts_per_tok",  # its balancing is a bias, not router_aux_loss_coef
        "head_dim": "qk_nope_head_dim",
        "rope_head_dim": "qk_rope_head_dim",
        "kv_lora_rank": "kv_lora_rank",
        "q_lora_rank": "q_lora_rank",
        "moe.experts": "n_routed_experts",
        "moe.shared_experts": "n_shared_experts",
        "moe.d_ff": "moe_intermediate_size",
        "moe.first_dense": "first_k_dense_replace",
        "moe.groups": "n_group",
        "moe.group_top_k": "topk_group",
    },
    "gpt2": {
        "layers": "n_layer",
        "d_model": "n_embd",
        "heads": "n_head",
        "d_ff": "n_inner",
        "vocab": "vocab_size",
        "seq_len": "n_positions",
        "norm_eps": "layer_norm_epsilon",
    },
}
"""``model.<key>`` -> the ``config.json`` field it is read from, by ``model_type`` (a key read from no one field,
such as ``seq_len`` capped for a rotary model, is named by the field it starts from)."""


def in_file(e: ConfigError, hf: dict[str, Any], where: str, sets: Sequence[str] = ()) -> ConfigError:
    """``e``, raised building the config of Hugging Face config ``hf`` (read from ``where``) with ``--set``
    items ``sets``, with the file's field named beside each ``model.*`` key it names that the file gave (a key
    a ``--set`` gave, or a field the file leaves out, is named as it is)."""
    table = FIELDS.get(hf.get("model_type"), {})
    overridden = {item.partition("=")[0].strip() for item in sets}
    named = []
    for key in dict.fromkeys(re.findall(r"\bmodel\.([a-z_]+(?:\.[a-z_]+)?)\b", str(e))):
        field, dotted = table.get(key), f"model.{key}"
        if key == "moe.experts" and field in ("num_experts", "num_local_experts") and hf.get("num_local_experts"):
            field = "num_local_experts"  # read first, under either of the types that name experts so
        if any(dotted == o or dotted.startswith(f"{o}.") for o in overridden):
            continue  # the value is the --set's, not the file's
        if field is not None and hf.get(field) is not None:  # a null field's value was derived, not read
            named.append(f"model.{key} is {field}={hf[field]!r}")
    if not named:
        return e
    return ConfigError(f"{e}; in {where}, {', '.join(named)}")
