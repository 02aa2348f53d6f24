"""Closed forms of a schedule's idle time equal the replayed grid wherever they answer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperjax.mpmd import make_schedule
from hyperjax.mpmd.timing import closed_form_idle, replay, task_seconds

lengths = st.floats(0.05, 5.0, allow_nan=False)


def replayed_idle(name: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    sched = make_schedule(name, p, m, v)
    seconds = task_seconds(sched, f, b, w if sched.split_backward else 0.0)
    end = max(e for _, _, e in replay(sched, seconds).values())
    return end - sum(seconds.values()) / p


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zero-bubble"]),
    p=st.integers(1, 10),
    m=st.integers(1, 24),
    v=st.integers(2, 4),
    f=lengths,
    b=lengths,
    w=lengths,
)
def test_closed_forms_equal_the_replay(name, p, m, v, f, b, w):
    if name == "interleaved":
        m = max(1, m // p) * p  # the interleaved schedule takes micro-batches in groups of p
    else:
        v = 1
    if name != "zero-bubble":
        w = 0.0
    idle = closed_form_idle(name, p, m, f, b, w)
    if idle is None:  # only zero-bubble with a weight-gradient task longer than F or B has none
        assert name == "zero-bubble" and w > min(f, b)
        return
    assert idle == pytest.approx(replayed_idle(name, p, m, v, f, b, w), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(("p", "m"), [(4, 2), (4, 4), (4, 8), (8, 3)])
def test_zero_bubble_fills_with_the_weight_gradients_it_has(p, m):
    # fewer micro-batches than stages: only m - 1 deferred W tasks fill the cool-down
    f, b, w = 1.0, 1.0, 0.5
    assert closed_form_idle("zero-bubble", p, m, f, b, w) == pytest.approx((p - 1) * (f + b) - min(m - 1, p - 1) * w)
    assert closed_form_idle("zero-bubble", p, m, f, b, 1.5) is None  # W longer than F and B: replayed
