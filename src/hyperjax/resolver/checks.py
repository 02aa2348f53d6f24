"""Every tensor and activation of a run checked against its stage's mesh before anything compiles.

The tensors are the model's parameters as :mod:`hyperjax.cost.counts` lists them (exactly the NNX
models' own, path, shape and logical axes), so a dimension that a degree cannot split fails here, in
``predict``, ``plan`` and ``train`` alike, naming the tensor path, the logical axis, the sizes and the fix.
"""

from __future__ import annotations

import jax

from hyperjax.config import ModelConfig, Stage
from hyperjax.cost.counts import Tensor, decoder_tensors, encoder_tensors, tensors_by_axes
from hyperjax.errors import ShardingError
from hyperjax.shard import Strategy


def stage_tensors(m: ModelConfig, stage: Stage) -> list[Tensor]:
    """The parameters a stage holds (one block stands for all: they share shapes)."""
    out: list[Tensor] = []
    if "encoder" in stage.modules:
        out += encoder_tensors(m.vision, m.d_model)
    if "language_model" in stage.modules:
        out += decoder_tensors(m, "language_model", range(1))
    if "decoder" in stage.modules:
        out += decoder_tensors(m, "", range(1))
    return out


def activations(m: ModelConfig, stage: Stage, rows: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """The activations of one micro-batch of ``rows`` sequences on ``stage``, with their logical axes."""
    acts: dict[str, tuple[tuple[int, ...], tuple]] = {}
    if "encoder" in stage.modules:
        v = m.vision
        acts["encoder residual"] = ((rows, v.patches, v.d_model), ("batch", "res_seq", "act_embed"))
    if {"decoder", "language_model"} & set(stage.modules):
        s = m.seq_len + (m.vision.patches if m.vision is not None else 0)
        acts |= {
            "tokens": ((rows, m.seq_len), ("batch", "seq")),
            "residual": ((rows, s, m.d_model), ("batch", "res_seq", "act_embed")),
            "queries": ((rows, s, m.heads, m.head_dim), ("batch", "seq", "act_heads", None)),
            "keys": ((rows, s, m.kv_heads, m.head_dim), ("batch", None, "act_kv_heads", None)),
            "mlp_hidden": ((rows, s, m.d_ff), ("batch", "seq", "act_mlp")),
            "logits": ((rows, m.seq_len, m.vocab), ("batch", "seq", "act_vocab")),
        }
    return acts


def check_stage(m: ModelConfig, strategy: Strategy, stage: Stage, rows: int) -> None:
    """``strategy`` places every parameter of ``stage`` and every activation of a micro-batch on its mesh.

    Raises:
      ShardingError: the first tensor it cannot place.
    """
    mesh = jax.sharding.AbstractMesh(tuple(stage.axes.values()), tuple(stage.axes))
    for axes, shape, path in tensors_by_axes(stage_tensors(m, stage)):
        strategy.check(path, shape, axes, mesh)
    for name, (shape, logical) in activations(m, stage, rows).items():
        try:
            strategy.check(f"activation {name}", shape, logical, mesh)
        except ShardingError as e:
            raise ShardingError(f"{e} (batch per micro-batch {rows}, model.seq_len={m.seq_len})") from None
