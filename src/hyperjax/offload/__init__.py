"""HyperOffload: cost-based placement of parameters, optimizer state, gradients and activations."""

from hyperjax.offload.placement import ACTIVATIONS, OPTIONS, Placement, from_patterns, from_recompute, group_names
from hyperjax.offload.solve import Priced, Problem, brute_force, build_problem, evaluate, greedy, solve_exact

__all__ = [
    "ACTIVATIONS",
    "OPTIONS",
    "Placement",
    "Priced",
    "Problem",
    "brute_force",
    "build_problem",
    "evaluate",
    "from_patterns",
    "from_recompute",
    "greedy",
    "group_names",
    "solve_exact",
]
