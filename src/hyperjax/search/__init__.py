"""The strategy search: every valid strategy for a model on N devices, resolved, priced and ranked."""

from hyperjax.search.answer import Candidate, NothingFits
from hyperjax.search.planner import plan, price
from hyperjax.search.rl import RLSearch, plan_rl
from hyperjax.search.strategies import SEARCHED, apply, candidate, divisors, strategies, submesh_strategies

__all__ = [
    "SEARCHED",
    "Candidate",
    "NothingFits",
    "RLSearch",
    "apply",
    "candidate",
    "divisors",
    "plan",
    "plan_rl",
    "price",
    "strategies",
    "submesh_strategies",
]
