"""The oracle for mixtures of experts: dropless MoE training gives the losses of one device under expert
parallelism and everything it composes with (fp32, 1e-4); with a capacity factor, every layout drops the
same copies."""

import io
from pathlib import Path

import numpy as np
import pytest

from hyperjax import load_config, resolve, train

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
LAYOUTS = [
    ["parallel.expert=2"],
    ["parallel.expert=4"],  # with data=2
    ["parallel.expert=8"],
    ["parallel.expert=2", "parallel.tensor=2"],  # each expert's hidden width split over tensor
    # experts spread over expert x tensor (Megatron's expert tensor parallelism of 1)
    ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1"],
    ["parallel.expert=2", "parallel.fsdp=2"],
    ["parallel.expert=4", "parallel.fsdp=2", "parallel.zero_stage=1"],
    ["parallel.expert=2", "parallel.context=2", "train.recompute=full"],
    ["parallel.expert=4", "train.micro_batch=2", "train.recompute=selective"],  # accumulated micro-batches
    ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4"],  # MoE layers inside stages
    ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.schedule=zero-bubble"],
    ["parallel.expert=4", "offload.policy=manual", "offload.manual={layers.1.optimizer: host}"],
    # each replica's gradients summed in flat buffers: over data x expert (routed experts' over data alone)
    ["parallel.expert=2", "parallel.gradient_buckets=true"],
    ["parallel.expert=8", "parallel.gradient_buckets=true"],
    ["parallel.expert=2", "parallel.tensor=2", "parallel.gradient_buckets=true", "train.micro_batch=1"],
    ["parallel.expert=2", "parallel.fsdp=2", "parallel.gradient_buckets=true"],  # over data: fsdp stores
    # overlap schedules: each micro-batch as two halves (DeepSeek-V3's two-micro-batch overlap) ...
    ["parallel.expert=2", "parallel.overlap=two-microbatch"],
    ["parallel.expert=4", "parallel.overlap=two-microbatch", "parallel.gradient_buckets=true"],
    ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1", OVERLAP],
    ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.overlap=two-microbatch"],
    # ... and a pipeline's forwards and backwards of different micro-batches run as pairs (F-B pairing)
    ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=4", "parallel.overlap=fb-pair"],
    ["parallel.expert=2", "parallel.pipeline=2", "train.microbatches=8", "parallel.overlap=fb-pair", FULL],
]


@pytest.mark.parametrize("sets", LAYOUTS, ids=lambda s: ",".join(x.split(".")[-1] for x in s))
def test_layout_matches_single_device(single_device, sets):
    losses, _ = run_moe(sets)
    np.testing.assert_allclose(losses, single_device, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "model",
    [
        # DeepSeek-V3's parts: sigmoid router, loss-free bias balancing, latent attention
        ["model.moe.router=sigmoid", "model.moe.balance=bias", "model.moe.bias_update_rate=0.01"],
        ["model.attention=mla", "model.kv_lora_rank=32", "model.q_lora_rank=48", "model.rope_head_dim=8"],
        # GShard / Switch style: GELU experts with biases, no shared expert
        ["model.family=gpt", "model.moe.shared_experts=0", "model.moe.first_dense=0", "model.moe.every=2"],
    ],
    ids=["deepseek-router", "mla", "gpt-experts"],
)
def test_moe_parts_match_single_device(model):
    reference, _ = run_moe(model, devices=1)
    assert reference[-1] < reference[0]
    # the second sums the replicas' gradients in buckets; the third runs every micro-batch as two halves
    for sets in ([], ["parallel.gradient_buckets=true"], ["parallel.overlap=two-microbatch"]):
        sharded, _ = run_moe([*model, "parallel.expert=4", "parallel.tensor=2", *sets])
        np.testing.assert_allclose(sharded, reference, rtol=1e-4, atol=0, err_msg=str(sets))


def test_capacity_drops_the_same_copies_on_every_layout():
    capacity = ["model.moe.capacity_factor=0.75"]
    reference, records = run_moe(capacity, devices=1)
    dropped = [r["dropped_fraction"] for r in records]
    assert all(d > 0 for d in dropped)  # at 0.75 of the mean load, some copies must go
    for sets in (
        ["parallel.expert=4"],
        ["parallel.expert=2", "parallel.tensor=2", "parallel.fsdp=2"],
        ["parallel.expert=4", "parallel.gradient_buckets=true"],  # the queue runs over every replica's tokens
    ):
        losses, got = run_moe([*capacity, *sets])
        np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=0)
        np.testing.assert_allclose([r["dropped_fraction"] for r in got], dropped, rtol=0, atol=1e-7)
