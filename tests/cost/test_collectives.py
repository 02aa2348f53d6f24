import dataclasses

import pytest

from hyperjax import axis_spans, load_hardware
from hyperjax.cost import collective_time

A100 = load_hardware("dgx-a100-80g")


def span(axes, name):
    return axis_spans(A100, axes)[name]


def test_ring_on_one_tier_matches_the_textbook_formula():
    nvlink = A100.tiers[0]
    s = span({"data": 1, "tensor": 8}, "tensor")
    expected = 7 * nvlink.latency + 7 / 8 * 1e9 / nvlink.effective_bandwidth
    assert collective_time("all_gather", 1e9, s, A100) == pytest.approx(expected)
    assert collective_time("reduce_scatter", 1e9, s, A100) == pytest.approx(expected)
    assert collective_time("all_reduce", 1e9, s, A100) == pytest.approx(2 * expected)


def test_busbw_of_8_gpu_all_reduce_is_the_preset_figure():
    # nccl-tests: busbw = S / t * 2 (n - 1) / n; large messages approach bandwidth x efficiency
    s = span({"data": 1, "tensor": 8}, "tensor")
    size = 8e9
    busbw = size / collective_time("all_reduce", size, s, A100) * 2 * 7 / 8
    assert busbw == pytest.approx(A100.tiers[0].effective_bandwidth, rel=1e-3)


def test_crossing_nodes_costs_more():
    inside = collective_time("all_reduce", 1e8, span({"data": 2, "tensor": 8}, "tensor"), A100)
    across = collective_time("all_reduce", 1e8, span({"tensor": 8, "data": 2}, "tensor"), A100)
    assert across > 2 * inside


def test_a_group_with_several_ranks_per_node_crosses_the_slow_tier_with_each_ranks_own_link():
    """8 ranks, 4 on each of 2 nodes: the all-gather fetches across InfiniBand only the half its node lacks,
    each of the 4 ranks a quarter of it through its own NIC, then spreads the whole buffer over NVLink."""
    s = span({"tensor": 8, "data": 2}, "tensor")
    assert s.levels == (("nvlink", 4), ("infiniband", 2))
    nvlink, ib = A100.tiers
    outer_first = ib.latency + 1 / 2 * 1e9 / 4 / ib.effective_bandwidth
    outer_first += 3 * nvlink.latency + 3 / 4 * 1e9 / nvlink.effective_bandwidth
    assert collective_time("all_gather", 1e9, s, A100) == pytest.approx(outer_first)


def test_hierarchical_is_cheaper_than_a_flat_ring_over_the_slow_tier():
    s = span({"data": 32}, "data")  # 4 nodes x 8
    assert s.levels == (("nvlink", 8), ("infiniband", 4))
    ib = A100.tiers[1]
    flat = 31 / 32 * 1e9 / ib.effective_bandwidth
    assert collective_time("all_gather", 1e9, s, A100) < flat


def test_trivial_and_all_to_all():
    one = span({"data": 8, "tensor": 1}, "tensor")
    assert collective_time("all_reduce", 1e9, one, A100) == 0.0
    s = span({"data": 1, "tensor": 8}, "tensor")
    a2a = collective_time("all_to_all", 1e9, s, A100)
    assert a2a == pytest.approx(7 * A100.tiers[0].latency + 7 / 8 * 1e9 / A100.tiers[0].effective_bandwidth)


def test_a_group_over_several_torus_dimensions_uses_all_of_them():
    v5p, v5e = load_hardware("tpu-v5p"), load_hardware("tpu-v5e")
    assert v5p.tiers[0].torus_for(64) == ((4, True), (4, True), (4, True))
    assert v5p.tiers[0].torus_for(16) == ((2, False), (2, False), (4, False))  # no whole 4x4x4 cube: lines
    assert v5e.tiers[0].torus_for(256) == ((16, True), (16, True))
    assert v5e.tiers[0].torus_for(64) == ((8, False), (8, False)) and v5e.tiers[0].torus_for(96) is None
    assert v5e.tiers[0].torus_for(128) == ((8, False), (16, True))  # a full 16-chip axis wraps on its own
    two = axis_spans(v5p, {"data": 4, "tensor": 16})
    assert two["tensor"].torus == ((4, True), (4, True)) and two["data"].torus == ((4, True),)
    flat = dataclasses.replace(v5p, tiers=(dataclasses.replace(v5p.tiers[0], torus_dims=None), *v5p.tiers[1:]))
    ici = v5p.tiers[0]
    one_ring = collective_time("all_gather", 1e9, two["tensor"], flat)
    assert one_ring == pytest.approx(15 * ici.latency + 15 / 16 * 1e9 / ici.effective_bandwidth)
    both = collective_time("all_gather", 1e9, two["tensor"], v5p)  # two rings at once, 3 + 3 hops
    assert both == pytest.approx(6 * ici.latency + 15 / 16 * 1e9 / (2 * ici.effective_bandwidth))
    line = axis_spans(v5e, {"data": 8, "fsdp": 8})["fsdp"]  # 8 of an 8 x 8 slice: no wraparound
    assert line.torus == ((8, False),)
    assert collective_time("all_gather", 1e9, line, v5e) == pytest.approx(
        7 * v5e.tiers[0].latency + 7 / 8 * 1e9 / (0.5 * v5e.tiers[0].effective_bandwidth)
    )
