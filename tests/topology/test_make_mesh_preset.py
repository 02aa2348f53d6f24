"""``make_mesh`` given a preset name or file path instead of a ``Hardware``."""

import pytest

from hyperjax import load_hardware, make_mesh
from hyperjax.errors import PresetError
from hyperjax.topology.hardware import presets_dir

AXES = {"data": 2, "tensor": 4}


@pytest.mark.parametrize("preset", ["cloudmatrix384", presets_dir() / "cloudmatrix384.yaml"], ids=["name", "path"])
def test_preset_equals_loaded_hardware(preset):
    by_preset = make_mesh(preset, AXES)
    by_hardware = make_mesh(load_hardware("cloudmatrix384"), AXES)
    assert by_preset.axis_names == by_hardware.axis_names == ("data", "tensor")
    assert by_preset.devices.tolist() == by_hardware.devices.tolist()
    assert by_preset == by_hardware


def test_error_unknown_preset():
    with pytest.raises(PresetError, match=r"unknown hardware preset 'cloudmatrx384'\. Did you mean 'cloudmatrix384'\?"):
        make_mesh("cloudmatrx384", AXES)
