"""The oracle for mixtures of experts: dropless MoE training gives the losses of one device under expert
parallelism and everything it composes with (fp32, 1e-4); with a capacity factor, every layout drops the
same copies."""

import functools
import io
from pathlib import Path

import numpy as np
import pytest

from hyperjax import load_config, resolve, train
from tests.parts import DEEPSEEK_PARTS

MOE_TINY = Path(__file__).parents[2] / "configs" / "moe-tiny.yaml"
STEPS = 3
# two blocks: a dense one, then a mixture of experts (8 experts, top-2, one shared)
SMALL = ["model.layers=2", f"train.steps={STEPS}", "parallel.expert=1"]


def run_moe(sets: list[str], devices: int = 8) -> tuple[list[float], list[dict]]:
    cfg = load_config(MOE_TINY, [*SMALL, *sets])
    result = train(resolve(cfg, devices), log=io.StringIO())
    return result.losses, result.records


@pytest.fixture(scope="module")
def single_device() -> list[float]:
    losses, records = run_moe([], devices=1)
    assert all("expert_load_max_over_mean" in r and r["dropped_fraction"] == 0 for r in records)
    return losses


OVERLAP, FULL = "parallel.overlap=two-microbatch", "train.recompute=full"
BUCKETS = "parallel.gradient_buckets=true"
SLOW = pytest.mark.slow  # the rest of the sweep: `pytest -m slow`
LAYOUTS = [
    pytest.param(["parallel.expert=2"], marks=SLOW),  # the fast tier's layouts below each hold expert=2
    pytest.param(["parallel.expert=4"], marks=SLOW),  # with data=2
    pytest.param(["parallel.expert=8"], marks=SLOW),
    ["parallel.expert=2", "parallel.tensor=2"],  # each expert's hidden width split over tensor
    # experts spread over expert x tensor (Megatron's expert tensor parallelism of 1)
    ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1"],
    pytest.param(["parallel.expert=2", "parallel.fsdp=2"], marks=SLOW),
    pytest.param(["parallel.expert=4", "parallel.fsdp=2", "parallel.zero_stage=1"], marks=SLOW),
    pytest.param(["parallel.expert=2", "parallel.context=2", "train.recompute=full"], marks=SLOW),
    # accumulated micro-batches
    pytest.param(["parallel.expert=4", "train.micro_batch=2", "train.recompute=selective"], marks=SLOW),
    # MoE layers inside stages (the fast tier runs them paired, below)
    pytest.param(["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4"], marks=SLOW),
    pytest.param(
        ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.schedule=zero-bubble"],
        marks=SLOW,
    ),
    pytest.param(
        ["parallel.expert=4", "offload.policy=manual", "offload.manual={layers.1.optimizer: host}"], marks=SLOW
    ),
    # each replica's gradients summed in flat buffers: over data x expert (routed experts' over data alone)
    pytest.param(["parallel.expert=2", "parallel.gradient_buckets=true"], marks=SLOW),
    pytest.param(["parallel.expert=8", "parallel.gradient_buckets=true"], marks=SLOW),
    pytest.param(
        ["parallel.expert=2", "parallel.tensor=2", "parallel.gradient_buckets=true", "train.micro_batch=1"], marks=SLOW
    ),
    pytest.param(["parallel.expert=2", "parallel.fsdp=2", "parallel.gradient_buckets=true"], marks=SLOW),  # fsdp stores
    # overlap schedules: each micro-batch as two halves (DeepSeek-V3's two-micro-batch overlap) ...
    ["parallel.expert=2", "parallel.overlap=two-microbatch"],
    pytest.param(
        ["parallel.expert=4", "parallel.overlap=two-microbatch", "parallel.gradient_buckets=true"], marks=SLOW
    ),
    pytest.param(
        [
            "parallel.expert=2",
            "parallel.tensor=2",
            "parallel.sequence_parallel=true",
            "parallel.expert_tensor=1",
            OVERLAP,
        ],
        marks=SLOW,
    ),
    pytest.param(
        ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.overlap=two-microbatch"],
        marks=SLOW,
    ),
    # ... and a pipeline's forwards and backwards of different micro-batches run as pairs (F-B pairing),
    # under an interleaved schedule a chunk's forward with another chunk's backward (the end chunks hold only
    # the embedding and the output layer: 4 chunks of the 2 blocks)
    pytest.param(
        ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.overlap=fb-pair"], marks=SLOW
    ),
    pytest.param(
        [
            "parallel.expert=2",
            "parallel.pipeline=2",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "parallel.stage_layers=[0,1,1,0]",
            "train.microbatches=4",
            "parallel.overlap=fb-pair",
        ],
        marks=SLOW,
    ),
    pytest.param(
        ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=8", "parallel.overlap=fb-pair", FULL],
        marks=SLOW,
    ),
    # without a pipeline, each forward beside the previous micro-batch's backward (Megatron-Core's EP overlap)
    ["parallel.expert=2", "train.microbatches=4", "parallel.overlap=fb-pair"],
    pytest.param(["parallel.expert=4", "train.microbatches=2", "parallel.overlap=fb-pair", BUCKETS], marks=SLOW),
    # each stage's data replicas (2) accumulate their own gradients and balancing losses, summed once per step
    ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", BUCKETS],
    pytest.param(
        ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.overlap=fb-pair", BUCKETS],
        marks=SLOW,
    ),
    pytest.param(
        ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.schedule=zero-bubble", BUCKETS],
        marks=SLOW,
    ),
]


def layout_id(sets: list[str]) -> str:
    return ",".join(x.split(".")[-1] for x in sets)


@pytest.mark.parametrize("sets", LAYOUTS, ids=layout_id)
def test_layout_matches_single_device(single_device, sets):
    losses, _ = run_moe(sets)
    np.testing.assert_allclose(losses, single_device, rtol=1e-4, atol=0)


MODELS = {
    # DeepSeek-V3's parts: sigmoid router, loss-free bias balancing, latent attention
    "deepseek-router": ["model.moe.router=sigmoid", "model.moe.balance=bias", "model.moe.bias_update_rate=0.01"],
    "mla": ["model.attention=mla", "model.kv_lora_rank=32", "model.q_lora_rank=48", "model.rope_head_dim=8"],
    # GShard / Switch style: GELU experts with biases, no shared expert
    "gpt-experts": ["model.family=gpt", "model.moe.shared_experts=0", "model.moe.first_dense=0", "model.moe.every=2"],
}


@functools.cache
def reference(model: str) -> tuple[float, ...]:
    losses, _ = run_moe(MODELS[model], devices=1)
    assert losses[-1] < losses[0]
    return tuple(losses)


@pytest.mark.parametrize(
    ("model", "sets"),
    [
        pytest.param("deepseek-router", [], marks=SLOW),  # the fast tier trains both in the grouped-routing test
        pytest.param("mla", [], marks=SLOW),
        pytest.param("gpt-experts", [], marks=SLOW),
        # the replicas' gradients summed in buckets; every micro-batch run as two halves
        pytest.param("deepseek-router", ["parallel.gradient_buckets=true"], marks=SLOW),
        pytest.param("mla", ["parallel.gradient_buckets=true"], marks=SLOW),
        pytest.param("gpt-experts", ["parallel.gradient_buckets=true"], marks=SLOW),  # buckets: test_oracle's
        pytest.param("deepseek-router", ["parallel.overlap=two-microbatch"], marks=SLOW),
        pytest.param("mla", ["parallel.overlap=two-microbatch"], marks=SLOW),
        pytest.param("gpt-experts", ["parallel.overlap=two-microbatch"], marks=SLOW),
    ],
    ids=lambda x: x if isinstance(x, str) else layout_id(x) or "plain",
)
def test_moe_parts_match_single_device(model, sets):
    sharded, _ = run_moe([*MODELS[model], "parallel.expert=4", "parallel.tensor=2", *sets])
    np.testing.assert_allclose(sharded, reference(model), rtol=1e-4, atol=0)


@pytest.mark.slow  # a pipeline of two replicas
def test_a_pipelines_replicas_report_the_micro_batches_router_stats():
    """With gradient buckets, each replica of a pipeline stage reports its own router stats; the step's are
    the replicas' (expert loads, balancing loss), and the loss-free bias moves by them, as without."""
    sets = [*MODELS["deepseek-router"], "parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4"]
    apart, buckets = run_moe([*sets, "parallel.gradient_buckets=false"]), run_moe([*sets, BUCKETS])
    np.testing.assert_allclose(buckets[0], apart[0], rtol=1e-5, atol=0)
    for a, b in zip(apart[1], buckets[1], strict=True):
        for key in ("aux_loss", "expert_load_max_over_mean", "dropped_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


CAPACITY = ["model.moe.capacity_factor=0.75"]


@pytest.fixture(scope="module")
def capacity_reference() -> tuple[list[float], list[float]]:
    """One device's losses and dropped fractions at a capacity of 0.75 of the mean load."""
    losses, records = run_moe(CAPACITY, devices=1)
    dropped = [r["dropped_fraction"] for r in records]
    assert all(d > 0 for d in dropped)  # at 0.75 of the mean load, some copies must go
    return losses, dropped


@pytest.mark.parametrize(
    "sets",
    [
        ["parallel.expert=4"],
        pytest.param(["parallel.expert=2", "parallel.tensor=2", "parallel.fsdp=2"], marks=SLOW),
        # the queue runs over every replica's tokens
        pytest.param(["parallel.expert=4", "parallel.gradient_buckets=true"], marks=SLOW),
    ],
    ids=layout_id,
)
def test_capacity_drops_the_same_copies_on_every_layout(capacity_reference, sets):
    reference, dropped = capacity_reference
    losses, got = run_moe([*CAPACITY, *sets])
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=0)
    np.testing.assert_allclose([r["dropped_fraction"] for r in got], dropped, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    "sets",
    [
        ["parallel.expert=2", "parallel.pipeline=2"],
        pytest.param(["parallel.expert=2", "parallel.overlap=fb-pair"], marks=SLOW),  # paired, one stage
    ],
    ids=layout_id,
)
def test_staged_micro_batches_hold_the_rows_accumulation_does(sets):
    """A schedule of per-chunk programs splits the batch into the micro-batches one program's accumulation
    does (every m-th row), so a capacity queue drops the same copies and the balancing loss sees the same
    tokens: the dropped fractions agree exactly, step by step, with one device's."""
    micro = [*CAPACITY, "train.microbatches=4"]
    reference, one = run_moe(micro, devices=1)
    losses, staged = run_moe([*micro, *sets])
    np.testing.assert_allclose([r["dropped_fraction"] for r in staged], [r["dropped_fraction"] for r in one], atol=1e-7)
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=0)


@pytest.mark.slow  # the fast tier holds these parts' logits on expert x tensor to one device (tests/hf)
def test_grouped_routing_and_latent_attention_train_as_on_one_device():
    """DeepSeek-V3's parts (latent attention, interleaved rotary pairs, a sigmoid router choosing among its
    best groups, routed scaling, the loss-free bias) under expert x tensor parallelism."""
    one, _ = run_moe(DEEPSEEK_PARTS, devices=1)
    eight, _ = run_moe([*DEEPSEEK_PARTS, "parallel.expert=4", "parallel.tensor=2"])
    np.testing.assert_allclose(eight, one, rtol=1e-4)
