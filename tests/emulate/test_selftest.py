import jax
import pytest

from hyperjax import axis_spans, load_hardware, make_mesh
from hyperjax.emulate import selftest

HW = load_hardware("cloudmatrix384")


@pytest.mark.parametrize("axes", [{"data": 2, "tensor": 4}, {"data": 1, "tensor": 8}, {"a": 2, "b": 2, "c": 2}])
def test_every_collective_matches_numpy(axes):
    mesh = make_mesh(HW, axes)
    checks = selftest.run_selftest(mesh, axis_spans(HW, axes), bytes_per_device=256, iters=1)
    assert len(checks) == len(axes) * len(selftest.COLLECTIVES)
    assert {(c.collective, c.axis) for c in checks} == {(c, a) for c in selftest.COLLECTIVES for a in axes}
    for c in checks:
        assert c.ok, c
        assert c.time_s > 0
        assert c.group_size == axes[c.axis]
        assert c.bytes_per_device % (4 * c.group_size) == 0


def test_wrong_collective_is_caught(monkeypatch):
    # a collective that silently does nothing must fail its check
    def broken(x, a, axis, n):
        _, expected = selftest._all_reduce(x, a, axis, n)
        return (lambda b: b), expected

    monkeypatch.setitem(selftest._CASES, "all_reduce", broken)
    axes = {"data": 2, "tensor": 4}
    checks = selftest.run_selftest(make_mesh(HW, axes), axis_spans(HW, axes), bytes_per_device=64, iters=1)
    failed = {(c.collective, c.axis) for c in checks if not c.ok}
    assert failed == {("all_reduce", "data"), ("all_reduce", "tensor")}
    assert jax.process_count() == 1
