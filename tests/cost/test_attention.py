"""The attention core's kernels and context parallelism's exchange (``hyperjax.cost.attention``)."""

from pathlib import Path

import pytest

from hyperjax import load_config, load_hardware
from hyperjax.cost.attention import context_exchange, core_time
from hyperjax.topology import axis_spans

CONFIGS = Path(__file__).parents[2] / "configs"
H100 = load_hardware("dgx-h100")


def model(*sets: str):
    return load_config(CONFIGS / "quickstart.yaml", ["model.seq_len=4096", "model.head_dim=128", *sets]).model


def test_a_fused_core_runs_at_the_kernels_measured_rate_over_its_keys():
    m = model("model.attention_kernel=flash")
    forward, backward = core_time(m, micro=2, tp=1, cp=1, dtype="bfloat16", ring=False, hardware=H100)
    rate_f, rate_b = H100.device.attention_rates(m.attention_impl, m.seq_len, m.head_dim)
    scores = 2 * m.heads * m.seq_len * m.seq_len / 2  # causal: half the square
    peak, overhead = H100.matmul_flops("bfloat16"), H100.device.kernel_overhead
    assert forward == pytest.approx(scores * 4 * m.head_dim / (peak * rate_f) + overhead)
    assert backward == pytest.approx(scores * 10 * m.head_dim / (peak * rate_b) + overhead)


def test_a_head_narrower_than_the_systolic_array_pays_its_width():
    """On a TPU's MXU each of a fused core's products holds a head-wide operand, padded to the array's side: a
    128-wide head fills half of v6e's 256-wide array, so it costs what a 256-wide head does; on v5e's 128-wide
    array it costs half. A GPU preset models no array."""
    v6e, v5e = load_hardware("tpu-v6e"), load_hardware("tpu-v5e")
    assert (v6e.device.systolic_array, v5e.device.systolic_array, H100.device.systolic_array) == (256, 128, 0)
    cores = {
        (hw.name, hd): core_time(
            model("model.attention_kernel=flash", f"model.head_dim={hd}"),
            micro=2,
            tp=1,
            cp=1,
            dtype="bfloat16",
            ring=False,
            hardware=hw,
        )
        for hw in (v6e, v5e)
        for hd in (128, 256)
    }
    assert cores["tpu-v6e", 128] == cores["tpu-v6e", 256]
    overhead = v5e.device.kernel_overhead
    for narrow, wide in zip(cores["tpu-v5e", 128], cores["tpu-v5e", 256], strict=True):
        assert narrow - overhead == pytest.approx((wide - overhead) / 2)


def test_a_materialized_cores_backward_is_twice_its_forward():
    m = model("model.attention_kernel=materialized")
    forward, backward = core_time(m, micro=2, tp=1, cp=1, dtype="bfloat16", ring=False, hardware=H100)
    assert backward == pytest.approx(2 * forward)


def test_a_ring_hides_all_but_its_last_blocks_transfer_behind_the_kernels():
    m = model("model.attention_kernel=flash")
    span = axis_spans(H100, {"context": 4})["context"]
    kw = dict(micro=2, tp=1, cp=4, dtype="bfloat16", passes=2, span=span, hardware=H100)
    core = core_time(m, micro=2, tp=1, cp=4, dtype="bfloat16", ring=True, hardware=H100)
    gather = context_exchange(m, ring=False, core=core, **kw)
    ring = context_exchange(m, ring=True, core=core, **kw)
    assert gather.comm_s == pytest.approx(2 * gather.forward_s) and gather.slowed_forward_s == 0
    assert ring.comm_s < gather.comm_s and ring.forward_s < gather.forward_s
    # what hides beside the kernels slows them by the device's share
    assert ring.slowed_forward_s == pytest.approx((gather.forward_s - ring.forward_s) * H100.device.comm_compute_share)
