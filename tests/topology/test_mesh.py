import dataclasses
import random

import jax
import pytest
import yaml

from hyperjax import MeshError, axis_spans, default_axes, load_hardware, make_mesh, parse_axes
from hyperjax.topology.hardware import hardware_from_dict, presets_dir
from hyperjax.topology.mesh import physical_order


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    slice_index: int = 0
    coords: tuple[int, ...] = ()


def test_parse_axes():
    assert parse_axes("data=12,tensor=32") == {"data": 12, "tensor": 32}
    assert list(parse_axes(" tensor = 8 , data=2")) == ["tensor", "data"]


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("data12", r"item 'data12' is not NAME=SIZE"),
        ("data=", r"item 'data=' is not NAME=SIZE"),
        ("data=x", r"size 'x' of axis 'data' is not an integer"),
        ("data=2,data=4", r"axis 'data' appears twice"),
        ("1d=2", r"axis name '1d' is not an identifier"),
        ("data=0", r"mesh axis 'data' has size 0; axis sizes must be positive"),
        ("data=-4", r"mesh axis 'data' has size -4"),
    ],
)
def test_parse_axes_errors(text, pattern):
    with pytest.raises(MeshError, match=pattern):
        parse_axes(text)


def test_spans_cloudmatrix_12x32():
    spans = axis_spans(load_hardware("cloudmatrix384"), {"data": 12, "tensor": 32})
    assert spans["tensor"].levels == (("node", 8), ("supernode", 4))
    assert spans["tensor"].tier == "supernode"
    assert spans["data"].levels == (("supernode", 12),)


def test_spans_cloudmatrix_default():
    hw = load_hardware("cloudmatrix384")
    spans = axis_spans(hw, hw.default_axes)
    assert spans["tensor"].levels == (("node", 8),) and spans["tensor"].tier == "node"
    assert spans["data"].levels == (("supernode", 48),)


def test_spans_cross_supernodes():
    spans = axis_spans(load_hardware("cloudmatrix384"), {"data": 64, "tensor": 8})
    assert spans["data"].levels == (("supernode", 32), ("rdma", 2))
    assert spans["data"].tier == "rdma"


def test_spans_dgx_and_unit_axis():
    spans = axis_spans(load_hardware("dgx-a100-80g"), {"pipe": 1, "data": 8, "tensor": 8})
    assert spans["tensor"].levels == (("nvlink", 8),)
    assert spans["data"].levels == (("infiniband", 8),)
    assert spans["pipe"].levels == () and spans["pipe"].tier == "nvlink"


def test_spans_unaligned_axis_reports_worst_group():
    # groups of 3 consecutive devices: some straddle a node boundary (6, 7 | 8)
    spans = axis_spans(load_hardware("dgx-h100"), {"data": 8, "tensor": 3})
    assert spans["tensor"].tier == "infiniband"
    assert spans["tensor"].levels == (("nvlink", 2), ("infiniband", 2))


def test_spans_beyond_capacity():
    raw = yaml.safe_load((presets_dir() / "cloudmatrix384.yaml").read_text())
    raw["tiers"] = raw["tiers"][:2]
    hw = hardware_from_dict(raw)
    with pytest.raises(MeshError, match=r"768 devices exceed what preset 'cloudmatrix384' connects \(384"):
        axis_spans(hw, {"data": 96, "tensor": 8})


def test_default_axes():
    hw = load_hardware("cloudmatrix384")
    assert default_axes(hw, 384) == {"data": 48, "tensor": 8}
    assert default_axes(hw, 8) == {"data": 1, "tensor": 8}
    assert default_axes(hw, 512) == {"data": 64, "tensor": 8}
    assert default_axes(load_hardware("supernode-12x32"), 64) == {"data": 2, "tensor": 32}


def test_physical_order_groups_processes():
    devices = [FakeDevice(id=i, process_index=i % 2) for i in range(8)]
    random.Random(0).shuffle(devices)
    ordered = physical_order(devices)
    assert [d.process_index for d in ordered] == [0] * 4 + [1] * 4
    assert [d.id for d in ordered] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_physical_order_slices_before_processes():
    devices = [FakeDevice(id=i, process_index=i % 2, slice_index=i // 4) for i in range(8)]
    assert [d.slice_index for d in physical_order(devices[::-1])] == [0] * 4 + [1] * 4


def test_make_mesh_orders_devices():
    devices = jax.devices()
    shuffled = random.Random(1).sample(devices, len(devices))
    mesh = make_mesh(load_hardware("cloudmatrix384"), {"data": 2, "tensor": 4}, devices=shuffled)
    assert mesh.axis_names == ("data", "tensor")
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_wrong_product():
    with pytest.raises(
        MeshError, match=r"multiply to 12 devices but 8 devices are in use; choose sizes whose product is 8"
    ):
        make_mesh(load_hardware("cloudmatrix384"), {"data": 3, "tensor": 4})
