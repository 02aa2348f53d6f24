"""HyperShard: declarative parallel strategies over logical axis names."""

from hyperjax.shard.constrainer import Constrainer
from hyperjax.shard.explanation import Explanation, TensorPlacement
from hyperjax.shard.presets import LOGICAL_AXES, MESH_AXES, check_overrides, mesh_axes_for, strategy_for
from hyperjax.shard.strategy import Strategy, place

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "Constrainer",
    "Explanation",
    "Strategy",
    "TensorPlacement",
    "check_overrides",
    "mesh_axes_for",
    "place",
    "strategy_for",
]
