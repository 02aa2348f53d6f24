"""HyperShard: declarative parallel strategies over logical axis names."""

from hyperjax.shard.presets import MESH_AXES, mesh_axes_for, strategy_for
from hyperjax.shard.strategy import Explanation, Strategy, TensorPlacement, key_path_str, place

__all__ = [
    "MESH_AXES",
    "Explanation",
    "Strategy",
    "TensorPlacement",
    "key_path_str",
    "mesh_axes_for",
    "place",
    "strategy_for",
]
