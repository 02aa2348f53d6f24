"""FP8 products: scales by recipe, the cast's range and format, products and gradients close to float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyperjax.config import Fp8Config
from hyperjax.models import fp8 as F

RECIPES = ["tensorwise", "rowwise", "blockwise"]
rng = np.random.default_rng(0)
X = jnp.asarray(rng.normal(size=(2, 8, 256)), jnp.float32)
W = jnp.asarray(rng.normal(size=(256, 4, 64)) * 0.02, jnp.float32)
SPEC = "bsd,dhk->bshk"


def test_a_tensorwise_scale_maps_the_amax_to_the_formats_largest_value():
    q = F.quantize(X, (F.WHOLE,) * 3, jnp.float8_e4m3fn)
    assert q.q.dtype == jnp.float8_e4m3fn and q.scale.shape == ()  # one scalar for the tensor
    assert float(jnp.max(jnp.abs(q.q.astype(jnp.float32)))) == 448.0  # E4M3's largest finite value
    np.testing.assert_allclose(float(q.scale), float(jnp.max(jnp.abs(X))) / 448.0, rtol=1e-6)
    e5 = F.quantize(X, (F.WHOLE,) * 3, jnp.float8_e5m2)
    assert float(jnp.max(jnp.abs(e5.q.astype(jnp.float32)))) == 57344.0


def test_scales_follow_the_grain():
    rows = F.quantize(X, (F.EACH, F.EACH, F.WHOLE), jnp.float8_e4m3fn)
    np.testing.assert_allclose(rows.scale[..., 0], jnp.max(jnp.abs(X), -1) / 448.0, rtol=1e-6)
    tiles = F.quantize(X, (F.EACH, F.EACH, 128), jnp.float8_e4m3fn)
    second = jnp.max(jnp.abs(X[..., 128:]), -1) / 448.0
    np.testing.assert_allclose(tiles.scale[..., 200], second, rtol=1e-6)
    assert not np.allclose(tiles.scale[..., 0], tiles.scale[..., 200])


def test_a_partial_last_tile_and_an_all_zero_cell():
    x = jnp.concatenate([jnp.zeros((3, 128)), jnp.ones((3, 64))], axis=1)
    q = F.quantize(x, (F.EACH, 128), jnp.float8_e4m3fn)
    assert jnp.all(q.scale[:, :128] == 1.0) and jnp.all(F.dequantize(q)[:, :128] == 0)
    np.testing.assert_array_equal(F.dequantize(q)[:, 128:], 1.0)


def test_quantizing_twice_gives_the_same_fp8_values():
    grain = (F.EACH, F.EACH, 128)
    once = F.quantize(X, grain, jnp.float8_e4m3fn)
    twice = F.quantize(F.dequantize(once), grain, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(twice.q.astype(jnp.float32), once.q.astype(jnp.float32))
    np.testing.assert_allclose(twice.scale, once.scale, rtol=3e-7)


@pytest.mark.parametrize("recipe", RECIPES)
def test_products_and_gradients_are_close_to_float32(recipe):
    cfg = Fp8Config(recipe=recipe)
    ref = jnp.einsum(SPEC, X, W)
    got = F.product(SPEC, X, W, fp8=cfg)
    assert float(jnp.abs(got - ref).max() / jnp.abs(ref).max()) < 0.06  # E4M3 keeps 3 mantissa bits
    loss = lambda x, w: jnp.sum(jnp.sin(F.product(SPEC, x, w, fp8=cfg)))
    exact = lambda x, w: jnp.sum(jnp.sin(jnp.einsum(SPEC, x, w)))
    for g, r in zip(jax.grad(loss, (0, 1))(X, W), jax.grad(exact, (0, 1))(X, W), strict=True):
        assert float(jnp.abs(g - r).max() / jnp.abs(r).max()) < 0.1  # E5M2 gradients keep 2
        assert 0.5 < float(jnp.vdot(g.ravel(), r.ravel()) / jnp.vdot(r.ravel(), r.ravel())) < 1.5


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_products_and_gradients_are_close_to_float32(recipe):
    cfg = Fp8Config(recipe=recipe)
    x = jnp.asarray(rng.normal(size=(10, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 64, 128)) * 0.05, jnp.float32)
    sizes, group = jnp.array([4, 3, 2], jnp.int32), jnp.array([0] * 4 + [1] * 3 + [2] * 2 + [3], jnp.int32)
    low = lambda a, b: jnp.sum(jnp.sin(F.grouped_product(a, b, sizes, group, cfg, F.GroupAxes())))
    exact = lambda a, b: jnp.sum(jnp.sin(jax.lax.ragged_dot(a, b, sizes)))
    assert abs(float(low(x, w)) - float(exact(x, w))) < 0.05 * abs(float(exact(x, w))) + 0.05
    for g, r in zip(jax.grad(low, (0, 1))(x, w), jax.grad(exact, (0, 1))(x, w), strict=True):
        assert float(jnp.abs(g - r).max() / jnp.abs(r).max()) < 0.15


def test_hybrid_quantizes_gradients_in_e5m2_and_e4m3_in_e4m3():
    assert F.gradient_dtype(Fp8Config(format="hybrid")) == jnp.float8_e5m2
    assert F.gradient_dtype(Fp8Config(format="e4m3")) == jnp.float8_e4m3fn
    assert F.forward_dtype(Fp8Config()) == jnp.float8_e4m3fn


def test_recording_sees_each_products_operands_as_fp8_holds_them():
    with F.recording() as found:
        F.product(SPEC, X, W, fp8=Fp8Config())
    ((x, w),) = found
    np.testing.assert_array_equal(x, F.qdq(X, (F.WHOLE,) * 3, jnp.float8_e4m3fn))
    assert w.shape == W.shape
