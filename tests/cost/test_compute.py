import json
from pathlib import Path

import pytest

from hyperjax import estimate, load_config, load_hardware, resolve
from hyperjax.cost import gemm_time, grouped_gemm_time

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


def test_a_systolic_array_pads_the_weights_dimensions_to_its_side():
    """A TPU's MXU holds the ``(k, n)`` operand in tiles of its side (256 on v6e): a compute-bound product with
    ``k`` or ``n`` between multiples of it does the padded work; the streamed ``m`` is not padded; a GPU pads
    nothing."""
    v6e, big = load_hardware("tpu-v6e"), 32768
    t = lambda m, n, k, hw=v6e: gemm_time(m, n, k, bytes_per_element=2, dtype="bfloat16", hardware=hw)
    assert t(big, big, 1100) == pytest.approx(t(big, big, 1280))
    assert t(big, 1100, big) == pytest.approx(t(big, 1280, big))
    overhead = v6e.device.kernel_overhead
    assert t(1100, big, big) - overhead == pytest.approx((t(1280, big, big) - overhead) * 1100 / 1280)
    gpu = H100.device.kernel_overhead
    assert t(big, big, 1100, H100) - gpu == pytest.approx((t(big, big, 1280, H100) - gpu) * 1100 / 1280)


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


def test_grouped_products_run_their_tiles_in_waves():
    """Few rows per expert leave most SMs idle: eight experts of 256 rows (48 tiles of 128 x 256 on 132
    SMs) take one wave of full-length tiles, so their rate is a fraction of many rows'."""
    kw = dict(bytes_per_element=2, dtype="bfloat16", hardware=H100)
    few = grouped_gemm_time(8 * 256, 768, 2048, groups=8, **kw)
    many = grouped_gemm_time(128 * 1024, 768, 2048, groups=128, **kw)
    rate = lambda rows, t: 2 * rows * 768 * 2048 / t
    assert rate(8 * 256, few) < 0.5 * rate(128 * 1024, many)
    one_wave = 2 * 128 * 256 * 2048 / (H100.matmul_flops("bfloat16") * H100.device.matmul_efficiency / 132)
    assert few == pytest.approx(one_wave + H100.device.kernel_overhead)


def test_grouped_products_follow_the_measured_kernels():
    """grouped_gemm_time against torch._grouped_mm timed on an H200 (benchmarks/gpu_kernels_measure.py)."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "kernels-h200-measured.json").read_text())
    hw = load_hardware("dgx-h200")
    errors = sorted(
        abs(
            grouped_gemm_time(
                g["groups"] * g["rows"],
                g["n"],
                g["k"],
                groups=g["groups"],
                bytes_per_element=2,
                dtype="bfloat16",
                hardware=hw,
            )
            / g["s"]
            - 1
        )
        for g in measured["grouped"]
    )
    assert len(errors) == 18
    assert errors[len(errors) // 2] <= 0.08, errors


def test_fp8_runs_products_follow_the_measured_kernels():
    """Every NeMo FP8 run's layer products (forward and both gradients, at its per-GPU shapes), timed on an
    H100 in FP8 and BF16 (benchmarks/gpu_kernels_measure.py), against gemm_time at each format's rate."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "kernels-h100-measured.json").read_text())
    sums: dict[tuple[str, str], list[float]] = {}
    for r in measured["fp8_rows"]:
        for fmt, dtype, e in (("fp8", "fp8", 1), ("bf16", "bfloat16", 2)):
            g = r[fmt]
            p = gemm_time(g["m"], g["n"], g["k"], bytes_per_element=e, dtype=dtype, hardware=H100)
            acc = sums.setdefault((r["row"], fmt), [0.0, 0.0])
            acc[0] += g["s"]
            acc[1] += p
    assert len(sums) == 24  # twelve runs, two formats
    errors = {key: p / s - 1 for key, (s, p) in sums.items()}
    assert max(abs(e) for e in errors.values()) <= 0.08, errors


def test_a_group_of_few_rows_runs_in_a_smaller_tile_down_to_the_devices_smallest():
    kw = dict(bytes_per_element=2, dtype="bfloat16", hardware=H100)
    unit = H100.matmul_flops("bfloat16") * H100.device.matmul_efficiency / 132
    wave = lambda height: 2 * height * 256 * 7168 / unit + H100.device.kernel_overhead
    assert H100.device.grouped_gemm_min_rows == 64  # Hopper's warpgroup product is 64 rows
    # 8 groups of 64 rows and 256 columns: 8 tiles of 64 x 256, one wave; of 16 rows: still 64-row tiles; of
    # 256 rows: whole 128-row tiles, two of them a group, still one wave
    assert grouped_gemm_time(8 * 64, 256, 7168, groups=8, **kw) == pytest.approx(wave(64))
    assert grouped_gemm_time(8 * 16, 256, 7168, groups=8, **kw) == pytest.approx(wave(64))
    assert grouped_gemm_time(8 * 256, 256, 7168, groups=8, **kw) == pytest.approx(wave(128))


def test_presets_without_compute_units_keep_the_roofline_of_whole_tiles():
    tpu = load_hardware("tpu-v5p")
    assert not tpu.device.compute_units
    kw = dict(bytes_per_element=2, dtype="bfloat16", hardware=tpu)
    active = 8 * (1 - (1 - 1 / 8) ** 2)  # two rows over eight groups
    assert grouped_gemm_time(2, 4096, 7168, groups=8, **kw) == pytest.approx(
        gemm_time(128, 4096, 7168, count=active, **kw)
    )


def test_fewer_than_one_group_touched_runs_its_wave_that_often():
    kw = dict(bytes_per_element=2, dtype="bfloat16", hardware=H100)
    overhead = H100.device.kernel_overhead
    one = grouped_gemm_time(1, 4096, 7168, groups=1, **kw) - overhead
    tiny = grouped_gemm_time(1e-3, 4096, 7168, groups=4, **kw) - overhead  # a group touched 0.1 % of the time
    assert 0 < tiny < 0.01 * one


def test_fp8_grouped_products_run_at_the_fp8_rate_in_waves():
    kw = dict(groups=32, hardware=H100)
    bf16 = grouped_gemm_time(32 * 1024, 2048, 7168, bytes_per_element=2, dtype="bfloat16", **kw)
    fp8 = grouped_gemm_time(32 * 1024, 2048, 7168, bytes_per_element=1, dtype="fp8", **kw)
    d, overhead = H100.device, H100.device.kernel_overhead
    ratio = (H100.matmul_flops("bfloat16") * d.matmul_efficiency) / (H100.matmul_flops("fp8") * d.efficiency("fp8"))
    assert (fp8 - overhead) == pytest.approx((bf16 - overhead) * ratio)
