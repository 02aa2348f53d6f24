"""HyperOffload: cost-based placement of parameters, optimizer state, gradients and activations."""

from hyperjax.offload.apply import block_policies
from hyperjax.offload.passes import OffloadResult, budget_bytes, offload_pass, with_offload
from hyperjax.offload.placement import OPTIONS, Placement, from_patterns, from_recompute, group_names
from hyperjax.offload.problem import Priced, Problem, build_problem, evaluate
from hyperjax.offload.serving import (
    Longest,
    ServingPlacement,
    longest_context,
    per_token_curve,
    serve_problem,
    serving_pass,
    with_serving,
)
from hyperjax.offload.solve import brute_force, greedy, solve_exact

__all__ = [
    "OPTIONS",
    "Longest",
    "OffloadResult",
    "Placement",
    "Priced",
    "Problem",
    "ServingPlacement",
    "block_policies",
    "brute_force",
    "budget_bytes",
    "build_problem",
    "evaluate",
    "from_patterns",
    "from_recompute",
    "greedy",
    "group_names",
    "longest_context",
    "offload_pass",
    "per_token_curve",
    "serve_problem",
    "serving_pass",
    "solve_exact",
    "with_offload",
    "with_serving",
]
