import json
from pathlib import Path

import pytest

from hyperjax import estimate, load_config, load_hardware, resolve
from hyperjax.cost import gemm_time

ROOT = Path(__file__).parents[2]
H100 = load_hardware("dgx-h100")


def test_a_batch_of_products_is_one_kernel():
    one = gemm_time(128, 128, 32, bytes_per_element=2, dtype="bfloat16", hardware=H100)
    batch = gemm_time(128, 128, 32, count=256, bytes_per_element=2, dtype="bfloat16", hardware=H100)
    overhead = H100.device.kernel_overhead
    assert batch == pytest.approx(256 * (one - overhead) + overhead)


def test_float32_products_run_at_the_default_precision_rate():
    f32 = gemm_time(8192, 8192, 8192, bytes_per_element=4, dtype="float32", hardware=H100)
    tf32_roofline = 2 * 8192**3 / (H100.peak_flops("tf32") * H100.device.matmul_efficiency)
    assert f32 == pytest.approx(tf32_roofline + H100.device.kernel_overhead)


def test_predicts_the_measured_h100_steps():
    """The cost model against steps timed on an H100 (benchmarks/gpu_step.py); a regression guard."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "gpu-h100-measured.json").read_text())
    errors = {}
    for case in measured["cases"]:
        est = estimate(resolve(load_config(None, case["overrides"])))  # one device of the preset
        if "error" in case:  # ran out of device memory on the GPU
            assert "RESOURCE_EXHAUSTED" in case["error"] and not est.fits, case["name"]
            continue
        errors[case["name"]] = est.step_time_s / case["step_s"] - 1
    assert len(errors) >= 8
    assert max(abs(e) for e in errors.values()) <= 0.25, errors
    assert sum(abs(e) for e in errors.values()) / len(errors) <= 0.12, errors
