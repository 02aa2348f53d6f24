"""A vision-language model under MPMD (encoder and language model on separate submeshes) gives the
losses of the same model under one SPMD program (fp32, 1e-4)."""

import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest

from hyperjax import HyperjaxError, load_config, resolve, train
from hyperjax.config.parallel import MPMD_REPLACED, ParallelConfig, mpmd_replaced
from hyperjax.search.strategies import WHOLE_RUN
from hyperjax.train import CaptionBatches

VLM = Path(__file__).parents[2] / "configs" / "vlm-tiny-mpmd.yaml"
STEPS = ["train.steps=3", "train.warmup_steps=1"]
MOE = "model.moe={experts: 4, top_k: 2, d_ff: 64}"
UNSPLIT = "[{modules: [encoder], devices: 2}, {modules: [language_model], devices: 6}]"  # no tensor axis


def losses(sets: list[str]) -> list[float]:
    return train(resolve(load_config(VLM, [*STEPS, *sets])), log=io.StringIO()).losses


@pytest.fixture(scope="module")
def spmd() -> list[float]:
    return losses(["mpmd.submeshes=[]", "parallel.data=8", "train.microbatches=1"])


@pytest.mark.parametrize(
    "sets",
    [
        [],  # the shipped split: encoder on 2 devices (data), language model on 6 (data=3 x tensor=2)
        pytest.param(["parallel.schedule=gpipe", "train.microbatches=2"], marks=pytest.mark.slow),
        pytest.param(["parallel.schedule=zero-bubble"], marks=pytest.mark.slow),
        # remat'd blocks: the plain split
        pytest.param(["parallel.schedule=zero-bubble", "train.recompute=full"], marks=pytest.mark.slow),
        # the language model's residual stream split over its submesh's tensor axis (no whole-run degree)
        pytest.param(["parallel.sequence_parallel=true"], marks=pytest.mark.slow),
    ],
    ids=["1f1b", "gpipe", "zero-bubble", "zero-bubble-recompute", "sequence-parallel"],
)
def test_mpmd_matches_spmd(spmd, sets):
    run = resolve(load_config(VLM, [*STEPS, *sets]))
    assert [s.name for s in run.stages] == ["vision", "language"]
    got = losses(sets)
    assert np.all(np.isfinite(got)) and len(set(got)) == len(got)  # training moves the parameters
    np.testing.assert_allclose(got, spmd, rtol=1e-4, atol=0)


@pytest.mark.slow  # the fast tier holds the VLM's MPMD program to its SPMD one
def test_spmd_vlm_matches_one_device():
    one = train(resolve(load_config(VLM, [*STEPS, "mpmd.submeshes=[]"]), 1), log=io.StringIO()).losses
    many = losses(["mpmd.submeshes=[]", "parallel.data=4", "parallel.tensor=2", "train.microbatches=1"])
    np.testing.assert_allclose(many, one, rtol=1e-4, atol=0)


def test_auto_sizes_submeshes_by_predicted_compute():
    auto = "mpmd.submeshes=[{name: vision, modules: [encoder]}, {name: language, modules: [language_model]}]"
    run = resolve(load_config(VLM, [auto, "train.global_batch=56", "train.microbatches=1"]))
    # the language model does about 10x the encoder's work: 1 + 7 devices balances best
    assert [s.devices for s in run.stages] == [1, 7]


def test_captions_need_the_image():
    data = CaptionBatches(global_batch=4, seq_len=20, vocab=64, image_size=16, patch=4, channels=3, seed=0)
    b = data.batch(0)
    assert b["images"].shape == (4, 16, 16, 3) and b["inputs"].shape == (4, 20)
    # the caption spells the image's patch codes: the first patch's pixel level is the first token
    np.testing.assert_allclose(b["images"][:, 0, 0, 2], b["inputs"][:, 0] / 64)
    np.testing.assert_array_equal(b["inputs"][:, 16], b["inputs"][:, 0])


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["mpmd.submeshes=[{modules: [encoder], devices: 8}]"], "'language_model' is assigned to no submesh"),
        (["mpmd.submeshes=[{modules: [encoder], devices: 2}, {modules: [decoder], devices: 6}]"], "'decoder'"),
        (["mpmd.submeshes=[{modules: [encoder], devices: 3}, {modules: [language_model], devices: 6}]"], "sum to 9"),
        (
            ["mpmd.submeshes=[{modules: [language_model], devices: 6}, {modules: [encoder], devices: 2}]"],
            "data-flow order",
        ),
        (["model.vision=null"], "set model.vision"),
        (["train.global_batch=20"], "do not split over its 2 data-parallel replicas"),
        # the whole run's degrees beside submeshes that take their own would be ignored
        (["parallel.tensor=2"], r"parallel.tensor=2: mpmd submeshes take their own .* in each mpmd.submeshes item"),
        (["parallel.data=4"], r"parallel.data=4: mpmd submeshes take their own degrees"),
        (["parallel.context=2"], r"parallel.context=2: mpmd submeshes have no context axis"),
        (["parallel.stage_layers=[4]"], r"parallel.stage_layers=\[4\]: an mpmd submesh runs a whole module"),
        (["parallel.schedule=interleaved", "parallel.virtual_stages=2"], "virtual_stages=2: an mpmd submesh runs"),
        (["parallel.pipeline=2"], "parallel.pipeline=2: mpmd.submeshes and parallel.pipeline > 1 both split"),
        (["mpmd.submeshes=[]", "parallel.pipeline=2"], r"pipelines as its encoder and its language model on two"),
        (
            [MOE, "parallel.expert_tensor=1"],
            "parallel.expert_tensor=1: experts on an mpmd submesh split over its tensor axis",
        ),
        (["parallel.sequence_parallel=true", f"mpmd.submeshes={UNSPLIT}"], "an mpmd.submeshes item with tensor > 1"),
        # an item's own checks name the item (before: "mpmd.submeshes[].tensor", and "parallel.data")
        (
            ["mpmd.submeshes=[{modules: [encoder], devices: 2}, {modules: [language_model], devices: 6, tensor: 0}]"],
            r"^mpmd.submeshes\[1\].tensor=0 must be a positive integer",
        ),
        (
            ["mpmd.submeshes=[{modules: [encoder], devices: 2}, {modules: [language_model], devices: 6, tensor: 4}]"],
            r"do not divide the 6 devices, so mpmd.submeshes\[1\].data cannot take the rest",
        ),
    ],
)
def test_invalid_mpmd_names_the_key(sets, match):
    with pytest.raises(HyperjaxError, match=match):
        resolve(load_config(VLM, sets))


def test_every_replaced_key_is_refused_and_reset_by_a_split():
    """Each whole-run key an MPMD run's submeshes replace is refused when set, and a planner's MPMD split
    resets it to what the resolver accepts: one table, read by both."""
    changed = {
        "data": {"data": 2},
        "fsdp": {"fsdp": 2},
        "tensor": {"tensor": 2},
        "context": {"context": 2},
        "expert_tensor": {"expert_tensor": 1},
        "stage_devices": {"stage_devices": (8,)},
        "stage_layers": {"stage_layers": (4,)},
        "virtual_stages": {"virtual_stages": 2, "schedule": "interleaved"},
        "pipeline": {"pipeline": 2},
        "expert": {"expert": 2},
    }
    assert set(changed) == set(MPMD_REPLACED)
    assert mpmd_replaced(ParallelConfig()) is None
    for key, fields in changed.items():
        p = ParallelConfig(**fields)
        assert mpmd_replaced(p)[0] == key
        reset = {k.removeprefix("parallel."): v for k, v in WHOLE_RUN.items()}
        assert mpmd_replaced(dataclasses.replace(p, **reset, schedule="1f1b")) is None
