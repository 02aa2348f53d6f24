"""One cost model: predicted step time, memory and communication of a resolved run on real hardware."""

from hyperjax.cost.collectives import KINDS, collective_time
from hyperjax.cost.compute import gemm_time, stream_time
from hyperjax.cost.counts import count_params, model_flops_per_sequence, model_tensors
from hyperjax.cost.estimate import Estimate, estimate
from hyperjax.cost.layer import LayerCost
from hyperjax.cost.stage import ChunkCost, PartCost, StageCost
from hyperjax.cost.trace import simulate, stage_metadata, task_events, write_trace

__all__ = [
    "KINDS",
    "ChunkCost",
    "Estimate",
    "LayerCost",
    "PartCost",
    "StageCost",
    "collective_time",
    "count_params",
    "estimate",
    "gemm_time",
    "model_flops_per_sequence",
    "model_tensors",
    "simulate",
    "stage_metadata",
    "stream_time",
    "task_events",
    "write_trace",
]
