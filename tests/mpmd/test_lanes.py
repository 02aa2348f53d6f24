"""Overlap schedules as data: the lanes of a mixture of experts' exchanges, their checks and their replay,
and the 1F1B and interleaved grids whose forwards and backwards run in pairs (``fb-pair``)."""

import dataclasses

import pytest

from hyperjax.errors import ConfigError
from hyperjax.mpmd.lanes import LaneTask, lane_schedule, lane_timing, replay_lanes, validate_lanes
from hyperjax.mpmd.schedules import ScheduleError, dependencies, make_schedule, validate

CASES = [("none", ("F",)), ("none", ("B",)), ("two-microbatch", ("F", "F")), ("two-microbatch", ("B", "B"))]
CASES += [("fb-pair", ("F", "B"))]


@pytest.mark.parametrize(("overlap", "kinds"), CASES)
@pytest.mark.parametrize("layers", [1, 3])
def test_every_shipped_lane_schedule_is_valid(overlap, kinds, layers):
    sched = lane_schedule(overlap, layers, kinds)
    validate_lanes(sched)
    assert {t for c in sched.chains for t in c} == set(sched.compute) | set(sched.comm)
    assert len(sched.comm) == 2 * layers * len(kinds)  # a dispatch and a combine per layer and pass
    assert bool(sched.hides) == (overlap != "none")


def _lengths(sched, compute: float, comm: float) -> dict[LaneTask, float]:
    """Every task at ``compute`` or ``comm``; the passes' outputs (outside the MoE layers) at 0, as priced."""
    out = {t: (compute if t.lane == "compute" else comm) for c in sched.chains for t in c}
    return out | {t: 0.0 for t in out if t.name.startswith("output")}


def test_without_overlap_every_exchange_is_exposed():
    sched = lane_schedule("none", 4, ("F",))
    t = lane_timing(sched, _lengths(sched, 1.0, 0.5), share=0.2)
    assert t.exchange_s == pytest.approx(8 * 0.5)
    assert t.exposed_s == pytest.approx(t.exchange_s)
    assert t.slowdown_s == 0


def test_two_halves_hide_exchanges_shorter_than_the_other_halfs_compute():
    sched = lane_schedule("two-microbatch", 4, ("F", "F"))
    t = lane_timing(sched, _lengths(sched, 1.0, 0.5), share=0.0)
    # only the last half's last combine has no compute beside it
    assert t.exposed_s == pytest.approx(0.5)
    longer = lane_timing(sched, _lengths(sched, 1.0, 3.0), share=0.0)  # exchange-bound: it shows through
    assert longer.exposed_s > longer.exchange_s / 2


def test_compute_beside_an_exchange_slows_by_the_share_it_loses():
    sched = lane_schedule("two-microbatch", 1, ("F", "F"))
    x, c = sched.comm[0], sched.hides[sched.comm[0]]
    seconds = _lengths(sched, 1.0, 1.0)
    times = replay_lanes(sched, seconds, share=0.2)
    assert times[c][1] - times[c][0] == pytest.approx(min(1.0 / 0.8, 1.0 + 0.2 * seconds[x]))
    seconds[x] = 10.0  # a long exchange: the compute runs at 80 % throughout
    times = replay_lanes(sched, seconds, share=0.2)
    assert times[c][1] - times[c][0] == pytest.approx(1.0 / 0.8)


def test_a_pair_hides_part_of_both_passes_exchanges():
    sched = lane_schedule("fb-pair", 2, ("F", "B"))
    seconds = {t: v * (2 if t.stream == 1 else 1) for t, v in _lengths(sched, 1.0, 0.4).items()}
    pair = lane_timing(sched, seconds, share=0.0)
    alone = sum(seconds.values())
    assert 0 < pair.exposed_s < pair.exchange_s
    assert pair.end_s < alone


@pytest.mark.parametrize("counts", [(0, 2), (2, 0), (1, 3), (3, 1), (2, 3)])
def test_a_pair_of_chunks_of_different_depths_hides_what_runs_together(counts):
    sched = lane_schedule("fb-pair", counts, ("F", "B"))
    validate_lanes(sched)  # every hidden exchange runs beside the compute it hides behind
    assert len(sched.comm) == 2 * sum(counts)
    together = 2 * min(counts)  # the shorter pass's exchanges and as many of the longer's can hide
    assert 2 * together - 1 <= len(sched.hides) <= 2 * together + 1
    assert bool(sched.hides) == (min(counts) > 0)  # a pass through no MoE layer hides nothing
    # once the shorter pass has ended the longer runs alone: its remaining exchanges are exposed in full
    alone = lane_timing(sched, _lengths(sched, 1.0, 0.5), share=0.0)
    assert alone.exposed_s >= 0.5 * (2 * (max(counts) - min(counts)) - 1)
    assert lane_schedule("fb-pair", (2, 2), ("F", "B")) == lane_schedule("fb-pair", 2, ("F", "B"))
    with pytest.raises(ScheduleError, match="layer counts"):
        lane_schedule("two-microbatch", (1, 2), ("F", "F"))


def _broken(**changes):
    return dataclasses.replace(lane_schedule("two-microbatch", 2, ("F", "F")), **changes)


def test_the_lane_validator_names_what_is_wrong():
    good = lane_schedule("two-microbatch", 2, ("F", "F"))
    x = good.comm[0]
    with pytest.raises(ScheduleError, match="is a comm task on the compute lane"):
        validate_lanes(_broken(compute=(x, *good.compute)))
    with pytest.raises(ScheduleError, match="runs twice"):
        validate_lanes(_broken(comm=(x, *good.comm)))
    with pytest.raises(ScheduleError, match="never runs"):
        validate_lanes(_broken(comm=good.comm[:-1]))
    with pytest.raises(ScheduleError, match="out of its order"):
        validate_lanes(_broken(comm=(good.comm[2], good.comm[1], good.comm[0], *good.comm[3:])))
    with pytest.raises(ScheduleError, match="belongs to no stream"):
        validate_lanes(_broken(comm=(*good.comm, LaneTask(5, 1, "comm", "dispatch 0"))))
    own = good.compute[0]  # a half's exchange cannot hide behind its own half's compute
    with pytest.raises(ScheduleError, match="another stream"):
        validate_lanes(_broken(hides={x: own}))
    late = good.compute[-1]  # nor behind compute that runs long after it
    with pytest.raises(ScheduleError, match="never run together"):
        validate_lanes(_broken(hides={x: late}))


def test_lanes_that_wait_on_each_other_are_refused():
    good = lane_schedule("two-microbatch", 1, ("F", "F"))
    a, b = good.chains
    # the compute lane runs half b's experts before half a's, but b's exchange waits behind a's on its lane
    # ... and a's waits for a's attention, which the compute lane puts after b's experts
    compute = (b[0], b[2], a[0], a[2], a[4], b[4])
    comm = (a[1], a[3], b[1], b[3])
    with pytest.raises(ScheduleError, match="wait on each other forever"):
        validate_lanes(dataclasses.replace(good, compute=compute, comm=comm, hides={}))


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 4), (3, 3), (4, 8), (5, 7), (8, 16)])
def test_paired_1f1b_grids_are_valid_and_as_long_as_1f1b(stages, microbatches):
    paired = make_schedule("1f1b", stages, microbatches, pair=True)
    plain = make_schedule("1f1b", stages, microbatches)
    validate(paired)
    assert paired.slots == plain.slots
    chunks = paired.chunks
    for f, b in paired.pairs:
        assert f.kind == "F" and b.kind == "B" and f.chunk == b.chunk and f.microbatch != b.microbatch
        assert f not in dependencies(b, chunks, False)
    # every stage pairs each forward after its warm-up of 2(stages - s) - 1 with a backward, the last too
    for s in range(stages):
        assert sum(f.chunk == s for f, _ in paired.pairs) == max(0, microbatches - (2 * (stages - s) - 1))
    assert_pairs_run_as_one_program(paired)


def assert_pairs_run_as_one_program(paired) -> None:
    """A pair is one program: both tasks' inputs are ready when it starts, its forward's output only when it
    ends."""
    chunks, span = paired.chunks, {}
    for row in paired.grid:
        for t, cell in enumerate(row):
            if cell is not None:
                span[cell] = (span.get(cell, (t, t))[0], t + 1)
    for f, b in paired.pairs:
        inputs = [d for d in dependencies(f, chunks, False) + dependencies(b, chunks, False) if d != f]
        assert all(span[d][1] <= span[f][0] for d in inputs), (f, b)
        users = [t for t in span if f in dependencies(t, chunks, False) and t != b]
        assert all(span[u][0] >= span[b][1] for u in users), (f, b)


@pytest.mark.parametrize(
    ("stages", "microbatches", "virtual"), [(2, 4, 2), (2, 8, 3), (3, 6, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)]
)
def test_paired_interleaved_grids_pair_chunks_of_a_stage_and_are_as_long_as_interleaved(stages, microbatches, virtual):
    paired = make_schedule("interleaved", stages, microbatches, virtual, pair=True)
    plain = make_schedule("interleaved", stages, microbatches, virtual)
    validate(paired)
    assert paired.slots == plain.slots  # at nominal lengths pairing costs the grid nothing
    for f, b in paired.pairs:
        assert f.kind == "F" and b.kind == "B" and f.microbatch != b.microbatch
        assert f.chunk % stages == b.chunk % stages  # one stage's chunks
    assert any(f.chunk != b.chunk for f, b in paired.pairs)  # pairs across the stage's chunks
    # Megatron's interleaved warm-up, 2(p - s - 1) + (v - 1) p forwards, and one more; then every forward pairs
    for s in range(stages):
        warm = 2 * (stages - s - 1) + (virtual - 1) * stages + 1
        assert sum(f.chunk % stages == s for f, _ in paired.pairs) == microbatches * virtual - warm
    assert_pairs_run_as_one_program(paired)


def test_pairs_only_on_1f1b_and_interleaved_and_the_validator_checks_them():
    with pytest.raises(ConfigError, match="1f1b and interleaved"):
        make_schedule("gpipe", 2, 4, pair=True)
    with pytest.raises(ConfigError, match="1f1b and interleaved"):
        make_schedule("zero-bubble", 2, 4, pair=True)
    good = make_schedule("1f1b", 2, 4, pair=True)
    (f, b), *rest = good.pairs
    same = next(t for _, _, t in good.starts() if t.kind == "B" and t.chunk == f.chunk and t.microbatch == f.microbatch)
    with pytest.raises(ScheduleError, match="two micro-batches"):
        validate(dataclasses.replace(good, pairs=((f, same), *rest)))
    far = next(t for _, _, t in good.starts() if t.kind == "B" and t.chunk == f.chunk and t not in (b, same))
    with pytest.raises(ScheduleError, match="back to back"):
        validate(dataclasses.replace(good, pairs=((f, far), *rest)))
    elsewhere = next(t for _, _, t in good.starts() if t.kind == "B" and t.chunk != f.chunk)  # another stage's
    with pytest.raises(ScheduleError, match="on one stage"):
        validate(dataclasses.replace(good, pairs=((f, elsewhere), *rest)))
