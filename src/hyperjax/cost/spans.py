"""Where a run's mesh axes lie on the machine's interconnect tiers: each stage's axes (and the composite groups
its collectives run over), and the slowest tier a hand-over between neighbouring stages crosses. Cached: a
search asks for the same few meshes thousands of times."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping

from hyperjax.config import Run
from hyperjax.cost.pipeline import boundary_span
from hyperjax.topology import AxisSpan, Hardware, axis_spans

_SPANS: dict[tuple, dict[str, AxisSpan]] = {}

GROUPS = {
    "data+context+expert": ("data", "context", "expert"),
    "data+context": ("data", "context"),
    "data+expert": ("data", "expert"),
    "fsdp+context": ("fsdp", "context"),
    "expert+tensor": ("expert", "tensor"),
}
"""Collectives over several mesh axes at once: the gradient reduction of everything but the routed experts
(every device holding a batch or sequence shard), that of the routed experts (replicated over the data
and context axes), FSDP's gathers over the context axis too (``parallel.fsdp_context``), and the all-to-all
of experts spread over the tensor axis too."""


def _spans(hardware: Hardware, axes: tuple[tuple[str, int], ...]) -> dict[str, AxisSpan]:
    # axis_spans walks every device; the planner asks for the same few meshes thousands of times
    key = (hardware.name, hardware.tiers, axes)
    if key not in _SPANS:
        _SPANS[key] = axis_spans(hardware, dict(axes), groups=GROUPS)
    return _SPANS[key]


def stage_spans(hardware: Hardware, stages: int, axes: Mapping[str, int]) -> dict[str, AxisSpan]:
    """The tiers a stage's mesh axes span when ``stages`` equal stages are consecutive blocks of devices
    (one mesh with the pipeline axis outermost)."""
    whole = _spans(hardware, (("pipeline", stages), *axes.items()))
    key = (id(whole), "inner")
    if key not in _SPANS:
        _SPANS[key] = {k: v for k, v in whole.items() if k != "pipeline"}
    return _SPANS[key]


def run_stage_spans(hw: Hardware, run: Run) -> list[dict[str, AxisSpan]]:
    """The tiers each stage's axes span: equal stages as one mesh with the pipeline axis outermost (so each
    stage is a consecutive block), unequal ones each on its own."""
    sizes = {s.devices for s in run.stages}
    if len(sizes) == 1 and len({tuple(s.axes.items()) for s in run.stages}) == 1:
        return [stage_spans(hw, len(run.stages), run.stages[0].axes)] * len(run.stages)
    return [_spans(hw, tuple(s.axes.items())) for s in run.stages]


def hand_over_span(hw: Hardware, run: Run) -> AxisSpan | None:
    """The slowest tier a hand-over between neighbouring stages crosses (``None`` for one stage)."""
    if len(run.stages) == 1:
        return None
    return _slowest_boundary(hw, tuple(s.first_device for s in run.stages))


@functools.lru_cache(maxsize=4096)
def _slowest_boundary(hw: Hardware, firsts: tuple[int, ...]) -> AxisSpan:
    order = [t.name for t in hw.tiers]
    spans = [boundary_span(hw, a, b) for a, b in itertools.pairwise(firsts)]
    return max(spans, key=lambda sp: order.index(sp.tier))
