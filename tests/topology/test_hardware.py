import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from hyperjax import Hardware, PresetError, list_presets, load_hardware
from hyperjax.cli.main import main
from hyperjax.topology.hardware import hardware_from_dict, presets_dir

REQUIRED = ("cloudmatrix384", "supernode-12x32", "dgx-a100-80g", "dgx-h100", "tpu-v5p")


def _raw(name: str = "cloudmatrix384") -> dict:
    return yaml.safe_load((presets_dir() / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", REQUIRED)
def test_required_presets_load(name):
    hw = load_hardware(name)
    assert isinstance(hw, Hardware)
    assert hw.name == name
    assert hw.device.peak_flops["bfloat16"] > 0
    assert name in list_presets()


@pytest.mark.parametrize(
    ("name", "fp8"),
    [
        ("dgx-h100", 1979e12),
        ("dgx-h200", 1979e12),
        ("h100-96g-500w", 1370.3e12),
        ("dgx-a100-80g", None),
        ("tpu-v5p", None),
        ("tpu-v5e", None),
        ("tpu-v6e", None),
        ("cloudmatrix384", None),
        ("ascend910c-cluster", None),
    ],
)
def test_a_device_lists_the_formats_it_multiplies(name, fp8):
    """FP8 where its peak is published (or, for the power-capped part, derived and stated); nowhere else."""
    assert load_hardware(name).device.peak_flops.get("fp8") == fp8


@pytest.mark.parametrize("name", list_presets())
def test_every_section_names_its_source(name):
    raw = _raw(name)
    for section in (raw["device"], raw["host"], *raw["tiers"]):
        assert len(section["source"]) > 10
    # every numeric line of the file carries a comment saying where it comes from
    numeric = re.compile(r"^\s*(\w+):\s*[0-9][0-9.e+-]*\s*(#.*)?$")
    lines = [m for m in map(numeric.match, (presets_dir() / f"{name}.yaml").read_text().splitlines()) if m]
    assert len(lines) > 10
    for m in lines:
        if m.group(1) not in ("devices", "group_size"):  # counts, not measured constants
            assert m.group(2), f"{name}: no source comment on {m.group(0)!r}"


def test_cloudmatrix384_shape():
    hw = load_hardware("cloudmatrix384")
    assert hw.devices == 384
    assert [(t.name, t.group_size) for t in hw.tiers] == [("node", 8), ("supernode", 384), ("rdma", None)]
    assert hw.tiers[0].bandwidth == 392e9
    assert hw.host.bandwidth == 151e9
    assert hw.device.hbm_bytes == 128e9


def test_supernode_12x32_shape():
    hw = load_hardware("supernode-12x32")
    assert [t.group_size for t in hw.tiers] == [32, 384, None]
    assert hw.tiers[1].bandwidth < hw.tiers[0].bandwidth / 4  # units are joined by RDMA, not the bus


@pytest.mark.parametrize("name", ["dgx-a100-80g", "dgx-h100"])
def test_dgx_any_number_of_nodes(name):
    hw = load_hardware(name)
    assert hw.tiers[0].group_size == 8
    assert hw.max_devices is None


def test_effective_bandwidth():
    tier = load_hardware("dgx-a100-80g").tiers[0]
    assert tier.effective_bandwidth == pytest.approx(300e9 * 0.77)


def test_load_from_path(tmp_path: Path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_raw() | {"name": "mine"}))
    assert load_hardware(path).name == "mine"


def test_unknown_preset_suggests():
    with pytest.raises(PresetError, match=r"unknown hardware preset 'cloudmatrix385'\. Did you mean 'cloudmatrix384'"):
        load_hardware("cloudmatrix385")


def test_missing_file():
    with pytest.raises(PresetError, match=r"nope\.yaml' does not exist"):
        load_hardware("nope.yaml")


def test_bad_yaml(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(PresetError, match="is not valid YAML"):
        load_hardware(path)


def test_a_key_given_twice_in_a_preset_is_an_error(tmp_path: Path):
    path = tmp_path / "twice.yaml"
    text = (Path(presets_dir()) / "dgx-h100.yaml").read_text()
    path.write_text(text.replace("device:\n", "device:\n  hbm_bytes: 1.0e+9\n", 1))
    with pytest.raises(PresetError, match=r"twice.yaml' is not valid YAML(.|\n)*key 'hbm_bytes' is given twice"):
        load_hardware(path)


def test_unknown_key_did_you_mean():
    raw = _raw()
    raw["device"]["hbm_byte"] = raw["device"].pop("hbm_bytes")
    with pytest.raises(PresetError, match=r"device: unknown key 'hbm_byte' \(did you mean 'hbm_bytes'\?\)"):
        hardware_from_dict(raw)


def test_missing_key():
    raw = _raw()
    del raw["host"]["bandwidth"]
    with pytest.raises(PresetError, match="host: missing key 'bandwidth'"):
        hardware_from_dict(raw)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw.pop("device"), r"^x.yaml: device is missing; it is a mapping of name, peak_flops, hbm_bytes"),
        (lambda raw: raw.update(host=[1]), r"^x.yaml: host must be a mapping of bytes_per_device, .*got list$"),
        (lambda raw: raw.pop("name"), r"^x.yaml: missing key 'name'; required keys: name, description"),
    ],
)
def test_a_missing_section_is_named_once_with_what_it_holds(edit, message):
    raw = _raw()
    edit(raw)
    with pytest.raises(PresetError, match=message):
        hardware_from_dict(raw, where="x.yaml")


def test_an_empty_or_listed_preset_file_says_what_a_preset_gives(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(PresetError, match=r"empty.yaml is empty; a preset gives name, description, devices, device"):
        load_hardware(tmp_path / "empty.yaml")
    quick = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
    for command in (["predict", quick], ["plan", quick, "--devices", "8"]):  # from the command line: exit 2
        assert main([*command, "--hardware", str(tmp_path / "empty.yaml")]) == 2
        err = capsys.readouterr().err
        assert "empty.yaml is empty; a preset gives name" in err and "Traceback" not in err, err
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(PresetError, match=r"list.yaml: the preset must be a mapping of name, .*, got list"):
        load_hardware(tmp_path / "list.yaml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: raw["tiers"][1].update(name=raw["tiers"][0]["name"]), r"two tiers are named '\w+' \(.*\); "),
        (lambda raw: raw.update(tiers=5), r"tiers=5 must be a list of tier mappings"),
        (lambda raw: raw.update({5: "x"}), r"unknown key '5'; allowed keys: name"),
        (
            lambda raw: raw.update(tierz=raw.pop("tiers")),
            r"unknown key 'tierz' \(did you mean 'tiers'\?\); allowed keys: name, .*device, tiers, host",
        ),
        (lambda raw: raw["device"].update(fused_attention=["a"]), r"device.fused_attention=\['a'\] must name a"),
        (lambda raw: raw.update(name=["x"]), r"name=\['x'\] must be a non-empty string"),
        (lambda raw: raw["device"].update(name={"a": 1}), r"device.name=\{'a': 1\} must be a non-empty string"),
        (
            lambda raw: raw["tiers"][0].update(topology="torus", torus_dims=2.0),
            r"torus_dims=2.0 needs topology: torus and 1, 2 or 3 dimensions",
        ),
        (
            lambda raw: raw["tiers"][0].update(topology="torus", torus_dims=True),
            r"torus_dims=True needs topology: torus and 1, 2 or 3 dimensions",
        ),
    ],
)
def test_names_and_shapes_of_the_wrong_kind_are_named(edit, message):
    """A preset's tiers are told apart by name (two of one name would price an axis at the wrong tier), and a
    value of the wrong kind is an error naming it, not a traceback."""
    raw = _raw()
    edit(raw)
    with pytest.raises(PresetError, match=message):
        hardware_from_dict(raw)


def test_tiers_must_nest():
    raw = _raw()
    raw["tiers"][1]["group_size"] = 100
    with pytest.raises(
        PresetError, match=r"tier 'supernode' group_size=100 must be a multiple of the tier below it \(8\)"
    ):
        hardware_from_dict(raw)


def test_unbounded_tier_must_be_last():
    raw = _raw()
    raw["tiers"][0]["group_size"] = None
    with pytest.raises(PresetError, match="only the last tier may have group_size null"):
        hardware_from_dict(raw)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("efficiency", 1.5, r"efficiency=1.5 must be in \(0, 1\]"),
        ("bandwidth", -1, r"bandwidth=-1 must be a positive number"),
        ("bandwidth", "fast", r"bandwidth='fast' must be a positive number"),
        ("topology", "mesh", r"topology='mesh' must be one of"),
        ("torus_dims", 3, r"torus_dims=3 needs topology: torus"),  # cloudmatrix384's first tier is a switch
        ("name", ["a", "b"], r"tier name=\['a', 'b'\] must be a non-empty string"),
        ("name", "", r"tier name='' must be a non-empty string"),
    ],
)
def test_tier_values(field, value, pattern):
    raw = _raw()
    raw["tiers"][0][field] = value
    with pytest.raises(PresetError, match=pattern):
        hardware_from_dict(raw)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("reserved_bytes", 1e12, r"device.reserved_bytes=1000000000000.0 must be in \[0, hbm_bytes="),
        ("allocator_overhead", 1.5, r"device.allocator_overhead=1.5 must be in \[0, 1\)"),
        ("compute_units", -1, r"device.compute_units=-1 must be a non-negative integer"),
        ("systolic_array", 2.5, r"device.systolic_array=2.5 must be a non-negative integer"),
        ("grouped_gemm_cols", 256, r"device.grouped_gemm_cols=256 and device.compute_units=0: give both"),
        ("grouped_gemm_min_rows", 4096, r"device.grouped_gemm_min_rows=4096 exceeds device.grouped_gemm_rows=128"),
    ],
)
def test_device_memory_values(field, value, pattern):
    raw = _raw()
    raw["device"][field] = value
    with pytest.raises(PresetError, match=pattern):
        hardware_from_dict(raw)


@pytest.mark.parametrize(
    ("where", "value", "pattern"),
    [
        # YAML 1.1 reads 84.944e9 (no dot before the exponent's sign) as text: named, not compared as a number
        (("device", "hbm_bytes"), "84.944e9", r"device.hbm_bytes='84.944e9' must be a finite number \(YAML reads"),
        (("device", "reserved_bytes"), "1.0e9", r"device.reserved_bytes='1.0e9' must be a finite number"),
        (("device", "kernel_overhead"), "5.0e-6", r"device.kernel_overhead='5.0e-6' must be a finite number"),
        (("device", "hbm_bytes"), -1, r"device.hbm_bytes=-1 must be a positive number"),  # not reserved_bytes'
        (("device", "hbm_bytes"), float("inf"), r"device.hbm_bytes=inf must be a finite number"),
        (("device", "peak_flops"), [1, 2], r"device.peak_flops=\[1, 2\] must map each dtype to its FLOP/s"),
        (("device", "peak_flops"), {"bogus16": 1e12}, r"device.peak_flops.bogus16: 'bogus16' is not one of"),
        (("tiers", "latency"), "3.0e-6", r"tier 'node'.latency='3.0e-6' must be a finite number"),
        (("tiers", "torus_wrap"), 0, r"torus_wrap=0 must be a positive integer"),
        (("tiers", "torus_wrap_whole"), "yes", r"torus_wrap_whole='yes' must be true or false"),
        (("host", "latency"), "1e-5", r"host.latency='1e-5' must be a finite number"),
        ((None, "default_axes"), [8, 8], r"default_axes=\[8, 8\] must map mesh axes to positive integer degrees"),
        ((None, "default_axes"), None, r"default_axes=None must map mesh axes"),
        ((None, "devices"), True, r"devices=True must be a positive integer"),
    ],
)
def test_preset_values_of_the_wrong_type_are_named(where, value, pattern):
    """A value of the wrong type names its key before any range check compares it (no raw TypeError)."""
    raw = _raw()
    section, key = where
    (raw["tiers"][0] if section == "tiers" else raw[section] if section else raw)[key] = value
    with pytest.raises(PresetError, match=pattern):
        hardware_from_dict(raw)


def test_a_preset_file_that_is_not_text_is_named(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe name: x")
    with pytest.raises(PresetError, match=r"binary.yaml' is not UTF-8 text"):
        load_hardware(path)


def test_default_axes_must_cover_devices():
    raw = _raw() | {"default_axes": {"data": 12, "tensor": 8}}
    with pytest.raises(PresetError, match=r"default_axes=.* multiply to 96, not devices=384"):
        hardware_from_dict(raw)


def test_devices_beyond_bounded_top_tier():
    raw = _raw()
    raw["tiers"] = raw["tiers"][:2]
    raw["devices"] = 768
    raw["default_axes"] = {"data": 96, "tensor": 8}
    with pytest.raises(PresetError, match="devices=768 exceeds the outermost tier's group_size=384"):
        hardware_from_dict(raw)


def test_peak_flops_unknown_dtype():
    hw = load_hardware("tpu-v5p")
    assert hw.peak_flops("bfloat16") == 459e12
    with pytest.raises(PresetError, match=r"no peak_flops for dtype='fp8'.*Add the figure"):
        hw.peak_flops("fp8")


def test_frozen():
    hw = load_hardware("dgx-h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.devices = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        hw.device.peak_flops["bfloat16"] = 1.0  # type: ignore[index]


def test_matmul_precision_maps_float32_products():
    h100, tpu, cm = load_hardware("dgx-h100"), load_hardware("tpu-v5p"), load_hardware("cloudmatrix384")
    assert h100.matmul_flops("float32") == h100.peak_flops("tf32") > 4 * h100.peak_flops("float32")
    assert h100.matmul_flops("bfloat16") == h100.peak_flops("bfloat16")
    assert tpu.matmul_flops("float32") == tpu.peak_flops("bfloat16")
    assert cm.matmul_flops("float32") == cm.peak_flops("float32")  # no mapping: its own peak


def test_matmul_precision_names_a_listed_dtype():
    raw = _raw("dgx-h100")
    raw["device"]["matmul_precision"] = {"float32": "tf16"}
    with pytest.raises(PresetError, match=r"device.matmul_precision.float32: 'tf16' names a dtype with no peak_flops"):
        hardware_from_dict(raw)
    raw["device"]["matmul_precision"] = {"fp32": "tf32"}
    with pytest.raises(PresetError, match=r"device.matmul_precision: 'fp32' names a dtype with no peak_flops"):
        hardware_from_dict(raw)
    raw["device"]["matmul_precision"] = "tf32"
    with pytest.raises(PresetError, match=r"must be a mapping from a compute dtype"):
        hardware_from_dict(raw)
    raw["device"]["matmul_precision"] = {"float32": ["tf32"]}
    with pytest.raises(PresetError, match=r"device.matmul_precision.float32: \['tf32'\] names a dtype with no peak"):
        hardware_from_dict(raw)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_a_kernels_seq_half_is_a_finite_count_of_keys(value):
    raw = _raw("dgx-h100")
    raw["device"]["attention_kernels"]["cudnn"]["seq_half"] = value
    with pytest.raises(PresetError, match=r"device.attention_kernels.cudnn.seq_half=.* must be (a finite|>= 0)"):
        hardware_from_dict(raw)


@pytest.mark.parametrize(
    ("device", "pattern"),
    [
        (
            {"attention_kernels": {"fa": {"forward": 1.5, "backward": 0.3}}, "fused_attention": "fa"},
            r"device.attention_kernels.fa.forward=1.5 must be a fraction of the peak in \(0, 1\]",
        ),
        (
            {"attention_kernels": {"fa": {"forward": 0.4, "backward": 0.3, "tile": 128}}, "fused_attention": "fa"},
            r"device.attention_kernels.fa=.* must be a mapping with forward and backward",
        ),
        (
            {"attention_kernels": {"fa": {"forward": 0.4, "backward": 0.3}}, "fused_attention": "cudnn"},
            r"device.fused_attention='cudnn' must name one of device.attention_kernels \['fa'\]",
        ),
        ({"fused_attention": "cudnn"}, r"device.fused_attention='cudnn' names a kernel, but device.attention_kernels"),
    ],
)
def test_attention_kernel_values(device, pattern):
    raw = _raw()
    raw["device"] |= device
    with pytest.raises(PresetError, match=pattern):
        hardware_from_dict(raw)


def test_attention_rates_follow_the_measured_kernel():
    """A fused kernel's rate is the preset's long-sequence fraction ramped by seq / (seq + seq_half); a device
    with no measured kernel runs one at its matmul efficiency."""
    d = load_hardware("dgx-h100").device
    k = d.attention_kernels["flash2"]
    assert d.attention_rates("flash2", 8192) == pytest.approx(
        (k.forward * 8192 / (8192 + k.seq_half), k.backward * 8192 / (8192 + k.seq_half))
    )
    assert d.attention_rates(None, 8192) == d.attention_rates(d.fused_attention, 8192)
    assert d.attention_rates("flash2", 2048)[0] < d.attention_rates("flash2", 8192)[0] < k.forward
    assert d.attention_rates("flash2", 8192)[0] < d.attention_rates("cudnn", 8192)[0]
    a100 = load_hardware("dgx-a100-80g").device
    assert a100.attention_rates(None, 4096) == (a100.matmul_efficiency, a100.matmul_efficiency)


def test_attention_rates_beyond_the_measured_widths_keep_each_scores_exponential():
    """Per score the forward multiplies 4 x head_dim FLOPs and takes one exponential on the special-function
    units: below the narrowest measured width, a kernel that runs them one after the other (FlashAttention-2)
    at half that width takes half its products' time and all of the exponential's; one that overlaps them
    (cuDNN's) takes half its time while the products still outlast the exponentials."""
    d = load_hardware("dgx-h100").device
    peak, exp = d.peak_flops["bfloat16"], 1 / d.special_function_flops
    for name in ("flash2", "cudnn"):
        k = d.attention_kernels[name]
        assert d.attention_rates(name, 1e9, k.head_dim) == d.attention_rates(name, 1e9)
        narrowest = min(k.measured(), key=lambda w: w.head_dim)
        measured = 4 * narrowest.head_dim / (peak * narrowest.forward)  # seconds per score there
        half = max(measured / 2, exp) if k.overlapped else (measured - exp) / 2 + exp
        ramp = 1e9 / (1e9 + k.seq_half)
        rate = d.attention_rates(name, 1e9, narrowest.head_dim / 2)[0]
        assert rate == pytest.approx(2 * narrowest.head_dim / (peak * half) * ramp)
    assert not d.attention_kernels["flash2"].overlapped and d.attention_kernels["cudnn"].overlapped


def test_attention_rates_at_measured_widths_and_between_them():
    """A measured width runs at its measured rates; between two, each score's time is interpolated linearly in
    the width (DeepSeek-V3's latent attention, 160 wide, between 128 and 256)."""
    d = load_hardware("dgx-h100").device
    k = d.attention_kernels["cudnn"]
    by_width = {w.head_dim: w for w in k.measured()}
    assert sorted(by_width) == [64, 128, 256]
    ramp = 4096 / (4096 + k.seq_half)
    for w in by_width.values():
        assert d.attention_rates("cudnn", 4096, w.head_dim) == pytest.approx((w.forward * ramp, w.backward * ramp))
    lo, hi = by_width[128], by_width[256]
    for i, (flops, key) in enumerate(((4, "forward"), (10, "backward"))):
        time = 0.75 * flops * 128 / getattr(lo, key) + 0.25 * flops * 256 / getattr(hi, key)
        assert d.attention_rates("cudnn", 4096, 160)[i] == pytest.approx(flops * 160 / time * ramp)
    # cuDNN at 64 wide reaches two thirds of its rate at 128, as measured (the exponentials alone: all of it)
    assert d.attention_rates("cudnn", 4096, 64)[0] == pytest.approx(0.469 / 0.702 * d.attention_rates("cudnn", 4096)[0])


@pytest.mark.parametrize(
    ("widths", "pattern"),
    [
        (
            [{"head_dim": 128, "forward": 0.3, "backward": 0.3}],
            r"widths measure head_dim \[128, 128\]: each width once",
        ),
        (
            [{"head_dim": 64, "forward": 0.3}],
            r"widths\[0\]=.* must be a mapping of exactly head_dim, forward, backward",
        ),
        ([{"head_dim": 64, "forward": 1.3, "backward": 0.3}], r"fa.widths\[0\].forward=1.3 must be a fraction"),
        ([{"head_dim": 0, "forward": 0.3, "backward": 0.3}], r"widths\[0\].head_dim=0 must be a positive number"),
        ({"head_dim": 64}, r"fa.widths=.* must be a list of measured widths"),
    ],
)
def test_measured_widths_must_be_distinct_fractions(widths, pattern):
    raw = _raw()
    kernel = {"forward": 0.3, "backward": 0.3, "widths": widths}
    raw["device"] |= {"attention_kernels": {"fa": kernel}, "fused_attention": "fa"}
    with pytest.raises(PresetError, match=pattern):
        hardware_from_dict(raw)


def test_a_measured_width_faster_than_its_exponentials_allow_is_a_preset_error():
    raw = _raw()
    kernel = {"forward": 0.3, "backward": 0.3, "widths": [{"head_dim": 64, "forward": 0.9, "backward": 0.3}]}
    exponentials = raw["device"]["peak_flops"]["bfloat16"] / 500  # one takes 500 product FLOPs' time at the peak
    raw["device"] |= {"attention_kernels": {"fa": kernel}, "fused_attention": "fa"}
    raw["device"] |= {"special_function_flops": exponentials}  # 0.3 at 128 wide leaves room; 0.9 at 64 does not
    with pytest.raises(PresetError, match=r"a rate of 0.9 at head_dim 64 is faster than its exponentials allow"):
        hardware_from_dict(raw)


def test_an_unknown_kernel_is_a_preset_error():
    with pytest.raises(
        PresetError, match=r"kernel 'flash9' is not one of device .*attention_kernels \['cudnn', 'flash2'\]"
    ):
        load_hardware("dgx-h100").device.attention_rates("flash9", 4096)


def test_a_preset_round_trips_through_to_dict():
    hw = load_hardware("dgx-h100")
    assert hardware_from_dict(hw.to_dict()) == hw


@pytest.mark.parametrize(
    ("kernel", "pattern"),
    [
        ({"forward": 0.9, "backward": 0.5}, r"a rate of 0.9 at head_dim 128 is faster than its exponentials allow"),
        ({"forward": 0.3, "backward": 0.3, "overlapped": True}, r"a rate of 0.3 .* \(at most 0.\d+ beside the"),
        ({"forward": True, "backward": 0.3}, r"device.attention_kernels.fa.forward=True must be a fraction"),
        ({"forward": 0.3}, r"device.attention_kernels.fa=.* must be a mapping with forward and backward"),
    ],
)
def test_kernel_rates_must_be_numbers_the_exponentials_allow(kernel, pattern):
    raw = _raw()
    raw["device"] |= {"attention_kernels": {"fa": kernel}, "fused_attention": "fa", "special_function_flops": 1e11}
    with pytest.raises(PresetError, match=pattern):
        hardware_from_dict(raw)


def test_a_format_can_reach_its_own_share_of_its_peak():
    """FP8 products run at the preset's format_efficiency of the FP8 peak; other formats at matmul_efficiency."""
    from hyperjax.cost import gemm_time

    hw = load_hardware("dgx-h100")
    assert hw.device.efficiency("fp8") == hw.device.format_efficiency["fp8"] != hw.device.matmul_efficiency
    assert hw.device.efficiency("bfloat16") == hw.device.matmul_efficiency
    n = 16384
    t = gemm_time(n, n, n, bytes_per_element=1, dtype="fp8", hardware=hw)
    assert t == pytest.approx(
        2 * n**3 / (hw.peak_flops("fp8") * hw.device.efficiency("fp8")) + hw.device.kernel_overhead
    )
    raw = _raw()
    raw["device"]["format_efficiency"] = {"fp4": 0.5}
    with pytest.raises(PresetError, match=r"device.format_efficiency.fp4: 'fp4' has no peak_flops entry"):
        hardware_from_dict(raw)


def test_waves_need_a_grouped_tile_height():
    raw = _raw()
    raw["device"] |= {"grouped_gemm_rows": 1, "grouped_gemm_cols": 256, "compute_units": 132}
    with pytest.raises(PresetError, match=r"device.compute_units=132 .* device.grouped_gemm_rows=1 gives it no tile"):
        hardware_from_dict(raw)


def test_a_systolic_array_is_only_for_a_device_priced_by_its_roofline():
    """Measured kernel rates (a GPU's waves over its SMs, its fused attention kernels) already hold what the
    units fill: padding to an array on top would count it twice."""
    raw = _raw("dgx-h100")
    raw["device"]["systolic_array"] = 128
    with pytest.raises(PresetError, match=r"device.systolic_array=128 pads products .* compute_units or measured"):
        hardware_from_dict(raw)
    tpu = _raw("tpu-v6e")
    assert hardware_from_dict(tpu) == load_hardware("tpu-v6e")
    assert hash(hardware_from_dict(tpu)) != hash(
        hardware_from_dict(tpu | {"device": tpu["device"] | {"systolic_array": 0}})
    )


def test_measured_widths_are_one_kernel_in_any_order_and_rates_beyond_them_follow_the_nearest():
    """The same widths listed in any order make the same (hashable) kernel; above the widest measured width
    the exponentials' rule runs from it, and without special_function_flops its measured rate holds."""
    from hyperjax.topology.device import AttentionKernel, MeasuredWidth

    a, b = MeasuredWidth(head_dim=64, forward=0.4, backward=0.3), MeasuredWidth(head_dim=256, forward=0.5, backward=0.4)
    one = AttentionKernel(forward=0.6, backward=0.5, widths=[b, a])
    assert one == AttentionKernel(forward=0.6, backward=0.5, widths=(a, b)) and hash(one) == hash(
        AttentionKernel(forward=0.6, backward=0.5, widths=(a, b))
    )
    with pytest.raises(PresetError, match=r"widths\[0\].head_dim=0 must be a positive number"):
        AttentionKernel(forward=0.6, backward=0.5, widths=(MeasuredWidth(head_dim=0, forward=0.4, backward=0.3),))
    d = load_hardware("dgx-h100").device
    k = d.attention_kernels["cudnn"]
    widest = max(k.measured(), key=lambda w: w.head_dim)
    peak, exp = d.peak_flops["bfloat16"], 1 / d.special_function_flops
    measured = 4 * widest.head_dim / (peak * widest.forward)  # overlapped: twice as wide, twice the time
    assert d.attention_rates("cudnn", 1e9, 2 * widest.head_dim)[0] == pytest.approx(
        4 * 2 * widest.head_dim / (peak * max(2 * measured, exp)) * 1e9 / (1e9 + k.seq_half)
    )
    plain = dataclasses.replace(d, special_function_flops=None)
    ramp = 1e9 / (1e9 + k.seq_half)
    assert plain.attention_rates("cudnn", 1e9, 512) == pytest.approx((widest.forward * ramp, widest.backward * ramp))
    assert plain.attention_rates("cudnn", 1e9, 32)[0] == pytest.approx(min(k.measured()).forward * ramp)


def test_devices_must_fill_whole_groups_of_each_tier_they_exceed():
    raw = _raw("dgx-h100")  # nodes of 8 under an unbounded network
    raw["devices"], raw["default_axes"] = 12, {"data": 12}
    with pytest.raises(
        PresetError, match=r"devices=12 is not a whole number of tier 'nvlink'.*multiple of 8 \(8 or 16\)"
    ):
        hardware_from_dict(raw)
    raw["devices"], raw["default_axes"] = 4, {"data": 4}  # half a node: a part of one group
    assert hardware_from_dict(raw).devices == 4
