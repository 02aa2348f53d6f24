"""Strategy on models annotated the flax way, and ``Strategy.constrain`` with the mesh from ``jax.set_mesh``.

flax 0.12.8 stores every sharding annotation of a variable under the metadata key ``out_sharding``, as the
value it was given: ``nnx.with_partitioning(init, ("embed", "hidden"))`` and ``nnx.Param(v, out_sharding=...)``
a tuple of names (nested tuples for a dimension over several axes), ``nnx.with_partitioning(init, P(...))`` a
``PartitionSpec``; the deprecated ``sharding_names=`` and ``sharding=`` keywords warn and are renamed to
``out_sharding``. Creating such a variable shards it at once, so flax's docs create the model under
``jax.set_mesh(mesh)`` with ``nnx.logical_axis_rules`` mapping its logical names to mesh axes.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax import ShardingError, Strategy, load_hardware, make_mesh

# flax's own mapping from the model's logical names to mesh axes, as its sharding guide writes it; flax uses it
# to place the model when it is created. The Strategy below maps the same names differently, on purpose.
FLAX_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))
RULES = {"batch": "data", "embed": "data", "hidden": "model"}
DEPTH = 16


class LogicalDotReluDot(nnx.Module):
    """flax's ``LogicalDotReluDot`` (Scale up on multiple devices, "Logical axis annotation"), plus a head."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, ("embed", "hidden")),
            use_bias=False,
            rngs=rngs,
        )
        self.dot2 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, ("hidden", "embed")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",)),
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), sharding_names=("hidden", "embed"))
        self.head = nnx.Linear(depth, 4, rngs=rngs)  # no annotation: placed by ``params`` patterns

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.dot2(self.dot1(x)))
        return self.head(y @ self.w2[...])


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(scope="module")
def model(mesh):
    with (
        jax.set_mesh(mesh),
        nnx.logical_axis_rules(FLAX_RULES),
        pytest.warns(DeprecationWarning, match="'sharding_names' is deprecated, use 'out_sharding' instead"),
    ):
        return LogicalDotReluDot(DEPTH, rngs=nnx.Rngs(0))


def test_what_flax_stores(model):
    assert model.dot1.kernel.get_metadata()["out_sharding"] == ("embed", "hidden")
    assert model.dot2.bias.get_metadata()["out_sharding"] == ("embed",)
    meta = model.w2.get_metadata()
    assert meta["out_sharding"] == ("hidden", "embed") and "sharding_names" not in meta
    assert "out_sharding" not in model.head.kernel.get_metadata()
    # flax placed it with its own rules when it was created
    assert model.dot1.kernel.get_value().sharding.spec == P(None, "model")


def test_shardings_place_a_flax_annotated_model(model, mesh):
    strategy = Strategy(rules=RULES, params={"head/kernel": ("embed", None)})
    state = nnx.state(model)
    sh = strategy.shardings(state, mesh)
    expected = {
        "dot1/kernel": P("data", "model"),
        "dot2/kernel": P("model", "data"),
        "dot2/bias": P("data"),
        "w2": P("model", "data"),
        "head/kernel": P("data", None),  # no metadata: the params pattern
        "head/bias": P(None),  # no metadata, no pattern: replicated
    }
    flat = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(sh)}
    assert {k: v.get_value().spec for k, v in flat.items()} == expected

    placed = jax.device_put(state, sh)
    flat = {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(placed)}
    assert {k: v.get_value().sharding.spec for k, v in flat.items()} == expected
    np.testing.assert_array_equal(placed["w2"].get_value(), model.w2.get_value())


def test_logical_axes_explain_and_param_axes_read_flax_metadata(model, mesh):
    strategy = Strategy(rules=RULES)
    state = nnx.state(model)
    axes = strategy.logical_axes(state)
    assert axes["dot1"]["kernel"] == ("embed", "hidden") and axes["w2"] == ("hidden", "embed")
    assert axes["head"]["kernel"] is None
    rows = {r.path: r for r in strategy.explain(state, mesh).rows}
    assert rows["w2"].spec == P("model", "data") and rows["w2"].bytes_per_device == DEPTH * DEPTH * 4 // 8
    moments = {"mu": nnx.to_pure_dict(state)}
    assert strategy.with_param_axes(state).shardings(moments, mesh)["mu"]["dot2"]["kernel"].spec == P("model", "data")


@pytest.mark.parametrize("keyword", ["out_sharding", "sharding_names", "sharding"])
def test_every_param_keyword_is_read(keyword, mesh):
    warns = (
        contextlib.nullcontext()
        if keyword == "out_sharding"
        else pytest.warns(DeprecationWarning, match=f"'{keyword}' is deprecated")
    )
    with jax.set_mesh(mesh), nnx.logical_axis_rules(FLAX_RULES), warns:
        param = nnx.Param(jnp.zeros((8, 4)), **{keyword: ("embed", "hidden")})
    assert param.get_metadata()["out_sharding"] == ("embed", "hidden")
    assert Strategy(rules=RULES).shardings({"w": param}, mesh)["w"].get_value().spec == P("data", "model")


def test_partition_spec_annotation(mesh):
    with jax.set_mesh(mesh), nnx.logical_axis_rules(FLAX_RULES):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), P("embed", "hidden"))
        linear = nnx.Linear(8, 16, kernel_init=init, use_bias=False, rngs=nnx.Rngs(0))
    assert linear.kernel.get_metadata()["out_sharding"] == P("embed", "hidden")
    assert Strategy(rules=RULES).shardings(nnx.state(linear), mesh)["kernel"].get_value().spec == P("data", "model")


def test_dimension_over_several_axes(mesh):
    # flax applies rules to whole names only, so a nested annotation it can place names mesh axes
    with jax.set_mesh(mesh):
        linear = nnx.Linear(
            8,
            4,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (("data", "model"), None)),
            use_bias=False,
            rngs=nnx.Rngs(0),
        )
    assert linear.kernel.get_metadata()["out_sharding"] == (("data", "model"), None)
    strategy = Strategy(rules={"data": "data", "model": "model"})
    assert strategy.shardings(nnx.state(linear), mesh)["kernel"].get_value().spec == P(("data", "model"), None)
    # names in a nested entry are logical axes too, each through the rules
    with nnx.use_eager_sharding(False):
        param = nnx.Param(jnp.zeros((8, 4)), out_sharding=(("batch", "hidden"), None))
    assert Strategy(rules=RULES).shardings({"w": param}, mesh)["w"].get_value().spec == P(("data", "model"), None)


def test_hyperjax_logical_axes_still_win(mesh):
    param = nnx.Param(jnp.zeros((8, 4)), logical_axes=("embed", "hidden"))
    assert Strategy(rules=RULES).shardings({"w": param}, mesh)["w"].get_value().spec == P("data", "model")


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            {"logical_axes": ("embed", 3)},
            r"tensor 'blocks/0/w': cannot read logical axes from its sharding metadata "
            r"\{'logical_axes': \('embed', 3\)\}: logical_axes entry 1 \(3\) is neither a name, None nor a tuple",
        ),
        (
            {"out_sharding": "embed", "eager_sharding": False},
            r"tensor 'blocks/0/w': cannot read logical axes from its sharding metadata \{'out_sharding': 'embed'\}: "
            r"out_sharding is the string 'embed', not a tuple of logical axis names",
        ),
        (
            {"out_sharding": P("embed", P.UNCONSTRAINED), "eager_sharding": False},
            r"tensor 'blocks/0/w': .*out_sharding entry 1 \(UNCONSTRAINED\) is neither",
        ),
        (
            {"out_sharding": ("embed", ("hidden", None)), "eager_sharding": False},
            r"tensor 'blocks/0/w': .*out_sharding entry 1 \(\('hidden', None\)\) is neither",
        ),
        (
            {"logical_axes": ("embed", None), "out_sharding": ("hidden", None), "eager_sharding": False},
            r"tensor 'blocks/0/w': its sharding metadata \{'logical_axes': \('embed', None\), 'out_sharding': "
            r"\('hidden', None\)\} name different logical axes; keep one of logical_axes, out_sharding",
        ),
    ],
)
def test_error_unreadable_metadata(metadata, message, mesh):
    tree = {"blocks": [{"w": nnx.Param(jnp.zeros((8, 4)), **metadata)}]}
    strategy = Strategy(rules=RULES)
    with pytest.raises(ShardingError, match=message):
        strategy.shardings(tree, mesh)
    with pytest.raises(ShardingError, match=message):
        strategy.logical_axes(tree)


def test_error_named_sharding_metadata(mesh):
    # flax accepts a NamedSharding (it places the variable on that mesh); its names are not logical axes
    param = nnx.Param(jnp.zeros((8, 4)), out_sharding=NamedSharding(mesh, P("data", None)))
    with pytest.raises(ShardingError, match=r"tensor 'w': .*out_sharding is a NamedSharding, not a tuple"):
        Strategy(rules=RULES).shardings({"w": param}, mesh)


# --- Strategy.constrain with the mesh from jax.set_mesh ---------------------------------------------------


@pytest.fixture(scope="module")
def auto_mesh():
    return make_mesh(load_hardware("cloudmatrix384"), {"data": 2, "tensor": 4})


def test_constrain_uses_the_mesh_set_with_set_mesh(auto_mesh):
    s = Strategy(rules={"batch": "data", "mlp": "tensor"})
    x = jnp.arange(32.0).reshape(4, 8)
    with jax.set_mesh(auto_mesh):
        out = jax.jit(lambda a: s.constrain(a * 2, ("batch", "mlp")))(x)
        eager = s.constrain(x, ("batch", None))
    assert out.sharding.spec == P("data", "tensor")
    np.testing.assert_array_equal(out, x * 2)
    assert eager.sharding.is_equivalent_to(NamedSharding(auto_mesh, P("data", None)), 2)


def test_error_constrain_without_a_mesh():
    s = Strategy(rules={"batch": "data", "mlp": "tensor"})
    message = r"constrain\(x, \('batch', 'mlp'\)\) has no mesh: pass mesh=, or set one .*`with jax\.set_mesh\(mesh\):`"
    with pytest.raises(ShardingError, match=message):
        jax.jit(lambda a: s.constrain(a, ("batch", "mlp")))(jnp.ones((4, 8)))
    with pytest.raises(ShardingError, match=message):
        s.constrain(jnp.ones((4, 8)), ("batch", "mlp"))
