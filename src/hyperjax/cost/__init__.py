"""One cost model: predicted step time, memory and communication of a training step on real hardware."""

from hyperjax.cost.collectives import KINDS, collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.cost.estimate import Estimate, count_params, estimate, model_flops_per_step, predict_axes

__all__ = [
    "KINDS",
    "Estimate",
    "collective_time",
    "count_params",
    "estimate",
    "gemm_time",
    "model_flops_per_step",
    "predict_axes",
    "stream_time",
]
