"""The correctness oracle: every strategy gives the losses of the same run on one device (fp32, 1e-4)."""

import functools
import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperjax import load_config, resolve, train
from tests.tiers import sweep

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
STEPS = 3  # the losses of three steps: two updates, the second from moments the first wrote
# The quick start made small where its size is not the point: every layer is sharded alike (two show what a
# layer hands the next), and 16 sequences still give every data-parallel replica of 8 devices two.
SMALL = [f"train.steps={STEPS}", "model.layers=2", "train.global_batch=16", "parallel.tensor=1"]


def losses(sets: list[str], devices: int = 8, config: Path = QUICKSTART) -> list[float]:
    cfg = load_config(config, [*SMALL, *sets])
    return train(resolve(cfg, devices), log=io.StringIO()).losses


SLOW = pytest.mark.slow  # the rest of a sweep: `pytest -m slow`


@pytest.fixture(scope="module")
def single_device() -> list[float]:
    return losses([], devices=1)


def test_single_device_learns(single_device):
    assert len(single_device) == STEPS
    assert all(np.isfinite(single_device))
    assert single_device[-1] < single_device[0]


STRATEGIES = [
    ["parallel.data=8"],
    ["parallel.fsdp=8"],
    ["parallel.tensor=8"],
    ["parallel.data=2", "parallel.tensor=4"],
    ["parallel.tensor=4", "parallel.sequence_parallel=true"],
    ["parallel.context=4"],
    ["parallel.zero_stage=1"],
    ["parallel.zero_stage=2", "parallel.fsdp=2", "parallel.tensor=2"],
    ["parallel.data=4", "parallel.tensor=2", "train.micro_batch=2"],
    ["parallel.tensor=2", "parallel.context=2", "parallel.fsdp=2", "train.recompute=full"],
    ["parallel.fsdp=2", "parallel.context=2", "parallel.data=2", "parallel.fsdp_context=true", "parallel.zero_stage=1"],
]


@pytest.mark.parametrize(
    "sets",
    sweep(STRATEGIES, fast={1, 2, 7, 8, 9, 10}),
    ids=lambda s: ",".join(x.split(".")[-1] for x in s),
)
def test_strategy_matches_single_device(single_device, sets):
    np.testing.assert_allclose(losses(sets), single_device, rtol=1e-4, atol=0)


LLAMA = ["model.family=llama", "model.kv_heads=2"]


@pytest.mark.parametrize(
    "sets",
    [
        ["parallel.data=8"],
        ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.zero_stage=2"],
        pytest.param(
            ["parallel.data=4", "parallel.tensor=2", "train.micro_batch=2", "train.recompute=selective"], marks=SLOW
        ),
        pytest.param(
            ["parallel.data=2", "parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"],
            marks=SLOW,
        ),
    ],
    ids=lambda s: ",".join(x.split(".")[-1] for x in s),
)
def test_gradient_buckets_match_single_device(single_device, sets):
    """Each data-parallel replica's gradients computed apart and summed in one flat buffer."""
    np.testing.assert_allclose(losses([*sets, "parallel.gradient_buckets=true"]), single_device, rtol=1e-4, atol=0)


def test_llama_gqa_tensor_and_sequence_parallel():
    reference = losses(LLAMA, devices=1)
    sharded = losses(
        [
            *LLAMA,
            "parallel.tensor=2",
            "parallel.sequence_parallel=true",
            "parallel.data=2",
            "parallel.context=2",
            "train.recompute=selective",
        ]
    )
    np.testing.assert_allclose(sharded, reference, rtol=1e-4, atol=0)


DEGREES = [
    (d, f, c, t)
    for d in (1, 2, 4, 8)
    for f in (1, 2, 4, 8)
    for c in (1, 2, 4)
    for t in (1, 2, 4, 8)
    if d * f * c * t == 8
]


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    degrees=st.sampled_from(DEGREES),
    sequence_parallel=st.booleans(),
    zero_stage=st.integers(0, 2),
    recompute=st.sampled_from(["none", "selective", "full"]),
    buckets=st.booleans(),
)
def test_random_strategies_match_single_device(
    single_device, degrees, sequence_parallel, zero_stage, recompute, buckets
):
    data, fsdp, context, tensor = degrees
    sets = [
        f"parallel.data={data}",
        f"parallel.fsdp={fsdp}",
        f"parallel.context={context}",
        f"parallel.tensor={tensor}",
        f"parallel.sequence_parallel={str(sequence_parallel and tensor > 1).lower()}",
        f"parallel.zero_stage={zero_stage}",
        f"train.recompute={recompute}",
        f"parallel.gradient_buckets={str(buckets and data > 1).lower()}",
    ]
    np.testing.assert_allclose(losses(sets), single_device, rtol=1e-4, atol=0)


# architectures described by their parts; the quickstart's shape
ARCHITECTURES = {
    "parallel-block": ["model.block=parallel", "model.bias=false"],
    "head-dim-apart": ["model.family=llama", "model.head_dim=48", "model.kv_heads=4"],
    "relu": ["model.mlp=relu"],
    "untied": ["model.tie_embeddings=false", "model.mlp=geglu"],
    # PaLM-style: one key/value head for all queries, kept whole on every tensor-parallel device
    "multi-query": ["model.family=llama", "model.kv_heads=1", "shard.kv_heads=null", "shard.act_kv_heads=null"],
}
SHARDED = [
    ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true", "parallel.gradient_buckets=true"],
    ["parallel.fsdp=2", "parallel.tensor=2", "parallel.context=2", "parallel.zero_stage=1"],
]


@functools.cache
def reference(name: str) -> tuple[float, ...]:
    losses_ = losses(ARCHITECTURES[name], devices=1)
    assert losses_[-1] < losses_[0]
    return tuple(losses_)


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        pytest.param(name, layout, marks=() if (name, layout) in {("parallel-block", 0)} else SLOW)
        for name in ARCHITECTURES
        for layout in range(len(SHARDED))
    ],
)
def test_architectures_match_single_device(name, layout):
    sharded = losses([*ARCHITECTURES[name], *SHARDED[layout]])
    np.testing.assert_allclose(sharded, reference(name), rtol=1e-4, atol=0, err_msg=str(SHARDED[layout]))
