"""The two test tiers. ``pytest -q`` runs the fast one; ``pytest -q -m slow`` the rest: several processes,
256 or more devices, long runs, and the remainder of each sweep whose representatives run fast."""

from collections.abc import Collection, Sequence
from typing import Any

import pytest

SLOW = pytest.mark.slow


def sweep(cases: Sequence[Any], fast: Collection[int]) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize`` (a tuple for several names), each outside ``fast`` (their
    indices) in the slow tier."""
    return [
        case if i in fast else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=SLOW)
        for i, case in enumerate(cases)
    ]
