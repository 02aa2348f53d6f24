"""Stages priced each on its own: a vision-language model module by module, MPMD submeshes and unequal
pipeline stages replayed on the grid the runtime executes."""

from pathlib import Path

import pytest

from hyperjax import estimate, load_config, plan, resolve
from hyperjax.mpmd import replay

CONFIGS = Path(__file__).parents[2] / "configs"
VLM = CONFIGS / "vlm-tiny-mpmd.yaml"


def test_a_vision_language_model_is_priced_module_by_module():
    spmd = estimate(resolve(load_config(VLM, ["mpmd.submeshes=[]", "train.microbatches=1"])))
    (stage,) = spmd.stages
    assert [p.module for p in stage.parts] == ["encoder", "language_model"]
    encoder, language = stage.parts
    assert language.layer.forward_s > encoder.layer.forward_s  # the language model is wider and longer
    parts = sum(p.layers * (p.layer.forward_s + p.layer.backward_s) + p.head_s for p in stage.parts)
    assert stage.compute_s == pytest.approx(parts)
    assert spmd.breakdown_s["compute"] == pytest.approx(parts)


def test_mpmd_submeshes_are_replayed_on_the_grid():
    est = estimate(resolve(load_config(VLM)))
    assert not est.closed_form and [s.stage.name for s in est.stages] == ["vision", "language"]
    sched, seconds = est.schedule()
    end = max(e for _, _, e in replay(sched, seconds).values())
    slowest = est.stages[est.critical]
    assert end >= est.run.microbatches * max(s.per_microbatch_s for s in est.stages) * (1 - 1e-9)
    assert est.step_time_s == pytest.approx(end + slowest.data_parallel_exposed_s + slowest.optimizer_s)
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s)


def test_unequal_pipeline_stages_are_priced_each_on_its_own():
    base = ["parallel.tensor=1", "parallel.pipeline=2", "train.global_batch=48", "train.microbatches=4"]
    equal = estimate(resolve(load_config(CONFIGS / "quickstart.yaml", base)))
    unequal = estimate(resolve(load_config(CONFIGS / "quickstart.yaml", [*base, "parallel.stage_devices=[2,6]"])))
    assert equal.closed_form and not unequal.closed_form
    small, big = unequal.stages
    assert small.layers < big.layers  # layers balanced by devices
    assert small.stage.axes["data"] == 2 and big.stage.axes["data"] == 6
    assert unequal.breakdown_s["pipeline_bubble"] >= 0
    assert sum(unequal.breakdown_s.values()) == pytest.approx(unequal.step_time_s)


def test_embedding_and_head_live_on_the_end_stages():
    run = resolve(load_config(CONFIGS / "quickstart.yaml", ["parallel.tensor=1", "parallel.pipeline=4"]))
    first, *middle, last = estimate(run).stages
    assert first.parts[0].held_params > 0 and last.parts[0].head_s > 0
    assert all(s.parts[0].held_params == 0 and s.parts[0].head_s == 0 for s in middle)
    assert first.in_flight == 4 and last.in_flight == 1  # 1F1B: the first stage holds p micro-batches


def test_the_search_prices_submesh_splits_of_a_vision_language_model():
    found = plan(load_config(VLM), 8, keep=50)
    best = found.best
    kinds = {bool(c.overrides.get("mpmd.submeshes")) for c in best}
    assert kinds == {True, False} and found.priced >= found.fitting > 0  # MPMD splits and SPMD programs compete
    mpmd = next(c for c in best if c.overrides.get("mpmd.submeshes"))
    assert sum(s.devices for s in mpmd.run.stages) == 8 and mpmd.run.describe().startswith("mpmd")


def test_unequal_layers_over_many_stages_are_replayed_chunk_by_chunk():
    # six layers over four stages: 1 + 2 + 2 + 1, middle stages alike (their cost shared, their chunks their own)
    sets = ["parallel.tensor=1", "parallel.pipeline=4", "model.layers=6", "train.microbatches=8"]
    est = estimate(resolve(load_config(CONFIGS / "quickstart.yaml", sets)))
    assert est.run.chunk_layers() == (1, 2, 2, 1) and not est.closed_form
    assert [s.chunks[0].chunk for s in est.stages] == [0, 1, 2, 3]
    sched, seconds = est.schedule()
    end = max(e for _, _, e in replay(sched, seconds).values())
    slowest = est.stages[est.critical]
    assert est.step_time_s == pytest.approx(end + slowest.data_parallel_exposed_s + slowest.optimizer_s)


def test_end_chunks_of_no_blocks_price_the_embedding_and_the_head_alone():
    # Megatron's account_for_embedding/loss split: 2 x 2 chunks of 0, 2, 2 and 0 layers
    sets = ["parallel.tensor=1", "parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    sets += ["train.microbatches=4", "parallel.stage_layers=[0,2,2,0]"]
    est = estimate(resolve(load_config(CONFIGS / "quickstart.yaml", sets)))
    first, last = est.stages
    embed, head = first.parts[0], last.parts[-1]
    assert embed.layers == 0 and embed.held_params > 0 and head.layers == 0 and head.head_s > 0
    work = {c.chunk: c.forward_s for s in est.stages for c in s.chunks}
    assert work[0] < work[1] and work[0] < work[2]  # the embedding alone is a fraction of two blocks
    assert first.layers == last.layers == 2
