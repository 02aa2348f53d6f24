"""A checkpoint records the model it holds; a reader of another model with the same tensor shapes is refused,
naming the first key that differs, while the settings of a run (sequence length, a stretched context, the
attention kernel, routing capacity, the balancing's rates) may differ and a checkpoint written before the record
existed is read as before."""

import dataclasses
from pathlib import Path

import pytest

from hyperjax import load_config
from hyperjax.errors import ConfigError
from hyperjax.train.saved_model import check_model, model_record

CONFIGS = Path(__file__).parents[2] / "configs"
QUICK = load_config(CONFIGS / "quickstart.yaml").model
MOE = load_config(CONFIGS / "moe-tiny.yaml").model


@pytest.mark.parametrize(
    ("model", "changed", "says"),
    [
        (QUICK, {"mlp": "relu"}, "model.mlp=gelu, but this config has model.mlp=relu"),
        (QUICK, {"norm_eps": 1e-6}, "model.norm_eps=1e-05, but this config has model.norm_eps=1e-06"),
        (MOE, {"rope_interleave": True}, "model.rope_interleave=false, but this config has model.rope_interleave=true"),
        (MOE, {"moe": {"routed_scaling": 2.5}}, "model.moe.routed_scaling=1.0, but this config has"),
        (MOE, {"moe": {"normalize_top_k": False}}, "model.moe.normalize_top_k=true, but this config has"),
    ],
)
def test_another_model_of_the_same_shapes_is_refused_by_the_key(model, changed, says):
    meta = {"model": model_record(model)}
    other = load_config(CONFIGS / ("moe-tiny.yaml" if model is MOE else "quickstart.yaml"), _sets(changed)).model
    with pytest.raises(ConfigError, match="a checkpoint is read only into the model it holds") as e:
        check_model(meta, other, "checkpoint 'ck/3'")
    assert says in str(e.value) and str(e.value).startswith("checkpoint 'ck/3' was written for a model with")
    check_model(meta, model, "checkpoint 'ck/3'")  # its own model reads it


def test_the_settings_of_a_run_may_differ():
    meta = {"model": model_record(MOE)}
    run = {  # a context stretched (YaRN at inference, a larger base for long-context training) included
        "seq_len": 64,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "attention_kernel": "flash",
        "moe": {"capacity_factor": 1.25, "load_imbalance": 1.5, "balance": "bias", "bias_update_rate": 0.01},
    }
    check_model(meta, load_config(CONFIGS / "moe-tiny.yaml", _sets(run)).model, "here")


def test_a_section_one_record_lacks_is_a_difference():
    record = model_record(MOE) | {"moe": None}
    with pytest.raises(ConfigError, match=r"model.moe=null, but this config has model.moe=\{"):
        check_model({"model": record}, MOE, "here")


def test_a_record_without_a_model_or_with_keys_of_another_version_is_read():
    check_model({}, QUICK, "here")  # written before checkpoints recorded their model
    record = model_record(QUICK)
    record["a_key_of_a_later_version"] = 3
    del record["mlp"]
    check_model({"model": record}, dataclasses.replace(QUICK, mlp="relu"), "here")


def _sets(changed: dict, prefix: str = "model.") -> list[str]:
    out = []
    for k, v in changed.items():
        if isinstance(v, dict) and k == "moe":
            out += _sets(v, f"{prefix}{k}.")
        elif isinstance(v, dict):
            out.append(f"{prefix}{k}={{{', '.join(f'{a}: {b}' for a, b in v.items())}}}")
        else:
            out.append(f"{prefix}{k}={str(v).lower() if isinstance(v, bool) else v}")
    return out
