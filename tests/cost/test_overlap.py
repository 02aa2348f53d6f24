"""The all-to-all under overlap schedules in the cost model: what each hides, what it costs, the trace's
lane, the checks that refuse what cannot run, and the search choosing an overlap when it wins."""

import dataclasses
import json
from pathlib import Path

import pytest

from hyperjax import estimate, load_config, plan, resolve
from hyperjax.cost import simulate
from hyperjax.errors import ConfigError
from hyperjax.mpmd.timing import replay

ROOT = Path(__file__).parents[2]
DEEPSEEK = ROOT / "configs" / "deepseek-v3-671b.yaml"
# on 8-device nodes joined by a scale-out network, DeepSeek-V3's all-to-all is a large part of the step
CLUSTER = ["hardware=ascend910c-cluster", "train.micro_batch=2"]


def priced(*sets: str, devices: int = 384):
    return estimate(resolve(load_config(DEEPSEEK, [*CLUSTER, *sets]), devices))


@pytest.fixture(scope="module")
def by_overlap():
    return {o: priced(f"parallel.overlap={o}") for o in ("none", "two-microbatch", "fb-pair")}


def test_without_overlap_the_whole_all_to_all_is_exposed(by_overlap):
    a = by_overlap["none"].all_to_all
    assert a["total_s"] > 0 and a["exposed_s"] == pytest.approx(a["total_s"]) and a["hidden_fraction"] == 0
    # the same exchange the communication summary lists (per step on the slowest stage)
    assert a["total_s"] == pytest.approx(by_overlap["none"].communication_s["expert_parallel"])


@pytest.mark.parametrize("overlap", ["two-microbatch", "fb-pair"])
def test_an_overlap_hides_part_of_it_and_shortens_the_step(by_overlap, overlap):
    plain, est = by_overlap["none"], by_overlap[overlap]
    a = est.all_to_all
    assert a["total_s"] == pytest.approx(plain.all_to_all["total_s"])  # the same exchanges, hidden or not
    assert 0 < a["hidden_fraction"] < 1 and 0 < a["exposed_s"] < a["total_s"]
    assert est.step_time_s < plain.step_time_s
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s)
    # what it costs: two halves' exchange buffers in flight, or one more micro-batch held
    assert est.memory_per_device_gib["activations"] > plain.memory_per_device_gib["activations"]


def test_two_halves_hide_more_than_pairs_here_but_lose_compute_to_the_exchanges(by_overlap):
    two, pair = by_overlap["two-microbatch"], by_overlap["fb-pair"]
    assert two.all_to_all["hidden_fraction"] > pair.all_to_all["hidden_fraction"]
    assert two.breakdown_s["compute"] > by_overlap["none"].breakdown_s["compute"]  # the slowdown


def test_a_larger_compute_share_taken_by_the_exchanges_slows_the_overlapped_step(by_overlap):
    est = by_overlap["two-microbatch"]
    run = est.run
    device = dataclasses.replace(run.hardware.device, comm_compute_share=0.4)
    slower = estimate(dataclasses.replace(run, hardware=dataclasses.replace(run.hardware, device=device)))
    assert slower.step_time_s > est.step_time_s
    plain = by_overlap["none"].run
    device0 = dataclasses.replace(plain.hardware.device, comm_compute_share=0.4)
    same = estimate(dataclasses.replace(plain, hardware=dataclasses.replace(plain.hardware, device=device0)))
    assert same.step_time_s == pytest.approx(by_overlap["none"].step_time_s)  # nothing runs beside it


def test_paired_step_is_the_replay_of_the_paired_grid(by_overlap):
    est = by_overlap["fb-pair"]
    sched, seconds = est.schedule()
    assert sched.pairs
    end = max(e for _, _, e in replay(sched, seconds).values())
    stage = est.stages[est.critical]
    assert est.step_time_s == pytest.approx(end + stage.data_parallel_exposed_s + stage.optimizer_s, rel=1e-9)


def test_paired_equal_stages_are_replayed_and_read_as_such():
    sets = ["model.layers=8", "model.moe.first_dense=0", "parallel.pipeline=4", "parallel.expert=2"]
    est = estimate(resolve(load_config(ROOT / "configs" / "moe-tiny.yaml", [*sets, "train.microbatches=8"])))
    paired = estimate(dataclasses.replace(est.run, overlap="fb-pair"))
    assert est.closed_form and not paired.closed_form
    sched, seconds = paired.schedule()
    end = max(e for _, _, e in replay(sched, seconds).values())
    stage = paired.stages[paired.critical]
    assert paired.step_time_s == pytest.approx(end + stage.data_parallel_exposed_s + stage.optimizer_s, rel=1e-9)


def test_interleaved_pairs_join_a_stages_chunks_and_hide_their_all_to_all():
    # 6 stages of 2 chunks: Megatron's combined 1F1B under virtual stages pairs a forward with the backward
    # that follows it in the stage's order, often another chunk's
    sets = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    plain = priced(*sets)
    est = priced(*sets, "parallel.overlap=fb-pair")
    sched, seconds = est.schedule()
    assert any(f.chunk != b.chunk for f, b in sched.pairs)
    a = est.all_to_all
    assert a["total_s"] == pytest.approx(plain.all_to_all["total_s"])
    assert 0 < a["hidden_fraction"] < 1 and est.step_time_s < plain.step_time_s
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s)
    end = max(e for _, _, e in replay(sched, seconds).values())
    stage = est.stages[est.critical]
    assert est.step_time_s == pytest.approx(end + stage.data_parallel_exposed_s + stage.optimizer_s, rel=1e-9)
    # one chunk's forward more in the warm-up, and the pair holding no more than it started with: what the
    # stage holds unpaired (the grids' test below)
    assert est.in_flight == plain.in_flight
    events = simulate(est)
    assert {e["name"].split()[0] for e in events if e.get("tid") == 2} >= {"dispatch", "dispatch'"}


GRIDS = [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 16), (8, 2, 16)]


@pytest.mark.parametrize(("stages", "virtual", "microbatches"), GRIDS)
@pytest.mark.parametrize("overlap", ["none", "fb-pair"])
def test_micro_batches_in_flight_are_what_the_grid_holds(stages, virtual, microbatches, overlap):
    from hyperjax.cost.pipeline import in_flight
    from hyperjax.mpmd.schedules import run_schedule
    from tests.mpmd.test_schedules import _peak_in_flight

    schedule = "interleaved" if virtual > 1 else "1f1b"
    sets = [f"model.layers={stages * virtual}", f"parallel.pipeline={stages}", "parallel.expert=2"]
    sets += [f"parallel.schedule={schedule}", f"parallel.virtual_stages={virtual}", f"parallel.overlap={overlap}"]
    sets += [f"train.microbatches={microbatches}", f"train.global_batch={2 * microbatches}"]
    cfg = load_config(ROOT / "configs" / "moe-tiny.yaml", sets)
    run = resolve(cfg, 2 * stages)
    sched = run_schedule(run)
    for s in range(stages):  # chunk forwards held at the stage's peak, v to a micro-batch
        assert in_flight(run, s) == -(-_peak_in_flight(sched, s, paired=True) // virtual), s


@pytest.mark.parametrize("microbatches", [2, 5])
def test_one_stage_pairs_the_next_forward_with_each_backward(microbatches):
    """Without a pipeline, ``fb-pair`` runs Megatron-Core's EP overlap: the first forward alone, then each
    forward beside the previous micro-batch's backward, then the last backward; one micro-batch held at the
    peak, the pair swapping a layer of one for a layer of the other."""
    from hyperjax.cost.pipeline import in_flight
    from hyperjax.mpmd.schedules import Task, run_schedule

    sets = ["parallel.expert=2", f"train.microbatches={microbatches}", f"train.global_batch={2 * microbatches}"]
    run = resolve(load_config(ROOT / "configs" / "moe-tiny.yaml", [*sets, "parallel.overlap=fb-pair"]), 2)
    assert run.staged and not run.pipelined and run.schedule == "1f1b"
    sched = run_schedule(run)
    assert sched.pairs == tuple((Task("F", i + 1, 0), Task("B", i, 0)) for i in range(microbatches - 1))
    assert in_flight(run, 0) == 1
    plain = estimate(resolve(load_config(ROOT / "configs" / "moe-tiny.yaml", sets), 2))
    est = estimate(run)
    stage = est.stages[0]
    # the step is the grid replayed: F, the pairs, B, each pair shortened by what it hides
    assert not est.closed_form and len(est.kinds) == 1
    assert est.step_time_s < plain.step_time_s
    assert est.all_to_all["exposed_s"] < plain.all_to_all["exposed_s"]
    assert est.step_time_s == pytest.approx(
        est.breakdown_s["compute"]
        + est.breakdown_s["exposed_communication"]
        + est.breakdown_s["pipeline_bubble"]
        + est.breakdown_s["recompute"]
        + est.breakdown_s["optimizer"]
    )
    assert stage.per_microbatch_s == pytest.approx(plain.stages[0].per_microbatch_s)


def test_a_pair_of_a_dense_chunk_and_an_moe_chunk_saves_nothing():
    from hyperjax.cost.overlap import Exchange, pair_exchange

    est = priced("parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.overlap=fb-pair")
    moe = next(c.exchange for s in est.stages for c in s.chunks if c.exchange.layers)
    share = est.run.exchange_share
    for f, b in ((Exchange(), moe), (moe, Exchange())):
        pair = pair_exchange(f, b, share)
        assert pair.saving_s == pytest.approx(0.0, abs=1e-12) and pair.hidden_s == pytest.approx(0.0, abs=1e-12)
    both = pair_exchange(moe, moe, share)
    assert both.saving_s > 0 and both.hidden_s > 0


def test_the_trace_draws_the_all_to_all_lane(by_overlap):
    events = simulate(by_overlap["fb-pair"])
    lane = [e for e in events if e.get("tid") == 2]
    names = {e["name"].split()[0] for e in lane}
    assert {"dispatch", "combine", "dispatch'", "combine'"} <= names
    assert all(e["dur"] > 0 for e in lane)


def test_predict_json_reports_the_all_to_all_for_moe_only():
    for name in ("moe-tiny", "deepseek-v3-671b", "mixtral-8x7b", "qwen3-235b-a22b", "switch-style"):
        d = estimate(resolve(load_config(ROOT / "configs" / f"{name}.yaml"))).to_dict()
        assert set(d["all_to_all"]) == {"total_s", "exposed_s", "hidden_fraction"}, name
        assert d["run"]["overlap"] == "none"
        json.dumps(d)
    assert "all_to_all" not in estimate(resolve(load_config(ROOT / "configs" / "quickstart.yaml"))).to_dict()


@pytest.mark.parametrize(
    ("config", "sets", "words"),
    [
        ("quickstart", ["parallel.overlap=two-microbatch"], "model has no MoE layers"),
        ("moe-tiny", ["parallel.overlap=two-microbatch", "parallel.expert=1"], "no all-to-all to hide"),
        ("moe-tiny", ["parallel.overlap=two-microbatch", "model.moe.capacity_factor=1.25"], "dropless"),
        ("moe-tiny", ["parallel.overlap=two-microbatch", "train.micro_batch=1"], "even number"),
        ("moe-tiny", ["parallel.overlap=fb-pair", "train.microbatches=1"], "train.microbatches >= 2"),
        (
            "vlm-tiny-mpmd",
            [
                "mpmd.submeshes=[]",
                "model.moe={experts: 4, top_k: 2, d_ff: 64}",
                "train.global_batch=32",
                "parallel.expert=2",
                "parallel.overlap=fb-pair",
                "train.microbatches=2",
            ],
            "model.vision (an encoder and a language model: two chunks) needs more",
        ),
        (
            "vlm-tiny-mpmd",  # submeshes of different modules: no chunks of one model to pair
            ["model.moe={experts: 4, top_k: 2, d_ff: 64}", "parallel.overlap=fb-pair"],
            "not of mpmd submeshes running different modules",
        ),
        ("moe-tiny", ["parallel.overlap=fb-pair", "parallel.pipeline=2", "parallel.schedule=zero-bubble"], "1f1b"),
        ("moe-tiny", ["parallel.overlap=fb-pair", "parallel.pipeline=2", "parallel.schedule=gpipe"], "interleaved"),
        (
            "moe-tiny",
            [
                "parallel.overlap=fb-pair",
                "parallel.pipeline=2",
                "parallel.schedule=interleaved",
                "parallel.virtual_stages=2",
                "train.microbatches=2",
            ],
            "warm-up of 5 forwards; set train.microbatches >= 4",
        ),
        ("moe-tiny", ["parallel.overlap=fb-pair", "parallel.pipeline=2", "train.microbatches=2"], "microbatches >= 4"),
        ("moe-tiny", ["parallel.overlap=both"], "parallel.overlap='both' is not one of"),
    ],
)
def test_overlaps_that_cannot_run_are_refused_by_name(config, sets, words):
    with pytest.raises(ConfigError, match=r"parallel\.overlap") as e:
        resolve(load_config(ROOT / "configs" / f"{config}.yaml", sets))
    assert words in str(e.value)


def test_the_search_chooses_an_overlap_where_it_wins():
    cfg = load_config(DEEPSEEK, ["hardware=ascend910c-cluster"])
    # 384 = 8 x 16 x 3: the factor 3 in stages (uneven: 61 layers), as ZeRO over a data degree of 3 could split
    # none of DeepSeek-V3's widths (7168 over fsdp 8 is 896), and without ZeRO one stage does not fit
    where = {"parallel.data": 1, "parallel.fsdp": 8, "parallel.expert": 16, "parallel.pipeline": 3}
    best = plan(cfg, 384, keep=1, where=where).best[0]
    plain = plan(cfg, 384, keep=1, where=where | {"parallel.overlap": "none"}).best[0]
    assert best.overrides["parallel.overlap"] == "two-microbatch"
    assert best.estimate.step_time_s < plain.estimate.step_time_s
    assert best.estimate.run.overlap == "two-microbatch"
