"""Gradient buckets: per-replica values summed in flat buffers, inside processes first where they span several."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyperjax import ShardingError, Strategy, make_mesh
from hyperjax.config.run import spans_processes as config_spans
from hyperjax.shard.replicas import bucket_sum, check_replicas, host_blocks, manual_part


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


@dataclasses.dataclass(frozen=True)
class FakeMesh:
    devices: np.ndarray
    axis_names: tuple[str, ...]

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.devices.shape, strict=True))


def spans_processes(mesh: FakeMesh, axes: list[str]) -> bool:
    """Whether the groups along ``axes`` hold devices of several processes, read from the devices."""
    if not axes:
        return False
    process = np.vectorize(lambda d: d.process_index)(mesh.devices)
    moved = np.moveaxis(process, [mesh.axis_names.index(a) for a in axes], list(range(-len(axes), 0)))
    along = moved.reshape(-1, int(np.prod([mesh.shape[a] for a in axes])))
    return bool((along != along[:, :1]).any())


def fake_mesh(shape: dict[str, int], per_process: int) -> FakeMesh:
    n = int(np.prod(list(shape.values())))
    devices = np.array([FakeDevice(i, i // per_process) for i in range(n)], dtype=object).reshape(tuple(shape.values()))
    return FakeMesh(devices, tuple(shape))


@pytest.mark.parametrize(
    ("shape", "per_process", "blocks", "spans"),
    [
        ({"data": 48, "tensor": 8}, 32, {"data": 4}, True),  # gpt-tiny-cm384: 4 replicas per process
        ({"data": 4, "tensor": 2}, 4, {"data": 2}, True),
        ({"data": 4, "tensor": 2}, 8, {}, False),  # one process
        ({"data": 4, "tensor": 2}, 2, {}, True),  # one replica per process: no sum inside a process
        ({"data": 2, "expert": 48, "tensor": 4}, 32, {"expert": 8}, True),
    ],
)
def test_host_blocks_and_spans_read_the_process_layout(shape, per_process, blocks, spans):
    mesh = fake_mesh(shape, per_process)
    axes = [a for a in shape if a != "tensor"]
    assert host_blocks(mesh, axes) == blocks
    assert spans_processes(mesh, axes) is spans
    # the resolver decides from the degrees alone, before any device exists: it must read the same layout
    assert config_spans(shape, tuple(axes), per_process) is spans


@pytest.mark.parametrize("hosts", [{}, {"data": 2}])
def test_bucket_sum_adds_every_replica_once(hosts):
    mesh = make_mesh("cloudmatrix384", {"data": 4, "tensor": 2})
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 6, 2), np.float32), rng.standard_normal((4, 3), np.float32)
    xs = [
        jax.device_put(a, NamedSharding(mesh, P("data", None, "tensor"))),
        jax.device_put(b, NamedSharding(mesh, P("data"))),
    ]
    sa, sb = jax.jit(
        lambda u, v: bucket_sum([u, v], mesh=mesh, specs=[P(None, "tensor"), P()], over=[("data",)] * 2, hosts=hosts)
    )(*xs)
    np.testing.assert_allclose(sa, a.sum(0), rtol=1e-6)
    np.testing.assert_allclose(sb, b.sum(0), rtol=1e-6)
    assert sa.sharding.spec == P(None, "tensor")


def test_manual_part_keeps_only_the_manual_axes():
    assert manual_part(P(("data", "fsdp"), "tensor", None), ("data",)) == P("data", None, None)
    assert manual_part(P("expert", None, "tensor"), ("data", "expert")) == P("expert", None, None)


def test_a_parameter_stored_over_a_replica_axis_is_refused():
    mesh = make_mesh("cloudmatrix384", {"data": 4, "tensor": 2})
    strategy = Strategy(rules={"batch": "data", "embed": "data"}, params={"w": ("embed",)})
    with pytest.raises(ShardingError, match=r"tensor 'w' is stored over 'data'"):
        check_replicas(strategy, {"w": jnp.zeros(8)}, mesh, ("data",))
    with pytest.raises(ShardingError, match="must lead the batch's mesh axes"):
        check_replicas(Strategy(rules={"batch": "data", "embed": None}), {}, mesh, ("tensor",))
