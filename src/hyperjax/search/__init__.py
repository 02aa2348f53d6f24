"""The strategy search: every valid strategy for a model on N devices, resolved, priced and ranked."""

from hyperjax.search.planner import Candidate, NothingFits, plan, price
from hyperjax.search.strategies import apply, candidate, divisors, strategies, submesh_strategies

__all__ = [
    "Candidate",
    "NothingFits",
    "apply",
    "candidate",
    "divisors",
    "plan",
    "price",
    "strategies",
    "submesh_strategies",
]
