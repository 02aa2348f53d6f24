"""Hugging Face ``config.json`` files as hyperjax model sections.

:func:`model_from_hf` reads the architecture of a ``config.json`` (``llama``, ``qwen2``, ``qwen3``,
``mixtral``, ``qwen3_moe``, ``deepseek_v3``, ``gpt2``) into the raw ``model:`` mapping of a run config, a
field the file leaves out read as ``transformers`` defaults it (:mod:`hyperjax.config.hf_defaults`);
:mod:`hyperjax.config.hf_export` writes the other way. A field hyperjax
cannot honour (a sliding window, a rope type it lacks, another activation) is a :class:`ConfigError` that
names the field and its value: an imported model computes what the original computes, or is refused.
Settings that only matter while training there (dropout, router jitter) are listed by :func:`training_only`,
and the import command prints them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hyperjax.config.hf_defaults import DEFAULTS
from hyperjax.errors import ConfigError

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")
"""The ``model_type`` s laid out as Llama is (RMSNorm, SwiGLU, rotary positions, separate q/k/v projections)."""

MODEL_TYPES = (*LLAMA_LIKE, "deepseek_v3", "gpt2")
"""Every ``model_type`` hyperjax imports."""

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}

ROPE_SEQ_LEN = 8192
"""``model.seq_len`` an import gives a rotary model whose ``max_position_embeddings`` is longer (a training
length, overridable with ``--set model.seq_len=N``; rotary positions have no table to size)."""

_DROPOUTS = ("attention_dropout", "attn_pdrop", "embd_pdrop", "resid_pdrop", "hidden_dropout", "summary_first_dropout")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The mapping in ``config.json`` (``path`` is the file or its folder).

    Raises:
      ConfigError: no such file, or not a JSON object.
    """
    file = config_file(path)
    if not file.is_file():
        raise ConfigError(f"{str(file)!r} does not exist; give a Hugging Face model folder or its config.json")
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"{str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(file)!r} must hold a JSON object, got {type(raw).__name__}")
    return raw


def config_file(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` names: the file, or the one in the folder."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def model_folder(path: str | Path) -> Path:
    """The folder of a model that ``path`` names: the folder, or the one holding the ``config.json`` given (its
    weights and tokenizer lie beside it); any other file as it is."""
    path = Path(path)
    return path.parent if path.name == "config.json" and path.is_file() else path


def is_hf_config(path: str | Path) -> bool:
    """Whether ``path`` names a Hugging Face ``config.json``: a folder holding one, or a ``.json`` file whose
    object names a ``model_type`` (a run config written as JSON reads as YAML, as any run config)."""
    path = Path(path)
    if path.is_dir():
        return (path / "config.json").is_file()
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except ValueError:
        return path.name == "config.json"  # read_hf_config names what is wrong with it
    return isinstance(raw, dict) and "model_type" in raw


def model_from_hf(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The raw ``model:`` section (every architectural key given) of Hugging Face config ``hf`` (its sizes
    are checked where the section is built, as any config's are).

    Raises:
      ConfigError: an unknown ``model_type``, a missing field, or a field hyperjax cannot honour (named with
        its value and, where there is one, the fix).
    """
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type={kind!r} is not one hyperjax imports; supported: {', '.join(MODEL_TYPES)}"
        )
    field = _Fields(hf, where)
    if kind == "gpt2":
        model = _gpt2(field)
    elif kind == "deepseek_v3":
        model = _deepseek(field)
    else:
        model = _llama_like(field, kind)
    field.check_all_read()
    return model


def run_section(hf: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The raw run config of a Hugging Face model: its ``model:`` section, and synthetic training data (the
    shipped corpus is byte-level; a real model's vocabulary is its tokenizer's). Every other key defaults."""
    return {"model": model_from_hf(hf, where), "train": {"data": "synthetic"}}


def training_only(hf: dict[str, Any]) -> list[str]:
    """The fields of ``hf`` that hyperjax does not apply and that leave the model's logits as they are:
    dropout and router jitter (training there), DeepSeek-V3's multi-token-prediction module (a training
    objective; its weights are not imported), as ``field=value``."""
    found = [f"{k}={hf[k]}" for k in _DROPOUTS if isinstance(hf.get(k), int | float) and hf[k]]
    for key in ("router_jitter_noise", "num_nextn_predict_layers"):
        if hf.get(key):
            found.append(f"{key}={hf[key]}")
    return found


class _Fields:
    """Reads the fields of a ``config.json``, refusing values hyperjax cannot honour, and at the end any
    field that changes the model and was not read."""

    # fields that say nothing about what the model computes
    IGNORED = frozenset(
        {
            "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
            "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "pretraining_tp",
            "output_router_logits", "router_aux_loss_coef", "_name_or_path", "tokenizer_class",
            "max_window_layers", "summary_activation", "summary_proj_to_labels", "summary_type",
            "summary_use_proj", "add_cross_attention", "task_specific_params", "n_ctx", "use_return_dict",
            "attn_implementation", "quantization_config", "router_jitter_noise", "num_nextn_predict_layers",
            "ep_size", "aux_loss_alpha", "seq_aux", "auto_map", *_DROPOUTS,
        }
    )  # fmt: skip

    def __init__(self, hf: dict[str, Any], where: str) -> None:
        self.hf, self.where, self.read = hf, where, set()

    def get(self, key: str, default: Any = ..., *, kind: type | tuple[type, ...] = int, least: int | None = 1) -> Any:
        """Field ``key``: absent, what ``transformers`` assumes for this type (else ``default``); ``null``,
        ``default``. A count (``kind`` int) must be at least ``least``.

        Raises:
          ConfigError: a missing field without a default, a wrong type, or an integer out of range.
        """
        self.read.add(key)
        if key not in self.hf:
            default = DEFAULTS.get(self.hf.get("model_type"), {}).get(key, default)
        value = self.hf.get(key)
        if value is None:
            if default is ...:
                raise ConfigError(f"{self.where}: {key} is missing; a {self.hf.get('model_type')} config gives it")
            return default
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            expected = " or ".join("an integer" if k is int else f"a {k.__name__}" for k in kinds)
            raise ConfigError(
                f"{self.where}: {key}={value!r} has the wrong type: expected {expected}, got {type(value).__name__}"
            )
        if kind is int and least is not None and value < least:  # a count; a number's range is the model's to check
            raise ConfigError(f"{self.where}: {key}={value} must be at least {least}")
        return value

    def want(self, key: str, allowed: tuple[Any, ...], why: str) -> Any:
        """Field ``key`` whose value must be one of ``allowed`` (absent: the first)."""
        self.read.add(key)
        value = self.hf.get(key, allowed[0])
        if value not in allowed:
            raise ConfigError(f"{self.where}: {key}={value!r} is not supported: {why}")
        return value

    def check_all_read(self) -> None:
        left = sorted(k for k in self.hf if k not in self.read and k not in self.IGNORED)
        changing = [k for k in left if self.hf[k] not in (None, False, [], {})]
        if changing:
            k = changing[0]
            raise ConfigError(
                f"{self.where}: {k}={self.hf[k]!r} is a field hyperjax does not know how to honour for "
                f"model_type={self.hf.get('model_type')!r}; remove it if it does not change the model"
            )


def _rope(field: _Fields) -> tuple[float, dict[str, Any] | None]:
    """``rope_theta`` and the ``rope_scaling`` section, from transformers 4's fields or 5's ``rope_parameters``."""
    params = field.get("rope_parameters", None, kind=dict)
    scaling = field.get("rope_scaling", None, kind=dict)
    theta = field.get("rope_theta", 10000.0, kind=(int, float))
    merged = {**(scaling or {}), **(params or {})}
    key = "rope_parameters" if params else "rope_scaling"
    inner = merged.pop("rope_theta", None)
    if inner is not None:  # transformers 5 keeps the base inside rope_parameters
        if isinstance(inner, bool) or not isinstance(inner, (int, float)) or not inner > 0:
            raise ConfigError(
                f"{field.where}: {key}.rope_theta={inner!r} must be a number > 0 (the rotary base frequency, "
                "10000 in most models)"
            )
        theta = inner
    theta = float(theta)
    kind = merged.pop("rope_type", merged.pop("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3", "yarn"):
        raise ConfigError(
            f"{field.where}: {key}.rope_type={kind!r} is not supported: hyperjax's rotary positions take "
            "default, linear, llama3 and yarn scaling"
        )
    names = {
        "factor": "factor",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
        "original_max_position_embeddings": "original_max_position",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
        "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim",
    }
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
    missing = [k for k in required[kind] if merged.get(k) is None]
    if missing:  # as transformers refuses it: a default here would be a guess at the model
        raise ConfigError(
            f"{field.where}: {key} of rope_type {kind!r} lacks {', '.join(missing)}, which that scaling needs "
            "(transformers refuses it too); give them as the model was trained"
        )
    out: dict[str, Any] = {"type": kind}
    for hf_key, ours in names.items():
        if merged.get(hf_key) is not None:
            out[ours] = merged.pop(hf_key)
        merged.pop(hf_key, None)
    if merged.get("truncate", True) is True:
        merged.pop("truncate", None)
    if merged.get("attention_factor") is None:
        merged.pop("attention_factor", None)
    if merged:
        k = sorted(merged)[0]
        raise ConfigError(f"{field.where}: {key}.{k}={merged[k]!r} is not supported for rope_type {kind!r}")
    if kind != "linear" and "original_max_position" not in out:  # as transformers reads a config lacking it
        out["original_max_position"] = field.get("max_position_embeddings", ROPE_SEQ_LEN)
    return theta, out


def _llama_like(field: _Fields, kind: str) -> dict[str, Any]:
    d = field.get("hidden_size")
    heads = field.get("num_attention_heads")
    layers = field.get("num_hidden_layers")
    field.want("hidden_act", ("silu",), "hyperjax's gated MLP here is SwiGLU (silu)")
    types = field.get("layer_types", None, kind=list)
    slides = kind in ("mistral", "mixtral")
    if not slides and types is None and field.get("use_sliding_window", False, kind=bool):
        # Qwen2/3 slide from layer max_window_layers on (transformers' layer_types): none below it
        slides = field.get("max_window_layers", layers, least=0) < layers
    if slides:
        window = field.get("sliding_window", None)
        if window is not None:
            raise ConfigError(
                f"{field.where}: sliding_window={window} is not supported: hyperjax's attention sees every "
                "earlier token"
            )
    field.read.update({"sliding_window", "use_sliding_window"})  # Qwen2/3 give them but switch them off
    if types is not None and any(t != "full_attention" for t in types):
        raise ConfigError(f"{field.where}: layer_types={types!r} is not supported: every layer is full attention")
    if kind == "qwen2":
        qkv_bias, bias = True, False  # Qwen2's query, key and value projections carry biases, nothing else does
    elif kind == "llama":
        bias = field.get("attention_bias", False, kind=bool)
        mlp_bias = field.get("mlp_bias", False, kind=bool)
        if bias != mlp_bias:
            raise ConfigError(
                f"{field.where}: attention_bias={bias} with mlp_bias={mlp_bias} is not supported: "
                "hyperjax's model.bias puts biases on every projection or on none"
            )
        qkv_bias = bias
    else:
        field.want("attention_bias", (False,), f"a {kind} MLP has no biases, so hyperjax's model.bias cannot match")
        qkv_bias = bias = False
    theta, scaling = _rope(field)
    positions = field.get("max_position_embeddings", ROPE_SEQ_LEN)
    model: dict[str, Any] = {
        "family": "llama",
        "layers": layers,
        "d_model": d,
        "heads": heads,
        "kv_heads": field.get("num_key_value_heads", heads),
        "head_dim": field.get("head_dim", d // heads if d % heads == 0 else None),
        "d_ff": field.get("intermediate_size"),
        "vocab": field.get("vocab_size"),
        "seq_len": min(positions, ROPE_SEQ_LEN),
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "positions": "rope",
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_embeddings": field.get("tie_word_embeddings", False, kind=bool),
        "bias": bias,
        "qkv_bias": qkv_bias,
        "qk_norm": kind in ("qwen3", "qwen3_moe"),
        "norm_eps": float(field.get("rms_norm_eps", 1e-6, kind=(int, float))),
    }
    if kind in ("mixtral", "qwen3_moe"):
        model["moe"] = _moe(field, kind, layers)
    return model


def _moe(field: _Fields, kind: str, layers: int) -> dict[str, Any]:
    named = "num_local_experts" if kind == "mixtral" else "num_experts"  # either name is read, as transformers does
    experts = field.get("num_local_experts" if "num_local_experts" in field.hf else named)
    field.read.update({"num_experts", "num_local_experts"})
    moe = {
        "experts": experts,
        "top_k": field.get("num_experts_per_tok"),
        "d_ff": field.get("intermediate_size") if kind == "mixtral" else field.get("moe_intermediate_size"),
        "router": "softmax",
        "normalize_top_k": True if kind == "mixtral" else field.get("norm_topk_prob", False, kind=bool),
        "capacity_factor": None,
        "aux_loss_weight": float(field.get("router_aux_loss_coef", 0.001, kind=(int, float))),
    }
    if kind == "qwen3_moe":
        step = field.get("decoder_sparse_step", 1)
        listed = field.get("mlp_only_layers", [], kind=list, least=None)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in listed):
            raise ConfigError(f"{field.where}: mlp_only_layers={listed!r} must list layer numbers")
        dense = set(listed)
        sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        first = sparse[0] if sparse else layers
        every = sparse[1] - sparse[0] if len(sparse) > 1 else 1
        if not sparse or sparse != [i for i in range(first, layers) if (i - first) % every == 0]:
            raise ConfigError(
                f"{field.where}: mlp_only_layers={sorted(dense)} with decoder_sparse_step={step} puts experts in "
                f"layers {sparse}; hyperjax's model.moe places them every `every` layers after `first_dense`"
            )
        moe.update(first_dense=first, every=every)
    return moe


def _deepseek(field: _Fields) -> dict[str, Any]:
    """DeepSeek-V3: latent attention, a sigmoid router with grouped top-k and routed scaling, shared experts,
    dense first layers (the multi-token-prediction module is left out: :func:`training_only` names it)."""
    d, heads = field.get("hidden_size"), field.get("num_attention_heads")
    field.want("hidden_act", ("silu",), "hyperjax's gated MLP here is SwiGLU (silu)")
    field.want("attention_bias", (False,), "latent attention here has no biases")
    field.want("scoring_func", ("sigmoid",), "DeepSeek-V3's router scores with a sigmoid")
    field.want("topk_method", ("noaux_tc",), "experts chosen by grouped top-k with a score-correction bias")
    field.want("moe_layer_freq", (1,), "every layer after first_k_dense_replace has experts")
    if field.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"{field.where}: num_key_value_heads must equal num_attention_heads={heads} for MLA")
    nope, v = field.get("qk_nope_head_dim"), field.get("v_head_dim")
    if v != nope:
        raise ConfigError(
            f"{field.where}: v_head_dim={v} differs from qk_nope_head_dim={nope}: hyperjax's latent attention "
            "gives values the keys' width"
        )
    rope_dim = field.get("qk_rope_head_dim")
    field.read.update({"head_dim", "qk_head_dim"})  # derived: the rotary width, and nope + rope
    theta, scaling = _rope(field)
    layers = field.get("num_hidden_layers")
    return {
        "family": "llama",
        "layers": layers,
        "d_model": d,
        "heads": heads,
        "kv_heads": None,
        "head_dim": nope,
        "d_ff": field.get("intermediate_size"),
        "vocab": field.get("vocab_size"),
        "seq_len": min(field.get("max_position_embeddings", ROPE_SEQ_LEN), ROPE_SEQ_LEN),
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "positions": "rope",
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_interleave": field.get("rope_interleave", True, kind=bool),
        "tie_embeddings": field.get("tie_word_embeddings", False, kind=bool),
        "bias": False,
        "qkv_bias": False,
        "qk_norm": False,
        "norm_eps": float(field.get("rms_norm_eps", 1e-6, kind=(int, float))),
        "attention": "mla",
        "kv_lora_rank": field.get("kv_lora_rank"),
        "q_lora_rank": field.get("q_lora_rank", None),
        "rope_head_dim": rope_dim,
        "moe": {
            "experts": field.get("n_routed_experts"),
            "top_k": field.get("num_experts_per_tok"),
            "shared_experts": field.get("n_shared_experts", 0, least=0),
            "d_ff": field.get("moe_intermediate_size"),
            "capacity_factor": None,
            "router": "sigmoid",
            "balance": "bias",
            "normalize_top_k": field.get("norm_topk_prob", True, kind=bool),
            "first_dense": field.get("first_k_dense_replace", 0, least=0),
            "every": 1,
            "groups": field.get("n_group", 1),
            "group_top_k": field.get("topk_group", None),
            "routed_scaling": float(field.get("routed_scaling_factor", 1.0, kind=(int, float))),
        },
    }


def _gpt2(field: _Fields) -> dict[str, Any]:
    d = field.get("n_embd")
    field.want("activation_function", ("gelu_new", "gelu_pytorch_tanh"), "hyperjax's gelu is the tanh form")
    field.want("scale_attn_weights", (True,), "attention scores are scaled by 1/sqrt(head_dim)")
    field.want("scale_attn_by_inverse_layer_idx", (False,), "no per-layer score scaling")
    field.want("reorder_and_upcast_attn", (False,), "hyperjax computes scores in float32 already")
    return {
        "family": "gpt",
        "layers": field.get("n_layer"),
        "d_model": d,
        "heads": field.get("n_head"),
        "kv_heads": None,
        "head_dim": None,
        "d_ff": field.get("n_inner", 4 * d),
        "vocab": field.get("vocab_size"),
        "seq_len": field.get("n_positions"),
        "norm": "layernorm",
        "mlp": "gelu",
        "positions": "learned",
        "tie_embeddings": field.get("tie_word_embeddings", True, kind=bool),
        "bias": True,
        "qkv_bias": True,
        "qk_norm": False,
        "norm_eps": float(field.get("layer_norm_epsilon", 1e-5, kind=(int, float))),
    }
