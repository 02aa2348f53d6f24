"""Pipeline schedules: every grid passes the validator and has the textbook bubble; the validator bites."""

import dataclasses

import pytest

from hyperjax.errors import ConfigError
from hyperjax.mpmd import SCHEDULES, Task, make_schedule, theory_bubble, validate
from hyperjax.mpmd.schedules import ScheduleError
from hyperjax.mpmd.timing import uniform_bubble

SIZES = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_grid_is_valid_and_has_the_textbook_bubble(name):
    checked = 0
    for p, m in SIZES:
        for v in (2, 3, 4) if name == "interleaved" else (1,):
            if name == "interleaved" and m % p:
                continue
            sched = make_schedule(name, p, m, v)
            validate(sched)  # make_schedule validates too; this is the public check
            tasks = [task for _, _, task in sched.starts()]
            assert len(tasks) == len(set(tasks)) == m * p * v * (3 if sched.split_backward else 2)
            if name != "zero-bubble" or m >= p:  # ZB-H1's figure assumes enough micro-batches to fill with W
                assert sched.bubble_fraction() == pytest.approx(theory_bubble(name, p, m, v), abs=1e-12)
            checked += 1
    assert checked > 100


def test_schedules_differ_where_they_should():
    gpipe, one_f = make_schedule("gpipe", 4, 8), make_schedule("1f1b", 4, 8)
    # same bubble, but 1F1B holds at most p micro-batches' activations on stage 0, GPipe all m
    assert gpipe.bubble_fraction() == one_f.bubble_fraction()
    assert _peak_in_flight(gpipe, 0) == 8
    assert _peak_in_flight(one_f, 0) == 4
    assert make_schedule("interleaved", 4, 8, 2).bubble_fraction() < one_f.bubble_fraction()
    assert make_schedule("zero-bubble", 4, 8).bubble_fraction() < one_f.bubble_fraction()


def _peak_in_flight(sched, stage, *, paired=False):
    """Micro-batches' forwards a stage holds at its peak. ``paired``: a pair's forward and backward count
    together, the backward freeing a layer as the forward keeps one (Megatron-Core's combined 1F1B)."""
    partner = {f: b for f, b in sched.pairs} if paired else {}
    later = set(partner.values())
    live = peak = 0
    for _, s, task in sched.starts():
        if s == stage and task not in later:
            live += 0 if task in partner else {"F": 1, "B": -1, "W": 0}[task.kind]
            peak = max(peak, live)
    return peak


def _swap(sched, stage, a, b):
    row = list(sched.grid[stage])
    row[a], row[b] = row[b], row[a]
    grid = tuple(tuple(row) if i == stage else r for i, r in enumerate(sched.grid))
    return dataclasses.replace(sched, grid=grid)


def test_validator_catches_broken_grids():
    sched = make_schedule("gpipe", 2, 2)
    # stage 1 before its input: F0.1 moved to slot 0
    row = list(sched.grid[1])
    i = row.index(Task("F", 0, 1))
    with pytest.raises(ScheduleError, match="before"):
        validate(_swap(sched, 1, 0, i))
    # a task dropped
    dropped = tuple(tuple(None if c == Task("B", 1, 0) else c for c in r) for r in sched.grid)
    with pytest.raises(ScheduleError, match="never runs"):
        validate(dataclasses.replace(sched, grid=dropped))
    # a task run twice
    twice = (tuple(c if c is not None else Task("F", 0, 0) for c in sched.grid[0]), sched.grid[1])
    with pytest.raises(ScheduleError, match=r"twice|slots"):
        validate(dataclasses.replace(sched, grid=twice))
    # a chunk on the wrong stage
    wrong = (sched.grid[1], sched.grid[0])
    with pytest.raises(ScheduleError, match="lives on stage"):
        validate(dataclasses.replace(sched, grid=wrong))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("pipedream", 2, 4), "parallel.schedule"),
        (("1f1b", 0, 4), "parallel.pipeline"),
        (("1f1b", 2, 0), "train.microbatches"),
        (("1f1b", 2, 4, 2), "parallel.virtual_stages=2 needs parallel.schedule: interleaved"),
        (("interleaved", 4, 6, 2), "multiple of 4"),
        (("interleaved", 4, 8, 1), "virtual_stages=1 is 1F1B's grid"),
    ],
)
def test_bad_sizes_name_the_key(args, match):
    with pytest.raises(ConfigError, match=match):
        make_schedule(*args)


@pytest.mark.parametrize(("name", "v"), [("zero-bubble", 1), ("interleaved", 2), ("1f1b", 1), ("gpipe", 1)])
def test_uniform_bubble_is_the_whole_grid_replayed(name, v):
    from hyperjax.mpmd.timing import replayed_bubble, task_seconds, uniform_bubble

    for p in (2, 4):
        for m in (p, 3 * p, 8 * p):
            for b, w in ((2.0, 0.0), (1.3, 0.7), (0.9, 1.6)) if name == "zero-bubble" else ((2.0, 0.0), (1.4, 0.0)):
                sched = make_schedule(name, p, m, v)
                full = replayed_bubble(sched, task_seconds(sched, 1.0, b, w))
                assert uniform_bubble(name, p, m, v, 1.0, b, w) == pytest.approx(full, rel=1e-9), (p, m, b, w)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (8, 16)])
def test_zero_bubble_theory_at_unequal_costs_matches_the_grid(p, m):
    for costs in ((1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (18.0, 24.0, 14.6), (1.0, 2.0, 0.5), (1.2, 1.0, 0.9)):
        grid = uniform_bubble("zero-bubble", p, m, 1, *costs)
        assert theory_bubble("zero-bubble", p, m, 1, costs) == pytest.approx(grid, abs=1e-9), costs
    for costs in ((1.0, 0.9, 1.6), (1.0, 2.0, 1.5)):  # W longer than F or B: more idle than ZB-H1's figure
        assert uniform_bubble("zero-bubble", p, m, 1, *costs) > theory_bubble("zero-bubble", p, m, 1, costs)
    assert theory_bubble("1f1b", p, m, 1, (1.0, 3.0, 0.0)) == theory_bubble("1f1b", p, m)
