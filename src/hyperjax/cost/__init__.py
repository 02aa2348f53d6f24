"""One cost model: predicted step time, memory and communication of a resolved run on real hardware."""

from hyperjax.cost.attention import core_time
from hyperjax.cost.collectives import KINDS, collective_time
from hyperjax.cost.compute import gemm_time, grouped_gemm_time, stream_time
from hyperjax.cost.counts import count_params, model_flops_per_sequence, model_tensors
from hyperjax.cost.estimate import MEMORY_TERMS, Estimate, estimate, memory_budget
from hyperjax.cost.inference import InferenceEstimate, ServeLayer, estimate_inference
from hyperjax.cost.layer import price_layer
from hyperjax.cost.layer_cost import LayerCost
from hyperjax.cost.memory import (
    grad_bytes,
    optimizer_bytes,
    replica_axes,
    shard_weight_bytes,
    sharding_axes,
    sharding_spans,
    stage_memory,
    state_bytes,
    zero_share,
)
from hyperjax.cost.parts import chunk_starts
from hyperjax.cost.rl import RLEstimate, estimate_rl
from hyperjax.cost.spans import stage_spans
from hyperjax.cost.stage import ChunkCost, PartCost, StageCore, StageCost
from hyperjax.cost.trace import check_traceable, simulate, stage_metadata, task_events, write_trace
from hyperjax.cost.unpriced import unpriced_overrides

__all__ = [
    "KINDS",
    "MEMORY_TERMS",
    "ChunkCost",
    "Estimate",
    "InferenceEstimate",
    "LayerCost",
    "PartCost",
    "RLEstimate",
    "ServeLayer",
    "StageCore",
    "StageCost",
    "check_traceable",
    "chunk_starts",
    "collective_time",
    "core_time",
    "count_params",
    "estimate",
    "estimate_inference",
    "estimate_rl",
    "gemm_time",
    "grad_bytes",
    "grouped_gemm_time",
    "memory_budget",
    "model_flops_per_sequence",
    "model_tensors",
    "optimizer_bytes",
    "price_layer",
    "replica_axes",
    "shard_weight_bytes",
    "sharding_axes",
    "sharding_spans",
    "simulate",
    "stage_memory",
    "stage_metadata",
    "stage_spans",
    "state_bytes",
    "stream_time",
    "task_events",
    "unpriced_overrides",
    "write_trace",
    "zero_share",
]
