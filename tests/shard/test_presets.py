import pytest
from jax.sharding import PartitionSpec as P

from hyperjax import ShardingError
from hyperjax.shard import LOGICAL_AXES, mesh_axes_for, strategy_for


def test_data_takes_the_rest():
    assert mesh_axes_for(devices=384, tensor=8) == {"data": 48, "fsdp": 1, "expert": 1, "context": 1, "tensor": 8}
    assert mesh_axes_for(devices=8, data=2, fsdp=2, context=1, tensor=2) == {
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "context": 1,
        "tensor": 2,
    }


def test_degrees_must_multiply_to_devices():
    with pytest.raises(
        ShardingError,
        match=r"data=2 x fsdp=1 x expert=1 x context=1 x tensor=2 x pipeline=1 = 4, but there are 8 devices",
    ):
        mesh_axes_for(devices=8, data=2, tensor=2)
    with pytest.raises(ShardingError, match=r"= 3 do not divide the 8 devices"):
        mesh_axes_for(devices=8, tensor=3)
    with pytest.raises(ShardingError, match=r"parallel.tensor=0 must be a positive integer"):
        mesh_axes_for(devices=8, tensor=0)


def test_rules():
    s = strategy_for()
    assert s.spec(("batch", "res_seq", "act_embed")) == P(("data", "fsdp", "expert"), "context", None)
    assert s.spec(("embed", "mlp")) == P("fsdp", "tensor")
    sp = strategy_for(sequence_parallel=True)
    assert sp.spec(("batch", "res_seq", "act_embed")) == P(("data", "fsdp", "expert"), ("context", "tensor"), None)
    assert sp.spec(("batch", "seq", "act_mlp")) == P(("data", "fsdp", "expert"), "context", "tensor")
    # torchtitan's FSDP over dp_shard x cp: parameters over both, the sequence still over context
    fc = strategy_for(fsdp_context=True)
    assert fc.spec(("embed", "mlp")) == P(("fsdp", "context"), "tensor")
    assert fc.spec(("batch", "seq", "act_mlp")) == P(("data", "fsdp", "expert"), "context", "tensor")


def test_overrides():
    s = strategy_for(overrides={"vocab": None, "embed": ["fsdp", "data"]})
    assert s.spec(("vocab", "embed")) == P(None, ("fsdp", "data"))
    with pytest.raises(
        ShardingError,
        match=r"shard.vocab: mesh axis 'tensr' does not exist; the mesh axes are data, fsdp, expert, context, tensor",
    ):
        strategy_for(overrides={"vocab": "tensr"})


@pytest.mark.parametrize("flags", [{}, {"sequence_parallel": True, "expert_tensor": False, "fsdp_context": True}])
def test_logical_axes_are_the_rules_names(flags):
    """A config's shard: may map exactly the logical axes the rules give (the names the models use)."""
    assert tuple(strategy_for(zero_stage=0, **flags).rules) == LOGICAL_AXES
