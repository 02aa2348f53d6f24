"""HyperShard: declarative parallel strategies over logical axis names."""

from hyperjax.shard.explanation import Explanation, TensorPlacement
from hyperjax.shard.presets import MESH_AXES, mesh_axes_for, strategy_for
from hyperjax.shard.strategy import Strategy, place

__all__ = [
    "MESH_AXES",
    "Explanation",
    "Strategy",
    "TensorPlacement",
    "mesh_axes_for",
    "place",
    "strategy_for",
]
