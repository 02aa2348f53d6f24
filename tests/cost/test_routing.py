"""The all-to-all's reach: how many blocks of devices a token's copies cross to, with and without grouped
(node-limited) routing."""

import math
from pathlib import Path

import pytest

from hyperjax import HyperjaxError, estimate, load_config, load_hardware, resolve
from hyperjax.config import MoEConfig
from hyperjax.cost import price_layer
from hyperjax.cost.compute import stream_time
from hyperjax.cost.routing import reach_probability, regroup_move_time, routing
from hyperjax.topology import axis_spans

DEEPSEEK = {"experts": 256, "top_k": 8}


def test_uniform_choice_reaches_a_block_by_the_hypergeometric_law():
    moe = MoEConfig(**DEEPSEEK)
    assert reach_probability(moe, 32) == pytest.approx(1 - math.comb(224, 8) / math.comb(256, 8))


def test_grouped_routing_reaches_whole_group_blocks_as_the_groups_are_chosen():
    moe = MoEConfig(**DEEPSEEK, groups=8, group_top_k=4)
    assert reach_probability(moe, 32) == pytest.approx(1 - math.comb(7, 4) / math.comb(8, 4))  # one node: 1/2
    assert reach_probability(moe, 64) == pytest.approx(1 - math.comb(6, 4) / math.comb(8, 4))
    # a block inside a group: its group chosen (4 of 8), then one of its experts among the chosen 128
    assert reach_probability(moe, 4) == pytest.approx(0.5 * (1 - math.comb(124, 8) / math.comb(128, 8)))
    assert reach_probability(moe, 32) < reach_probability(MoEConfig(**DEEPSEEK), 32)


def test_grouped_routing_shortens_the_exchange_across_nodes():
    sets = ["hardware=dgx-h100", "parallel.expert=64", "parallel.pipeline=1", "parallel.data=null"]
    path = Path(__file__).parents[2] / "configs" / "deepseek-v3-671b.yaml"
    grouped = resolve(load_config(path, sets))
    flat = resolve(load_config(path, [*sets, "model.moe.groups=1", "model.moe.group_top_k=null"]))
    a, b = estimate(grouped).communication_s["expert_parallel"], estimate(flat).communication_s["expert_parallel"]
    assert 0 < a < b


def test_fewer_experts_than_kept_groups_reach_no_more_groups_than_experts():
    moe = MoEConfig(experts=64, top_k=2, groups=8, group_top_k=4)
    flat = MoEConfig(experts=64, top_k=2)
    assert reach_probability(moe, 8) == pytest.approx(1 - math.comb(7, 2) / math.comb(8, 2))
    assert reach_probability(moe, 8) < 1 - math.comb(7, 4) / math.comb(8, 4)  # two groups at most, not four
    # all groups kept: the uniform law
    everything = MoEConfig(experts=64, top_k=2, groups=8, group_top_k=8)
    assert reach_probability(everything, 4) == pytest.approx(reach_probability(flat, 4))


def test_dispatchers_move_what_their_exchanges_send():
    """DeepEP sends a token once to each device holding any of its experts; NCCL's all-to-all sends each of
    its top_k copies; an all-gather brings every token of the group to every device."""
    sets = ["hardware=dgx-h100", "parallel.expert=8", "parallel.pipeline=1", "parallel.data=null"]
    path = Path(__file__).parents[2] / "configs" / "deepseek-v3-671b.yaml"
    exchange = {
        d: estimate(resolve(load_config(path, [*sets, f"parallel.dispatcher={d}"]))).stages[0].parts[-1].layer
        for d in ("deepep", "alltoall", "allgather")
    }
    one = {d: layer.exchange_s for d, layer in exchange.items()}
    held = 256 / 8  # experts a device holds
    # inside one node: the bytes are each device's, the ratio of copies sent to devices reached
    moe = load_config(path, sets).model.moe  # node-limited routing: fewer devices reached than uniform
    copies, reached = moe.top_k * 7 / 8, 7 * reach_probability(moe, held)
    assert one["alltoall"] / one["deepep"] == pytest.approx(copies / reached, rel=0.02)
    # each device gathers the other 7 devices' tokens: as many bytes as 8 copies to 7 of 8 devices
    assert one["allgather"] == pytest.approx(one["alltoall"], rel=0.02) and one["deepep"] > 0
    with pytest.raises(HyperjaxError, match=r"parallel\.dispatcher"):
        load_config(path, ["parallel.dispatcher=nccl"])


def _moe_layer(dispatcher: str, expert: int, experts: int = 64, tensor: int = 1, **kw):
    """One MoE block of a small model priced at ``expert``-way expert parallelism (``tensor``-way tensor
    parallelism, ``kw`` to ``price_layer``), and its routing."""
    cfg = load_config(
        None,
        [
            "hardware=dgx-h100",
            f"emulate.devices={expert * tensor}",
            "model.family=llama",
            "model.layers=1",
            "model.d_model=1024",
            "model.heads=8",
            "model.kv_heads=8",
            "model.d_ff=2048",
            "model.vocab=1024",
            "model.seq_len=2048",
            f"model.moe={{experts: {experts}, top_k: 4, d_ff: 512, load_imbalance: 1.0}}",
            f"train.global_batch={expert}",
            f"parallel.expert={expert}",
            f"parallel.tensor={tensor}",
        ],
    )
    hw = load_hardware("dgx-h100")
    axes = {"data": 1, "fsdp": 1, "expert": expert, "context": 1, "tensor": tensor}
    spans = axis_spans(hw, axes, groups={"expert+tensor": ("expert", "tensor")})
    split = kw.pop("expert_tensor", True)
    kw = dict(dtype="bfloat16", sequence_parallel=False, hardware=hw, moe=True, recompute="none") | kw
    layer = price_layer(cfg.model, micro=1, axes=axes, spans=spans, dispatcher=dispatcher, expert_tensor=split, **kw)
    return layer, routing(cfg.model, tokens=2048, axes=axes, expert_tensor=split), cfg.model, hw


def test_the_all_to_all_dispatcher_regroups_its_copies_by_local_expert_each_way():
    """Megatron-Core's all-to-all dispatcher sorts the copies it receives by local expert and back: two moves
    of every copy (read and written) in the forward and two of their gradients in the backward; DeepEP's
    layout needs none, and neither does a device that holds one expert."""
    nccl, route, m, hw = _moe_layer("alltoall", 8)
    deepep, *_ = _moe_layer("deepep", 8)
    move = stream_time(2 * route.busiest * m.d_model * 2, ops=1, hardware=hw)  # 16-bit copies, read and written
    assert route.local_experts == 8 and route.busiest == 2048 * 4
    assert regroup_move_time(m, route, "alltoall", bytes_per_element=2, hardware=hw) == pytest.approx(move)
    assert nccl.forward_s - deepep.forward_s == pytest.approx(2 * move)
    assert nccl.backward_s - deepep.backward_s == pytest.approx(2 * move)
    assert regroup_move_time(m, route, "deepep", bytes_per_element=2, hardware=hw) == 0.0
    _, route8, m8, _ = _moe_layer("alltoall", 8, experts=8)  # one expert a device
    assert (
        route8.local_experts == 1 and regroup_move_time(m8, route8, "alltoall", bytes_per_element=2, hardware=hw) == 0
    )
    # one device with several experts still sorts its chunks (Megatron sorts whenever it holds more than one)
    one_device, route1, _, _ = _moe_layer("alltoall", 1)
    assert one_device.forward_s - _moe_layer("deepep", 1)[0].forward_s == pytest.approx(
        2 * stream_time(2 * route1.busiest * m.d_model * 2, ops=1, hardware=hw)
    )


@pytest.mark.parametrize("split", [True, False])
def test_the_regrouping_follows_the_copies_a_device_holds_under_tensor_parallelism(split):
    """Experts split over the tensor axis: every tensor rank holds the group's copies; experts spread over it
    (``parallel.expert_tensor: 1``): each rank its own share. A full recomputation re-runs the forward's two,
    whether it re-runs the whole forward (PyTorch's) or what the backward reads (JAX's: the routing weights'
    gradient reads the copies' outputs the combine brings back)."""
    nccl, route, m, hw = _moe_layer("alltoall", 4, tensor=2, expert_tensor=split)
    deepep, *_ = _moe_layer("deepep", 4, tensor=2, expert_tensor=split)
    move = stream_time(2 * route.busiest * m.d_model * 2, ops=1, hardware=hw)
    assert route.busiest == (2048 * 4 if split else 2048 * 4 / 2)
    assert nccl.forward_s - deepep.forward_s == pytest.approx(2 * move)
    for reforward, moves in (("whole", 2), ("needed", 2)):
        full = _moe_layer("alltoall", 4, tensor=2, expert_tensor=split, recompute="full", reforward=reforward)[0]
        full_deepep = _moe_layer("deepep", 4, tensor=2, expert_tensor=split, recompute="full", reforward=reforward)[0]
        assert full.recompute_s - full_deepep.recompute_s == pytest.approx(moves * move)
        # the exchanges: dispatch and combine in the forward, the backward and the re-forward
        assert full.expert_comm_s == pytest.approx((4 + moves) * full.exchange_s)


def test_the_forward_regrouping_moves_fp8_rows_where_the_dispatch_does():
    """Under train.fp8 the dispatch moves one-byte rows, so the regrouping after it does; the one before the
    combine and the backward's stay in the compute dtype."""
    from hyperjax.config import Fp8Config

    fp8 = Fp8Config(recipe="blockwise")
    nccl, route, m, hw = _moe_layer("alltoall", 8, fp8=fp8)
    deepep, *_ = _moe_layer("deepep", 8, fp8=fp8)
    move = lambda b: stream_time(2 * route.busiest * m.d_model * b, ops=1, hardware=hw)
    assert nccl.forward_s - deepep.forward_s == pytest.approx(move(1) + move(2))
    assert nccl.backward_s - deepep.backward_s == pytest.approx(2 * move(2))


def test_a_capacity_below_one_drops_copies_from_every_expert_and_prices_what_is_kept():
    """With ``moe.capacity_factor`` C, an expert computes at most C times its even share of the copies (the
    emulation drops the rest: half of them at C 0.5). Below 1 every expert is full, so the busiest device
    computes and exchanges C of the even share, and the layer is cheaper than at C 1; above 1 the load
    imbalance caps at C."""
    path = Path(__file__).parents[2] / "configs" / "mixtral-8x7b.yaml"
    cfg = {c: load_config(path, [f"model.moe.capacity_factor={c}"]).model for c in (0.5, 1.0, 1.25)}
    kw = dict(tokens=4096.0, axes={"tensor": 1, "expert": 8}, expert_tensor=True)
    routes = {c: routing(m, **kw) for c, m in cfg.items()}
    assert routes[0.5].busiest == pytest.approx(0.5 * routes[1.0].busiest)
    assert routes[1.0].imbalance == 1.0 and 1.0 <= routes[1.25].imbalance <= 1.25
    layer = {
        c: estimate(resolve(load_config(path, [f"model.moe.capacity_factor={c}"]))).stages[0].parts[-1].layer
        for c in (0.5, 1.0)
    }
    assert layer[0.5].exchange_s < 0.6 * layer[1.0].exchange_s  # half the bytes, the same latency
    assert layer[0.5].forward_s < layer[1.0].forward_s
