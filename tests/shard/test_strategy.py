import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax import ShardingError, Strategy, load_hardware, make_mesh
from hyperjax.config import ModelConfig
from hyperjax.models import build_model

HW = load_hardware("cloudmatrix384")
RULES = {"batch": "data", "embed": None, "mlp": "tensor", "heads": "tensor", "seq": None}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(HW, {"data": 2, "tensor": 4})


def test_spec_is_a_pure_mapping():
    s = Strategy(rules={"batch": ("data", "fsdp"), "mlp": "tensor", "embed": None})
    assert s.spec(("batch", None, "mlp")) == P(("data", "fsdp"), None, "tensor")
    assert s.spec(("embed",)) == P(None)


def test_shardings_for_arrays_by_path_pattern(mesh):
    s = Strategy(rules=RULES, params={"*/w_in": ("embed", "mlp"), "w_out": ("mlp", "embed")})
    tree = {
        "block": {"w_in": jnp.zeros((8, 16))},
        "w_out": jax.ShapeDtypeStruct((16, 8), jnp.float32),
        "b": jnp.zeros(3),
    }
    sh = s.shardings(tree, mesh)
    assert sh["block"]["w_in"].spec == P(None, "tensor")
    assert sh["w_out"].spec == P("tensor", None)
    assert sh["b"].spec == P(None)  # no pattern: replicated


def test_shardings_for_nnx_state(mesh):
    model = build_model(ModelConfig(layers=1, d_model=64, heads=4, d_ff=128, seq_len=16))
    state = nnx.state(model)
    strategy = Strategy(rules={**RULES, "vocab": "tensor", "kv_heads": "tensor", "head_dim": None})
    sh = strategy.shardings(state, mesh)
    placed = jax.device_put(state, sh)
    kernel = placed["blocks"][0]["mlp"]["w_in"]
    assert kernel.get_value().sharding.spec == P(None, "tensor")
    assert placed["blocks"][0]["attn"]["q_proj"].get_value().sharding.spec == P(None, "tensor", None)


def test_constrain_inside_jit(mesh):
    s = Strategy(rules=RULES)
    x = jnp.ones((4, 8))
    out = jax.jit(lambda a: s.constrain(a * 2, ("batch", "mlp"), mesh=mesh))(x)
    assert out.sharding.spec == P("data", "tensor")
    with jax.set_mesh(mesh):
        out = jax.jit(lambda a: s.constrain(a, ("batch", None)))(x)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), 2)
    np.testing.assert_array_equal(out, x)


def test_explain(mesh):
    s = Strategy(rules=RULES, params={"w": ("embed", "mlp")})
    ex = s.explain({"w": jnp.zeros((8, 16)), "b": jnp.zeros((16,))}, mesh)
    rows = {r.path: r for r in ex.rows}
    assert rows["w"].bytes_per_device == 8 * 16 * 4 // 4
    assert rows["b"].bytes_per_device == 16 * 4
    assert ex.bytes_per_device == 8 * 4 * 4 + 64 and ex.bytes_total == 8 * 16 * 4 + 64
    assert ex.table().row_count == 3


def test_zero_adds_the_data_axis_where_it_divides(mesh):
    s = Strategy(rules=RULES, params={"w": ("embed", "mlp")}, zero_stage=1)
    tree = {"w": jnp.zeros((8, 16)), "count": jnp.zeros((), jnp.int32), "b": jnp.zeros((3, 4))}
    assert s.shardings(tree, mesh)["w"].spec == P(None, "tensor")
    opt = s.shardings(tree, mesh, role="optimizer")
    assert opt["w"].spec == P("data", "tensor") and opt["b"].spec == P(None, "data")  # the first it divides
    assert opt["count"].spec == P()  # a scalar (the optimizer's step count) has nothing to split
    assert s.shardings(tree, mesh, role="gradients")["w"].spec == P(None, "tensor")  # stage 1 keeps gradients
    s2 = Strategy(rules=RULES, params={"w": ("embed", "mlp")}, zero_stage=2)
    assert s2.shardings(tree, mesh, role="gradients")["w"].spec == P("data", "tensor")


@pytest.mark.parametrize("role", ["optimizer", "gradients"])
def test_zero_refuses_a_tensor_no_dimension_of_which_it_can_split(mesh, role):
    # (3, 4) with "mlp" over tensor 4 is (3, 1) a device: data's 2 divides neither
    s = Strategy(rules=RULES, params={"w": ("embed", "mlp")}, zero_stage=2)
    with pytest.raises(ShardingError) as e:
        s.shardings({"w": jnp.zeros((3, 4))}, mesh, role=role)
    message = str(e.value)
    for part in ["'w'", "(3, 4)", "('embed', 'mlp')", "zero_stage=2", "'data' (2 devices)", "(3, 1)", "zero_stage=0"]:
        assert part in message, (part, message)
    assert s.shardings({"w": jnp.zeros((3, 4))}, mesh)["w"].spec == P(None, "tensor")  # the weights are not ZeRO's


def test_with_param_axes_reaches_pure_copies(mesh):
    model = build_model(ModelConfig(layers=1, d_model=64, heads=4, d_ff=128, seq_len=16))
    state = nnx.state(model)
    s = Strategy(rules={**RULES, "vocab": "tensor", "kv_heads": "tensor", "head_dim": None}).with_param_axes(state)
    moments = {"mu": nnx.to_pure_dict(state)}
    assert s.shardings(moments, mesh)["mu"]["blocks"][0]["mlp"]["w_in"].spec == P(None, "tensor")
    assert s.shardings(moments, mesh)["mu"]["embed"].spec == P("tensor", None)


def test_error_not_divisible(mesh):
    s = Strategy(rules=RULES, params={"w": ("embed", "mlp")})
    with pytest.raises(
        ShardingError,
        match=r"tensor 'w': dimension 'mlp' of size 6 is not divisible by mesh axes \('tensor',\) of total size 4",
    ):
        s.shardings({"w": jnp.zeros((8, 6))}, mesh)


def test_error_axis_used_twice(mesh):
    s = Strategy(rules={"a": "tensor", "b": ("data", "tensor")}, params={"w": ("a", "b")})
    with pytest.raises(
        ShardingError, match=r"tensor 'w': mesh axis 'tensor' is used twice in one spec, by logical axes 'a' and 'b'"
    ):
        s.shardings({"w": jnp.zeros((8, 8))}, mesh)


def test_error_no_rule(mesh):
    s = Strategy(rules=RULES, params={"w": ("embed", "mpl")})
    with pytest.raises(ShardingError, match=r"tensor 'w': logical axis 'mpl' has no rule; did you mean 'mlp'\?"):
        s.shardings({"w": jnp.zeros((8, 8))}, mesh)
    with pytest.raises(ShardingError, match=r"'mlp' has no rule \(the rules are empty\); add one, e.g. rules=\{'mlp'"):
        Strategy(rules={}).spec(("mlp",))


def test_error_unknown_mesh_axis(mesh):
    s = Strategy(rules={"x": "expert"}, params={"w": ("x",)})
    with pytest.raises(
        ShardingError, match=r"maps to mesh axis 'expert', which the mesh \{'data': 2, 'tensor': 4\} does not have"
    ):
        s.shardings({"w": jnp.zeros((8,))}, mesh)


def test_error_rank_mismatch(mesh):
    s = Strategy(rules=RULES, params={"w": ("embed",)})
    with pytest.raises(
        ShardingError, match=r"tensor 'w' has shape \(8, 8\) \(2 dims\) but logical axes \('embed',\) \(1\)"
    ):
        s.shardings({"w": jnp.zeros((8, 8))}, mesh)


def test_error_bad_rule_and_zero_stage():
    with pytest.raises(ShardingError, match="rule for logical axis 'x' is 3"):
        Strategy(rules={"x": 3})
    with pytest.raises(ShardingError, match="zero_stage=3 must be 0, 1 or 2"):
        Strategy(rules={}, zero_stage=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rules": None}, r"rules=None must map logical axis names to a mesh axis"),
        ({"rules": [("mlp", "tensor")]}, r"rules=\[\('mlp', 'tensor'\)\] must map logical axis names"),
        ({"rules": {}, "params": {"w": "mlp"}}, r"params\['w'\]='mlp' is the string 'mlp', not a tuple .* \('mlp',\)"),
        ({"rules": {}, "params": {"w": None}}, r"params\['w'\]=None is a NoneType, not a tuple"),
        ({"rules": {}, "params": {"w": ("mlp", 3)}}, r"params\['w'\]=\('mlp', 3\) entry 1 \(3\) is neither a name"),
        ({"rules": {}, "params": [("w", ("mlp",))]}, r"params=\[.*\] must map key-path glob patterns"),
        ({"rules": {}, "zero_stage": "1"}, r"zero_stage='1' must be 0, 1 or 2"),
        ({"rules": {}, "zero_stage": True}, r"zero_stage=True must be 0, 1 or 2"),
        ({"rules": {}, "zero_axes": "data"}, r"zero_axes='data' must be a tuple of mesh axis names, e.g. \('data',\)"),
    ],
)
def test_error_malformed_strategy(kwargs, message):
    with pytest.raises(ShardingError, match=message):
        Strategy(**kwargs)


def test_error_malformed_calls(mesh):
    s = Strategy(rules=RULES, params={"w": ("embed", "mlp")}, zero_stage=2)
    tree = {"w": jnp.zeros((8, 8))}
    with pytest.raises(ShardingError, match=r"role='optimiser' is not one of params, gradients, optimizer"):
        s.shardings(tree, mesh, role="optimiser")
    with pytest.raises(ShardingError, match=r"mesh='cloudmatrix384' is a str, not a jax.sharding.Mesh"):
        s.explain(tree, "cloudmatrix384")
    with pytest.raises(ShardingError, match=r"logical axes 'batch' must be a sequence .* e.g. \('batch',\)"):
        s.spec("batch")
    with pytest.raises(ShardingError, match=r"logical axis \['batch'\] is a list; give a logical axis name"):
        s.spec((["batch"],))
    missing = Strategy(rules=RULES, params=s.params, zero_stage=1, zero_axes=("dp",))
    with pytest.raises(ShardingError, match=r"shards the optimizer over zero_axes=\('dp',\), none of which the mesh"):
        missing.shardings(tree, mesh, role="optimizer")
    assert missing.shardings(tree, mesh)["w"].spec == P(None, "tensor")  # parameters take no ZeRO axis
    some = Strategy(rules=RULES, params=s.params, zero_stage=1, zero_axes=("data", "context"))
    assert some.shardings(tree, mesh, role="optimizer")["w"].spec == P("data", "tensor")  # over those it has


@pytest.mark.parametrize(
    ("shape", "axes", "message"),
    [
        ((8, 250), ("batch", "mlp"), r"dimension 'mlp' of size 250 is not divisible by mesh axes \('tensor',\)"),
        ((8, 256, 2), ("batch",), r"has shape \(8, 256, 2\) \(3 dims\) but logical axes \('batch',\) \(1\)"),
        ((8,), ("batch", "mlp"), r"has shape \(8,\) \(1 dims\) but logical axes"),
        ((8, 8), ("batch", "dp"), r"logical axis 'dp' has no rule"),
        ((8, 8), ("batch", "data2"), r"logical axis 'data2' maps to mesh axis 'dp', which the mesh"),
        (
            (8, 8),
            ("batch", "twice"),
            r"mesh axis 'data' is used twice in one spec, by logical axes 'batch' and 'twice'",
        ),
    ],
)
@pytest.mark.parametrize("traced", [True, False])
def test_error_constrain_checks_as_shardings_does(mesh, shape, axes, message, traced):
    s = Strategy(rules={**RULES, "data2": "dp", "twice": "data"})
    f = lambda a: s.constrain(a, axes, mesh=mesh)
    with pytest.raises(ShardingError, match=r"^x in constrain\(x, .*\):? " + message):
        (jax.jit(f) if traced else f)(jnp.ones(shape))


def test_a_strategy_pickles_copies_and_hashes(mesh):
    import copy
    import pickle

    s = Strategy(rules=RULES, params={"w": ("embed", "mlp")}, zero_stage=1, zero_axes=("data",))
    for other in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert other == s and hash(other) == hash(s)
        assert other.shardings({"w": jnp.zeros((8, 8))}, mesh)["w"].spec == P(None, "tensor")
    f = jax.jit(lambda x, strategy: strategy.constrain(x, ("batch", "mlp"), mesh=mesh), static_argnums=1)
    assert f(jnp.ones((8, 8)), s).sharding.spec == P("data", "tensor")
    # rules in any order are one strategy; params are not, the first matching pattern winning
    flipped = Strategy(rules=dict(reversed(RULES.items())), params=s.params, zero_stage=1, zero_axes=("data",))
    assert flipped == s and hash(flipped) == hash(s)
    first, second = {"a/*": ("embed", "mlp")}, {"*/w": ("mlp", "embed")}
    assert Strategy(rules=RULES, params=first | second) != Strategy(rules=RULES, params=second | first)


def test_a_pattern_that_matches_nothing_while_a_tensor_goes_unnamed_is_a_misspelling(mesh):
    s = Strategy(rules=RULES, params={"w_inn": ("embed", "mlp"), "w_out": ("mlp", "embed")})
    tree = {"w_in": jnp.zeros((8, 8)), "w_out": jnp.zeros((8, 8)), "step": jnp.zeros(())}
    with pytest.raises(ShardingError, match=r"pattern 'w_inn' matches no tensor .*w_in: it carries no logical axes"):
        s.shardings(tree, mesh)
    with pytest.raises(ShardingError, match=r"did you mean 'w_in'\?"):
        s.explain(tree, mesh)
    # a tree of some of the tensors, every one named: the patterns for the others are not for it
    assert s.shardings({"w_out": jnp.zeros((8, 8)), "step": jnp.zeros(())}, mesh)["w_out"].spec == P("tensor", None)
    # the optimizer's copies under other paths would be replicated: said, not done
    right = Strategy(rules=RULES, params={"w_out": ("mlp", "embed")})
    with pytest.raises(ShardingError, match=r"'w_out' matches no tensor of the tree, and mu/w_out: it carries"):
        right.shardings({"mu": {"w_out": jnp.zeros((8, 8))}}, mesh)


def test_the_patterns_a_state_adds_may_match_nothing(mesh):
    import pickle

    model = build_model(ModelConfig(layers=1, d_model=64, heads=4, d_ff=128, seq_len=16))
    state = nnx.state(model)
    rules = {**RULES, "vocab": "tensor", "kv_heads": "tensor", "head_dim": None}
    s = Strategy(rules=rules).with_param_axes(state)
    pure = nnx.to_pure_dict(state)  # the '*/...' patterns match nothing here, and that is no mistake
    assert s.shardings(pure, mesh)["blocks"][0]["mlp"]["w_in"].spec == P(None, "tensor")
    assert pickle.loads(pickle.dumps(s)).shardings({"mu": pure}, mesh)["mu"]["embed"].spec == P("tensor", None)


def test_with_param_axes_gives_moments_the_axes_of_the_longest_path_they_end_with(mesh):
    import optax

    param = lambda shape, axes: nnx.Param(jnp.ones(shape), out_sharding=axes, eager_sharding=False)
    state = nnx.State(
        {
            "out": {"kernel": param((16, 64), ("embed", "mlp"))},
            "stages": {"0": {"out": {"kernel": param((64, 16), ("mlp", "embed"))}}},
        }
    )
    s = Strategy(rules=RULES)
    opt = optax.adam(1e-3).init(nnx.to_pure_dict(state))
    placed = s.with_param_axes(state).shardings(opt, mesh, role="optimizer")
    assert s.shardings(state, mesh)["stages"]["0"]["out"]["kernel"].get_value().spec == P("tensor", None)
    for moment in (placed[0].mu, placed[0].nu):
        assert moment["stages"]["0"]["out"]["kernel"].spec == P("tensor", None)
        assert moment["out"]["kernel"].spec == P(None, "tensor")


def test_with_param_axes_does_not_hold_the_copies_to_the_patterns_that_named_the_state(mesh):
    import optax

    s = Strategy(rules=RULES, params={"w_in": ("embed", "mlp")}, zero_stage=1)
    params = {"w_in": jnp.ones((64, 256)), "b_in": jnp.zeros((256,))}  # b_in replicated on purpose
    opt = optax.adam(1e-3).init(params)
    placed = s.with_param_axes(params).shardings(opt, mesh, role="optimizer")
    assert placed[0].mu["w_in"].spec == P("data", "tensor")
    with pytest.raises(ShardingError, match=r"pattern 'w_in' matches no tensor"):
        s.shardings(opt, mesh, role="optimizer")  # without the state's patterns the moments would go unnamed


def test_a_pattern_naming_other_axes_than_a_tensors_annotation_is_refused(mesh):
    state = nnx.State({"kernel": nnx.Param(jnp.ones((64, 256)), out_sharding=("embed", "mlp"), eager_sharding=False)})
    with pytest.raises(
        ShardingError,
        match=r"tensor 'kernel': its sharding metadata names logical axes \('embed', 'mlp'\), but params pattern "
        r"'kernel' names \('mlp', 'embed'\)",
    ):
        Strategy(rules=RULES, params={"kernel": ("mlp", "embed")}).shardings(state, mesh)
    agreeing = Strategy(rules=RULES, params={"kernel": ("embed", "mlp")})
    assert agreeing.shardings(state, mesh)["kernel"].get_value().spec == P(None, "tensor")


def test_spec_refuses_a_mesh_axis_named_by_two_dimensions():
    s = Strategy(rules={"batch": "data", "embed": "data"})
    with pytest.raises(ShardingError, match=r"spec\(\('batch', 'embed'\)\): mesh axis 'data' is used twice"):
        s.spec(("batch", "embed"))


def test_explain_counts_a_prng_keys_bytes(mesh):
    state = nnx.state(nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=0)))
    table = Strategy(rules={}).explain(state, mesh)
    keys = [row for row in table.rows if row.path.endswith("key")]
    assert keys and keys[0].bytes_total == 8  # a threefry key: two uint32 words


def test_linen_boxes_name_their_tensors_axes(mesh):
    from flax import linen as nn

    dense = nn.Dense(64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))
    variables = dense.init(jax.random.key(0), jnp.ones((2, 16)))
    placed = Strategy(rules=RULES).shardings(variables["params"], mesh)
    assert isinstance(placed["kernel"], nn.Partitioned)
    assert placed["kernel"].value.spec == P(None, "tensor")
    assert placed["bias"].spec == P(None)
    logical = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
    boxed = nn.Dense(16, kernel_init=logical).init(jax.random.key(0), jnp.ones((2, 64)))["params"]
    assert Strategy(rules=RULES).shardings(boxed, mesh)["kernel"].value.spec == P("tensor", None)


def test_constrain_on_a_mesh_of_explicit_axes_reshards():
    explicit = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    s = Strategy(rules={"batch": "data", "mlp": "tensor"})
    x = jnp.arange(8 * 64.0).reshape(8, 64)
    with jax.set_mesh(explicit):
        y = jax.jit(lambda x: s.constrain(x * 2, ("batch", "mlp")))(x)
    assert y.sharding.spec == P("data", "tensor")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    with pytest.raises(ShardingError, match=r"Explicit axes.*jax.set_mesh"):
        jax.jit(lambda x: s.constrain(x, ("batch", "mlp"), mesh=explicit))(x)


def test_constrain_with_an_abstract_mesh_needs_its_devices(mesh):
    """An AbstractMesh names no devices: under jit with none set it was applied to a step compiled for one
    device (silently unsharded), and outside jit JAX raised its own TypeError. Where the devices are known (set
    around the call, or the array already on them) it constrains."""
    s = Strategy(rules={"a": "tensor"})
    x = jnp.ones((8, 4))
    for call in (lambda: jax.jit(lambda y: s.constrain(y, ("a", None), mesh=mesh.abstract_mesh))(x),
                 lambda: s.constrain(x, ("a", None), mesh=mesh.abstract_mesh)):  # fmt: skip
        with pytest.raises(ShardingError, match=r"mesh= is an AbstractMesh .* names no devices.*jax.set_mesh"):
            call()
    with jax.set_mesh(mesh):
        out = jax.jit(lambda y: s.constrain(y, ("a", None), mesh=mesh.abstract_mesh))(x)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("tensor", None)), 2)
    on = jax.device_put(x, NamedSharding(mesh, P()))
    assert s.constrain(on, ("a", None), mesh=mesh.abstract_mesh).sharding.spec == P("tensor", None)


def test_constrain_inside_shard_map_uses_its_mesh_and_refuses_its_manual_axes(mesh):
    """Inside a shard_map the axes it maps are manual: a constraint over the others takes the shard_map's mesh
    (JAX's ValueError before, given mesh=), one over a manual axis is refused by name; a list is no array."""
    s = Strategy(rules={"a": "tensor"})
    x = jnp.arange(32.0).reshape(8, 4)
    mapped = jax.shard_map(
        lambda y: s.constrain(y * 2, (None, "a"), mesh=mesh),
        mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"},
    )  # fmt: skip
    np.testing.assert_array_equal(jax.jit(mapped)(x), np.asarray(x) * 2)
    every = jax.shard_map(lambda y: s.constrain(y, ("a", None)), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with jax.set_mesh(mesh), pytest.raises(ShardingError, match=r"mesh axes \['tensor'\] are manual"):
        jax.jit(every)(x)
    with pytest.raises(ShardingError, match="x is a list, not an array"):
        s.constrain([[1.0] * 4] * 8, ("a", None), mesh=mesh)


def test_a_numpy_integer_zero_stage_is_taken_as_its_value():
    assert Strategy(rules={}, zero_stage=np.int64(1)) == Strategy(rules={}, zero_stage=1)
    with pytest.raises(ShardingError, match="zero_stage=True must be 0, 1 or 2"):
        Strategy(rules={}, zero_stage=True)
