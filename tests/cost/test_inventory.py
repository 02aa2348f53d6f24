"""The analytic inventory of the training step agrees with what XLA compiles (8 emulated devices)."""

from pathlib import Path

import pytest
from flax import nnx

from hyperjax import load_config, make_mesh, resolve
from hyperjax.cost.hlo import read_compiled
from hyperjax.cost.inventory import runtime_inventory
from hyperjax.models import build_model
from hyperjax.train import Batches, build_train_step, init_state, make_optimizer, prepare
from tests.tiers import sweep

MOE_TINY = Path(__file__).parents[2] / "configs" / "moe-tiny.yaml"


def compiled_and_analytic(sets, config=None):
    run = resolve(load_config(config, ["model.layers=2", "train.global_batch=32", *sets]))
    cfg = run.config
    g, state = nnx.split(build_model(cfg.model))
    optimizer = make_optimizer(cfg.train)
    step = build_train_step(
        graphdef=g,
        param_state=state,
        strategy=prepare(run).strategy,
        mesh=make_mesh(run.hardware, run.axes),
        optimizer=optimizer,
        microbatches=run.microbatches,
        moe=cfg.model.moe,
        replicas=run.replica_axes,
    )
    batch = Batches(source="text", global_batch=32, seq_len=cfg.model.seq_len, vocab=256, seed=0)
    compiled = step.fn.lower(init_state(state, optimizer, step), batch.global_batch_arrays(0, step.batch_sharding))
    hlo = read_compiled(compiled.compile(), 8)
    return hlo, runtime_inventory(run)


STRATEGIES = [
    ["parallel.data=8"],
    ["parallel.fsdp=8"],
    ["parallel.tensor=8"],
    ["parallel.data=2", "parallel.tensor=4"],
    ["parallel.tensor=4", "parallel.sequence_parallel=true"],
    ["parallel.zero_stage=1", "parallel.data=8"],
    ["model.family=llama", "model.kv_heads=2", "parallel.tensor=2", "parallel.data=4"],
    ["parallel.fsdp=4", "parallel.tensor=2"],
    ["parallel.fsdp=2", "parallel.tensor=4"],
    ["parallel.context=8"],
    ["parallel.context=4"],  # with data=2: gradients reduced over context, then over data
    ["parallel.context=4", "parallel.fsdp=2"],
    ["parallel.context=2", "parallel.fsdp=2", "parallel.tensor=2"],
    ["parallel.context=2", "parallel.tensor=4"],
    ["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.data=2"],
    ["parallel.zero_stage=2", "parallel.data=4", "parallel.tensor=2", "model.family=llama"],
    # architectures described by their parts
    ["model.block=parallel", "parallel.tensor=4", "parallel.data=2"],
    ["model.block=parallel", "model.family=llama", "parallel.tensor=2", "parallel.sequence_parallel=true"],
    ["model.family=llama", "model.head_dim=48", "model.kv_heads=2", "parallel.tensor=2", "parallel.fsdp=4"],
    ["model.mlp=relu", "model.tie_embeddings=false", "parallel.tensor=4", "parallel.data=2"],
    ["model.mlp=geglu", "model.bias=false", "model.positions=rope", "parallel.tensor=2", "parallel.context=2"],
    ["parallel.zero_stage=1", "parallel.context=2", "parallel.data=4"],  # ZeRO over data x context
    ["parallel.fsdp=2", "parallel.context=2", "parallel.fsdp_context=true", "parallel.data=2"],
]


FAST_STRATEGIES = {4, 6, 12, 16, 20}  # the rest: `pytest -m slow`


@pytest.mark.parametrize(
    "sets", sweep(STRATEGIES, fast=FAST_STRATEGIES), ids=lambda s: ",".join(x.split(".")[-1] for x in s)
)
def test_flops_and_collective_bytes_agree(sets):
    hlo, analytic = compiled_and_analytic(sets)
    kinds = hlo.bytes_by_kind()
    assert set(kinds) <= {"all-reduce", "all-gather", "reduce-scatter"}  # no stray all-to-all or permute
    assert hlo.flops == pytest.approx(analytic.flops, rel=0.06)
    assert kinds["all-reduce"] + kinds["reduce-scatter"] == pytest.approx(analytic.reduce_bytes, rel=0.06)
    assert kinds["all-gather"] == pytest.approx(analytic.gather_bytes, rel=0.06, abs=1)


# mixtures of experts (moe-tiny's two blocks: a dense one, then 8 experts, top-2, one shared) under expert
# parallelism and what it composes with
EXPERT_LAYOUTS = [
    ["parallel.expert=2"],  # with data=4
    ["parallel.expert=4"],
    ["parallel.expert=8"],
    ["parallel.expert=2", "parallel.fsdp=2"],
    ["parallel.expert=2", "parallel.tensor=2"],
    ["parallel.expert=2", "parallel.tensor=2", "parallel.fsdp=2", "model.moe.shared_experts=0"],
    ["parallel.expert=4", "model.moe.capacity_factor=1.0"],
    ["parallel.expert=2", "parallel.context=2", "model.moe.capacity_factor=1.25"],
    ["parallel.expert=4", "model.family=gpt", "model.moe.first_dense=0", "model.moe.every=2"],
]


@pytest.mark.parametrize(
    "sets", sweep(EXPERT_LAYOUTS, fast={7}), ids=lambda s: ",".join(x.split(".", 1)[-1] for x in s)
)
def test_expert_parallel_inventories_agree(sets):
    hlo, analytic = compiled_and_analytic(sets, MOE_TINY)
    kinds, counts = hlo.bytes_by_kind(), hlo.count_by_kind()
    assert counts["all-to-all"] == analytic.all_to_alls > 0
    assert kinds["all-to-all"] == analytic.all_to_all_bytes
    assert hlo.flops == pytest.approx(analytic.flops, rel=0.06)
    assert kinds["all-reduce"] + kinds["reduce-scatter"] == pytest.approx(analytic.reduce_bytes, rel=0.06)
    assert kinds["all-gather"] == pytest.approx(analytic.gather_bytes, rel=0.06, abs=1)


def test_experts_spread_over_the_tensor_axis_exchange_as_counted():
    """With ``expert_tensor: 1`` the exchange runs over expert x tensor; sequence parallelism adds XLA's own
    all-to-alls (it reshards the rotary halves of queries and keys), which the exchange count leaves out."""
    sets = ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1"]
    hlo, analytic = compiled_and_analytic(sets, MOE_TINY)
    exchange = [c for c in hlo.collectives if c.kind == "all-to-all" and "shard_map" in c.source]
    assert len(exchange) == analytic.all_to_alls and {c.group_size for c in exchange} == {4}
    assert sum(c.result_bytes for c in exchange) == analytic.all_to_all_bytes
    assert hlo.flops == pytest.approx(analytic.flops, rel=0.06)


# each replica's gradients summed in flat buckets (parallel.gradient_buckets)
BUCKETED = [
    (None, ["parallel.data=8"]),
    (None, ["parallel.data=2", "parallel.tensor=4"]),
    (None, ["parallel.zero_stage=2", "parallel.data=4", "parallel.tensor=2", "model.family=llama"]),
    (None, ["parallel.context=4"]),
    (None, ["parallel.fsdp=2", "parallel.tensor=2"]),  # FSDP inside each replica, then the bucket over data
    (None, ["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.data=2"]),
    (MOE_TINY, ["parallel.expert=2"]),  # over data x expert, routed experts' over data
    (MOE_TINY, ["parallel.expert=8"]),  # over expert alone
    (MOE_TINY, ["parallel.expert=2", "parallel.fsdp=2"]),  # over data: fsdp stores parameters between
    (MOE_TINY, ["parallel.expert=4", "model.moe.capacity_factor=1.0"]),
]


@pytest.mark.parametrize(
    ("config", "sets"),
    sweep(BUCKETED, fast={6}),
    ids=[("moe:" if c else "") + ",".join(x.split(".", 1)[-1] for x in s) for c, s in BUCKETED],
)
def test_bucketed_inventories_agree(config, sets):
    hlo, analytic = compiled_and_analytic([*sets, "parallel.gradient_buckets=true"], config)
    kinds = hlo.bytes_by_kind()
    assert hlo.flops == pytest.approx(analytic.flops, rel=0.06)
    assert kinds["all-reduce"] + kinds["reduce-scatter"] == pytest.approx(analytic.reduce_bytes, rel=0.06)
    assert kinds["all-gather"] == pytest.approx(analytic.gather_bytes, rel=0.06, abs=1)
    assert kinds["all-to-all"] == analytic.all_to_all_bytes


def test_buckets_reduce_the_gradients_in_one_collective_of_one_array():
    plain, _ = compiled_and_analytic(["parallel.data=8"])
    bucketed, _ = compiled_and_analytic(["parallel.data=8", "parallel.gradient_buckets=true"])
    over_data = lambda hlo: [c for c in hlo.collectives if c.kind == "all-reduce" and c.group_size == 8]
    assert sum(c.arrays for c in over_data(plain)) > 10  # XLA: one array per parameter (a few combined ops)
    (bucket,) = over_data(bucketed)
    assert bucket.arrays == 1
    # the same bytes, but the tied embedding's two gradients are added on each replica first and cross once
    tied = 4 * 256 * 256
    assert bucket.result_bytes == pytest.approx(sum(c.result_bytes for c in over_data(plain)) - tied, abs=16)


def test_group_sizes_follow_the_mesh():
    hlo, _ = compiled_and_analytic(["parallel.data=2", "parallel.tensor=4"])
    sizes = {c.group_size for c in hlo.collectives}
    assert 4 in sizes  # tensor-parallel reductions run over the 4-device tensor axis
    assert sizes <= {2, 4, 8}


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}", 2),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, dimensions={0}", 8),
        ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, use", 2),
        ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}", 2),
        ("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add", 4),
        ("source_target_pairs={{0,1},{1,0}}", 8),
    ],
)
def test_replica_group_formats(text, size):
    from hyperjax.cost.hlo import _groups

    assert len(_groups(text, 8)[0]) == size


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}", (0, 4)),
        ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, use", (0, 1)),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}", (0, 1, 2, 3)),
        ("replica_groups={{0,2},{1,3},{4,6},{5,7}}, to_apply=%add", (0, 2)),
    ],
)
def test_replica_groups_are_read_whole(text, first):
    from hyperjax.cost.hlo import _groups

    groups = _groups(text, 8)
    assert groups[0] == first
    assert sorted(d for g in groups for d in g) == list(range(8))  # a partition of the devices
