import json
import re
import typing
from pathlib import Path

import pytest
import yaml

from hyperjax import HyperjaxError, estimate, load_hardware, resolve
from hyperjax.cli.main import main
from hyperjax.config import Config, CrossEntropy, build, load_config
from hyperjax.cost import count_params, model_flops_per_sequence
from hyperjax.cost.compute import LOSS_PASSES, gemm_time
from hyperjax.cost.layer import EAGER_ELEMENTWISE, eager_ratio
from hyperjax.offload import offload_pass, with_offload
from tests.parts import DEEPSEEK_PARTS

ROOT = Path(__file__).parents[2]
VALIDATION = sorted((ROOT / "benchmarks" / "validation").glob("korthikanti-*.yaml"))
MOE_VALIDATION = sorted((ROOT / "benchmarks" / "validation").glob("megatron-*.yaml"))
A100 = load_hardware("dgx-a100-80g")


def run_with(doc: dict, *sets: str) -> Config:
    """A validation row's config with ``sets`` applied (``key=value``, as ``--set``)."""
    raw = yaml.safe_load(yaml.safe_dump(doc["config"]))
    for item in sets:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = raw
        for part in path:
            node = node[part]
        node[last] = yaml.safe_load(value)
    return build(Config, raw, "")


def run(path: Path) -> tuple[Config, dict]:
    doc = yaml.safe_load(path.read_text())
    return build(Config, doc["config"], ""), doc


def test_calibration_runs_within_bounds():
    errors = []
    for path in VALIDATION:
        cfg, doc = run(path)
        est = estimate(resolve(cfg))
        assert est.devices == doc["devices"]
        assert est.fits, doc["id"]  # these runs really ran
        errors.append(abs(est.step_time_s / doc["measured"]["step_time_s"] - 1))
    assert len(errors) == 8
    assert sum(errors) / len(errors) <= 0.10
    assert max(errors) <= 0.20


def test_moe_calibration_runs_within_their_stated_error():
    """The published mixture-of-experts runs: the docs state a mean error of 21.8 % and a worst row of
    35.7 % (what the model leaves out is listed there), every row fitting; this holds the model to that. All
    four ran force-balanced, and are priced so. The all-to-all overlap row, priced as Megatron pairs an
    interleaved pipeline's tasks, is faster than the same run without overlap, as measured."""
    errors, steps = [], {}
    for path in MOE_VALIDATION:
        cfg, doc = run(path)
        est = estimate(resolve(cfg))
        assert est.devices == doc["devices"] and cfg.model.moe is not None
        assert cfg.model.moe.load_imbalance == 1.0, doc["id"]  # recorded force-balanced in ../shared
        assert est.communication_s["expert_parallel"] > 0
        assert est.fits, doc["id"]  # these runs really ran
        errors.append(abs(est.step_time_s / doc["measured"]["step_time_s"] - 1))
        steps[doc["id"]] = est.step_time_s
        if cfg.parallel.overlap == "fb-pair":
            assert cfg.parallel.schedule == "interleaved" and errors[-1] <= 0.20, doc["id"]
    assert len(errors) == 4
    assert steps["cal-moe-qwen3-235b-h100-256-deepep-a2a-overlap"] < steps["cal-moe-qwen3-235b-h100-256-deepep"]
    assert sum(errors) / len(errors) <= 0.23
    assert max(errors) <= 0.38


def priced(folder: str) -> list[tuple[dict, object]]:
    """Each row of ``benchmarks/validation/<folder>`` with its estimate."""
    rows = []
    for path in sorted((ROOT / "benchmarks/validation" / folder).glob("*.yaml")):
        cfg, doc = run(path)
        rows.append((doc, estimate(resolve(cfg))))
    return rows


def time_error(doc: dict, est) -> float:
    return abs(est.step_time_s / doc["measured"]["step_time_s"] - 1)


def test_the_expert_parallel_overlap_ab_rows():
    """Megatron Bridge's Qwen3-30B-A3B A/B on 16 H100 without a pipeline: both ran, so both fit; the EP overlap
    (fb-pair on one stage) is the faster, by more than the measured 15 % (the docs: -18.2 % and -21.9 %, the
    overlap hiding 97 % of the exchanges where the profile saw 36.55 %)."""
    rows = {doc["id"]: (doc, est) for doc, est in priced("bridge")}
    (base_doc, base), (over_doc, over) = (
        rows[f"bridge-qwen3-30b-a3b-h100-16-hybridep{s}"] for s in ("", "-ep-overlap")
    )
    assert base.fits and over.fits and not base.run.staged and over.run.staged
    measured = over_doc["measured"]["step_time_s"] / base_doc["measured"]["step_time_s"]
    assert over.step_time_s / base.step_time_s < measured < 1
    assert max(time_error(base_doc, base), time_error(over_doc, over)) <= 0.25
    assert over.all_to_all["exposed_s"] < 0.1 * base.all_to_all["exposed_s"]
    # HybridEP's 32 SMs (parallel.dispatcher_sms) slow the compute beside the hidden exchange more than
    # DeepEP's 20; without overlap nothing runs beside it, so the SMs change nothing
    for doc, est, slower in ((base_doc, base, False), (over_doc, over, True)):
        sms20 = estimate(resolve(run_with(doc, "parallel.dispatcher_sms=20"))).step_time_s
        assert (est.step_time_s > sms20) is slower and est.run.exchange_share == pytest.approx(32 / 132)


def test_tpu_and_torchtitan_rows_within_their_stated_error():
    """MaxText's TPU v5e rows (docs: 6.5 % mean, all fit in 16 GB) and torchtitan's memory (2.7 % mean, worst
    5.5 %): this holds the model to what the docs print."""
    tpu = priced("tpu")
    assert all(est.fits for _, est in tpu)  # these runs really ran
    assert len(tpu) == 24 and sum(time_error(*row) for row in tpu) / 24 <= 0.08
    memory = [
        abs(est.memory_per_device_gib["peak"] / doc["measured"]["memory_gib"] - 1) for doc, est in priced("torchtitan")
    ]
    assert len(memory) == 6 and max(memory) <= 0.06


def test_the_tpu_v6e_rows_within_their_stated_error():
    """MaxText's TPU v6e recipes (added rows, not calibrated on; docs: 6.8 % mean, worst 21.9 %), priced as
    predict prices them: the recipes that offload each block's input (and the queries, keys and values) run
    that placement, whose re-forward skips the products of what it fetches and, as a rematerialised JAX
    block's does, the MLP's output product."""
    errors, fitting = {}, []
    for path in sorted((ROOT / "benchmarks/validation/tpu-v6e").glob("*.yaml")):
        cfg, doc = run(path)
        r = resolve(cfg)
        assert r.hardware.name == "tpu-v6e" and r.devices == doc["devices"]
        est = estimate(r)
        if r.offload != "none":
            placed = with_offload(offload_pass(r))
            assert placed.step_time_s <= est.step_time_s * (1 + 1e-9), doc["id"]  # fetched, not re-run
            est = placed
        errors[doc["id"]] = est.step_time_s / doc["measured"]["step_time_s"] - 1
        fitting += [doc["id"]] if est.fits else []
    assert len(errors) == 14
    # they ran: with their block inputs on the host these two fit 32 GB (the others' logits do not, docs)
    assert {"maxtext-v6e-llama3.1-405b-8k-2x256", "maxtext-v6e-mistral-7b-8k-8"} <= set(fitting)
    assert sum(map(abs, errors.values())) / 14 <= 0.075 and max(map(abs, errors.values())) <= 0.23


def test_fp8_and_torchtitan_rows_ran_and_are_priced_within_their_stated_error():
    """NeMo's FP8 rows (docs: 6.2 % mean; every row fits with NeMo's gradient and optimizer dtypes) and
    torchtitan's times on the 500 W preset (docs: 3.0 % mean, worst 5.8 %; the eager rows eager, and every
    row's loss eager, outside the compiled blocks)."""
    fp8 = priced("fp8")
    assert [doc["id"] for doc, est in fp8 if not est.fits] == []  # these runs really ran
    assert len(fp8) == 12 and sum(time_error(*row) for row in fp8) / 12 <= 0.07
    titan = {doc["id"]: time_error(doc, est) for doc, est in priced("torchtitan")}
    assert len(titan) == 6 and max(titan.values()) <= 0.06 and sum(titan.values()) / 6 <= 0.035


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_eager_elementwise_work_costs_the_measured_ratio_more(family):
    sets = ["parallel.tensor=8", "model.attention_kernel=flash", "train.dtype=bfloat16", f"model.family={family}"]
    fused, eager = predict(sets), predict([*sets, "train.elementwise=eager"])
    f, e = fused.stages[0].parts[0].layer, eager.stages[0].parts[0].layer
    assert f.products_s == e.products_s and f.core_s == e.core_s  # the products and the attention kernel alike
    elementwise = lambda x: x.forward_s - sum(x.products_s.values()) - x.core_s
    ratio = eager_ratio(fused.run.config.model)
    assert ratio == EAGER_ELEMENTWISE[family]  # llama: RMSNorm and rotary positions; gpt: neither
    assert elementwise(e) == pytest.approx(ratio * elementwise(f))
    assert eager.step_time_s > fused.step_time_s
    with pytest.raises(HyperjaxError, match=r"train\.elementwise"):
        load_config(None, ["train.elementwise=compiled"])


def test_the_loss_streams_its_logits_as_its_implementation_does():
    """``train.cross_entropy`` changes the output layer's element-wise work alone: each micro-batch of the one
    stage pays, per logit on its device (the vocabulary split over the tensor axis), the bytes its implementation
    streams beyond the fused loss's 12 (Megatron's jit-fused loss 32, its unfused loss 52, counted in
    ``LOSS_PASSES``), at the HBM's rate, most of it in the forward."""
    assert set(LOSS_PASSES) == set(typing.get_args(CrossEntropy))
    sets = ["model.vocab=128256", "train.micro_batch=2", "parallel.data=4", "parallel.tensor=2"]
    runs = {kind: predict([*sets, f"train.cross_entropy={kind}"]) for kind in ("fused", "jit", "eager")}
    fused = runs["fused"]
    d = fused.run.hardware.device
    logits = 2 * 2048 * 128256 / 2  # one micro-batch's on one device: 2 sequences, half the vocabulary
    for kind, extra_bytes, extra_kernels, forward_bytes in (("jit", 20, 1, 18), ("eager", 40, 6, 34)):
        per_micro = logits * extra_bytes / (d.hbm_bandwidth * d.memory_efficiency) + extra_kernels * d.kernel_overhead
        assert runs[kind].step_time_s - fused.step_time_s == pytest.approx(fused.run.microbatches * per_micro)
        head = lambda est: est.stages[0].parts[0]
        more_forward = head(runs[kind]).head_forward_s - head(fused).head_forward_s
        assert more_forward == pytest.approx(logits * forward_bytes / (d.hbm_bandwidth * d.memory_efficiency), rel=0.01)
        assert head(runs[kind]).head_weight_s == head(fused).head_weight_s  # the weight-gradient product alone
        assert head(runs[kind]).layer == head(fused).layer
    with pytest.raises(HyperjaxError, match=r"train\.cross_entropy='liger' is not one of"):
        load_config(None, ["train.cross_entropy=liger"])


def test_an_encoders_projection_pays_its_product_and_no_loss():
    """A vision encoder ends in a projection into the language model, whole on every device of its submesh:
    three products of it (forward, input and weight gradients), no loss over logits and no logits kept, whatever
    ``train.cross_entropy`` says; the language model's head pays the loss."""
    # the encoder's submesh tensor-parallel too: its projection's axes (None, "embed") leave it whole
    meshes = "mpmd.submeshes=[{name: vision, modules: [encoder], devices: 2, tensor: 2}, " + (
        "{name: language, modules: [language_model], devices: 6, tensor: 2}]"
    )
    cfg = lambda kind: load_config(ROOT / "configs/vlm-tiny-mpmd.yaml", [meshes, f"train.cross_entropy={kind}"])
    for kind in ("fused", "eager"):
        est = estimate(resolve(cfg(kind)))
        encoder = next(p for s in est.stages for p in s.parts if p.module == "encoder")
        v, run = cfg(kind).model.vision, est.run
        tokens = run.micro_batch * v.patches
        product = gemm_time(tokens, 128, v.d_model, bytes_per_element=4, dtype=run.dtype, hardware=run.hardware)
        assert encoder.head_s == pytest.approx(3 * product)
        assert (encoder.head_forward_s, encoder.head_weight_s, encoder.head_bytes) == (product, product, 0.0)
        lm = next(p for s in est.stages for p in s.parts if p.module == "language_model")
        assert lm.head_bytes > 0 and lm.head_s > 3 * lm.head_weight_s  # the loss's streams besides its products


def test_the_validation_rows_say_how_their_loss_ran():
    """Each training row names its loss as its framework ran it: Megatron of 2022 and NeMo's launcher defaults
    unfused, NeMo's configs that set cross_entropy_loss_fusion jit-fused, torchtitan's loss eager outside its
    compiled blocks, the MoE runs' Transformer Engine kernels fused (MaxText's XLA loss: the default)."""
    want = {"korthikanti-": "eager", "tt2412-": "eager", "megatron-": "fused", "maxtext-": "fused", "bridge-": "fused"}
    jit = ("llama3-8b", "llama3-70b", "nemotron3-8b", "nemotron3-22b")
    for path in sorted((ROOT / "benchmarks/validation").rglob("*.yaml")):
        if path.parent.name == "inference":
            continue
        cfg, _ = run(path)
        prefix = next((p for p in want if path.name.startswith(p)), None)
        expected = want[prefix] if prefix else ("jit" if any(k in path.name for k in jit) else "eager")
        assert cfg.train.cross_entropy == expected, path.name


def test_fsdp_materialises_its_unit():
    sets = ["parallel.fsdp=8", "parallel.data=1", "emulate.devices=8", "parallel.tensor=1"]
    tensor = predict([*sets, "parallel.fsdp_unit=tensor"])
    layer = predict([*sets, "parallel.fsdp_unit=layer"])
    t, lay = tensor.stages[0].parts[0].layer, layer.stages[0].parts[0].layer
    params = lambda est: est.stages[0].memory["params"]
    # a whole layer's two gathered copies and float32 gradient against one tensor's
    assert params(layer) - params(tensor) == pytest.approx(lay.params * 8 * 8 - t.largest_param * 8)


def test_fsdp_over_context_shards_the_state_over_both_and_reduces_over_neither_again():
    sets = ["parallel.fsdp=4", "parallel.context=2", "parallel.data=1", "emulate.devices=8", "parallel.tensor=1"]
    apart = predict(sets)
    both = predict([*sets, "parallel.fsdp_context=true"])
    assert both.memory_per_device_gib["optimizer"] == pytest.approx(apart.memory_per_device_gib["optimizer"] / 2)
    assert both.stages[0].parts[0].layer.params == pytest.approx(apart.stages[0].parts[0].layer.params / 2)
    assert apart.communication_s["data_parallel"] > 0 == both.communication_s["data_parallel"]


def test_a_ring_runs_shorter_attention_kernels_and_hides_its_exchange():
    """``parallel.context_impl: ring`` (Transformer Engine's ``p2p``): the busiest device's causal block over
    s / cp keys, then cp - 1 blocks of as many scores over half a block's keys, unmasked, each at the fused
    kernel's rate for the keys its query blocks visit; each block's output folded into the output, and
    backward its query gradient and half its key-value gradient added to (16-bit, 6 bytes an element); the
    ring's transfers beside the kernels, which they slow by the device's share, but the backward's last block
    of gradients."""
    sets = ["hardware=dgx-h100", "model.attention_kernel=flash", "model.seq_len=8192", "model.kv_heads=8"]
    sets += ["parallel.tensor=1", "emulate.devices=8", "train.micro_batch=1"]
    layer = lambda est: est.stages[0].parts[0].layer
    d, nvlink = load_hardware("dgx-h100").device, load_hardware("dgx-h100").tiers[0]
    k, peak, hd = d.attention_kernels["cudnn"], 989e12, 128
    rate = lambda keys, r: peak * r * keys / (keys + k.seq_half)
    stream = lambda nbytes, ops: nbytes / (d.hbm_bandwidth * d.memory_efficiency) + ops * d.kernel_overhead
    kv_bytes = 2 * 8192 * 8 * hd * 2  # a sequence's keys and values, 16-bit
    for cp, recompute in ((2, "none"), (4, "full")):
        case = [*sets, f"parallel.context={cp}", f"parallel.data={8 // cp}", f"train.recompute={recompute}"]
        gathered, ring = predict(case), predict([*case, "parallel.context_impl=ring"])
        queries = 8192 // cp
        scores = 32 * queries * 8192 / 2  # one sequence's local queries over all keys, causal
        out, kv = queries * 32 * hd, 2 * queries * 8 * hd  # the local output's and keys' and values' elements
        forward = [scores * 4 * hd / rate(8192, k.forward) + d.kernel_overhead]
        backward = [scores * 10 * hd / rate(8192, k.backward) + d.kernel_overhead]
        # each of the ring's blocks: its queries visit 8192 / 2cp keys on average, as a causal kernel's over
        # 8192 / cp do
        forward.append(scores * 4 * hd / rate(queries, k.forward) + cp * d.kernel_overhead)
        forward[1] += stream((6 * cp + 2) * out, 2 * cp)
        backward.append(scores * 10 * hd / rate(queries, k.backward) + cp * d.kernel_overhead)
        backward[1] += stream(6 * (cp - 1) * (out + kv / 2), 2 * (cp - 1))
        assert (layer(gathered).core_s, layer(ring).core_s) == pytest.approx(forward)
        gather = (cp - 1) * nvlink.latency + (cp - 1) / cp * kv_bytes / (nvlink.bandwidth * nvlink.efficiency)
        passes = 3 if recompute == "full" else 2
        assert layer(gathered).context_comm_s == pytest.approx(passes * gather)
        # the ring's transfers all hide (a gather of 33.5 MB over NVLink beside 0.1-0.4 ms kernels) but the
        # last block of gradients, returned after the last kernel; what hides slows the kernels
        assert layer(ring).context_comm_s == pytest.approx(gather / (cp - 1))
        share = d.comm_compute_share
        slower = (passes - 1) * gather * share
        both = lambda est: layer(est).backward_s + layer(est).recompute_s
        assert layer(ring).forward_s - layer(gathered).forward_s == pytest.approx(
            forward[1] - forward[0] + gather * share
        )
        more = both(ring) - both(gathered)
        redo = (passes - 2) * (forward[1] - forward[0])  # full recomputation re-runs the forward's attention
        assert more == pytest.approx(backward[1] - backward[0] + redo + gather * share + slower)
        assert ring.step_time_s > gathered.step_time_s
    with pytest.raises(HyperjaxError, match=r"parallel.context_impl=ring .* model.attention_kernel='materialized'"):
        big([*sets[:1], *sets[2:], "parallel.context=2", "parallel.context_impl=ring"])


def test_fsdp_kept_gathered_trades_memory_for_gathers():
    sets = ["parallel.fsdp=4", "parallel.pipeline=2", "parallel.data=1", "emulate.devices=8", "train.micro_batch=2"]
    freed, kept = predict(sets), predict([*sets, "parallel.fsdp_reshard=false"])
    stage = freed.stages[0]
    unsharded = sum(p.layers * p.layer.params * 4 for p in stage.parts)
    grown = kept.stages[0].memory["params"] + kept.stages[0].memory["gradients"]
    grown -= stage.memory["params"] + stage.memory["gradients"]
    whole = max(p.layer.largest_param for p in stage.parts) * 8  # the two tensors and a gradient it no longer needs
    assert grown == pytest.approx(unsharded * 4 - whole)  # 16-bit copies and 16-bit gradients of every layer
    once = sum(p.layers * (p.layer.fsdp_gather_s + p.layer.fsdp_scatter_s) for p in kept.stages[0].parts)
    assert freed.run.microbatches > 1 and kept.communication_s["fsdp"] == pytest.approx(once)
    assert freed.communication_s["fsdp"] > freed.run.microbatches * once  # two gathers a layer per micro-batch


def test_model_flops_match_korthikanti_eq7():
    cfg, _ = run(ROOT / "benchmarks/validation/korthikanti-175b-sp-selective.yaml")
    m, b = cfg.model, cfg.train.global_batch
    eq7 = (
        72
        * b
        * m.layers
        * m.seq_len
        * m.d_model**2
        * (1 + m.seq_len / (6 * m.d_model) + m.vocab / (12 * m.d_model * m.layers))
    )
    # eq. 7 drops biases and norms; the formulas agree to well under a percent
    assert model_flops_per_sequence(m) * b == pytest.approx(eq7, rel=0.005)
    assert count_params(m) == pytest.approx(175e9, rel=0.02)


def test_breakdown_adds_up():
    cfg, _ = run(VALIDATION[0])
    est = estimate(resolve(cfg))
    assert sum(est.breakdown_s.values()) == pytest.approx(est.step_time_s)
    assert 0 < est.mfu < 1


def big(sets):
    return load_config(
        None,
        [
            "model.layers=32",
            "model.d_model=4096",
            "model.heads=32",
            "model.d_ff=16384",
            "model.vocab=32000",
            "model.seq_len=2048",
            "train.global_batch=64",
            "train.dtype=bfloat16",
            "hardware=dgx-a100-80g",
            *sets,
        ],
    )


def predict(sets):
    return estimate(resolve(big(sets)))


def test_more_microbatches_shrink_the_bubble():
    few = predict(["parallel.pipeline=4", "train.micro_batch=8"])
    many = predict(["parallel.pipeline=4", "train.micro_batch=1"])
    assert many.breakdown_s["pipeline_bubble"] / many.step_time_s < few.breakdown_s["pipeline_bubble"] / few.step_time_s
    inter = predict(
        ["parallel.pipeline=4", "train.micro_batch=1", "parallel.virtual_stages=2", "parallel.schedule=interleaved"]
    )
    assert inter.breakdown_s["pipeline_bubble"] < many.breakdown_s["pipeline_bubble"]


def test_tensor_parallel_across_nodes_is_slower():
    inside = predict(["parallel.tensor=8", "parallel.data=2"])
    # 16-way tensor parallelism must cross InfiniBand
    across = predict(["parallel.tensor=16", "parallel.data=1", "model.heads=32"])
    assert across.communication_s["tensor_parallel"] > 2 * inside.communication_s["tensor_parallel"]


def test_does_not_fit_names_the_term():
    est = predict(["model.layers=200", "parallel.tensor=1", "parallel.data=1", "train.micro_batch=1"])
    assert not est.fits and est.overflow == "optimizer"
    zero = predict(["model.layers=200", "parallel.fsdp=64", "parallel.data=1", "train.micro_batch=1"])
    assert zero.memory_per_device_gib["optimizer"] < est.memory_per_device_gib["optimizer"] / 32


def test_recompute_trades_memory_for_time():
    none = predict(["parallel.tensor=8"])
    full = predict(["parallel.tensor=8", "train.recompute=full"])
    assert full.memory_per_device_gib["activations"] < none.memory_per_device_gib["activations"] / 5
    assert full.step_time_s > none.step_time_s and full.breakdown_s["recompute"] > 0


def test_tensor_parallel_overlap_hides_collectives_behind_products_and_slows_them():
    runs = {o: predict(["parallel.tensor=8", f"parallel.tp_overlap={o}"]) for o in ("none", "bulk", "pipelined")}
    comm = {o: r.stages[0].parts[0].layer.tensor_comm_s for o, r in runs.items()}
    assert comm["none"] > comm["bulk"] > comm["pipelined"] > 0  # a first chunk stays exposed
    assert runs["none"].step_time_s > runs["bulk"].step_time_s > runs["pipelined"].step_time_s
    slowed = runs["pipelined"].stages[0].parts[0].layer.forward_s - runs["none"].stages[0].parts[0].layer.forward_s
    assert slowed > 0  # the products run beside the collective on fewer units


def test_data_parallel_overlap_exposes_the_reduction_as_configured():
    sets = [
        "parallel.tensor=8",
        "parallel.data=8",
        "emulate.devices=64",
        "parallel.zero_stage=1",
        "train.micro_batch=2",
    ]
    exposed = {
        o: predict([*sets, f"parallel.dp_overlap={o}"]).stages[0].data_parallel_exposed_s
        for o in ("none", "backward", "full")
    }
    whole = predict([*sets, "parallel.dp_overlap=none"]).stages[0].data_parallel_s
    assert exposed["none"] == whole > exposed["backward"] >= exposed["full"]


def test_gradient_dtype_halves_the_buffer_and_its_reduction():
    sets = [
        "parallel.tensor=8",
        "parallel.data=8",
        "emulate.devices=64",
        "parallel.zero_stage=1",
        "train.dtype=bfloat16",
    ]
    wide, narrow = predict(sets), predict([*sets, "train.grad_dtype=bfloat16"])
    trained = wide.stages[0].memory["gradients"] / 4  # float32: four bytes a parameter, whole under ZeRO-1
    assert narrow.stages[0].memory["gradients"] == pytest.approx(trained * 2)
    assert narrow.stages[0].memory["optimizer"] == wide.stages[0].memory["optimizer"]
    assert 0 < narrow.stages[0].data_parallel_s < wide.stages[0].data_parallel_s
    fsdp = ["parallel.fsdp=8", "parallel.data=1", "emulate.devices=8", "parallel.tensor=1", "train.dtype=bfloat16"]
    layer = lambda est: est.stages[0].parts[0].layer
    assert layer(predict([*fsdp, "train.grad_dtype=bfloat16"])).fsdp_scatter_s < layer(predict(fsdp)).fsdp_scatter_s
    with pytest.raises(HyperjaxError, match=r"train\.grad_dtype='float16' is not one of \('float32', 'bfloat16'\)"):
        load_config(None, ["train.grad_dtype=float16"])


@pytest.mark.parametrize(("state", "master", "moments"), [("float32", 4, 8), ("remainders", 2, 8), ("bfloat16", 0, 4)])
def test_optimizer_state_sets_the_master_and_moments(state, master, moments):
    sets = ["parallel.tensor=8", "parallel.data=8", "emulate.devices=64", "train.dtype=bfloat16"]
    sharded = predict([*sets, "parallel.zero_stage=1", f"train.optimizer_state={state}"]).stages[0]
    params = sharded.memory["gradients"] / 4  # the trained parameters, float32 gradients whole
    assert sharded.memory["optimizer"] == pytest.approx(params * (master + moments) / 8)  # over 8 replicas
    whole = predict([*sets, f"train.optimizer_state={state}"]).stages[0]
    assert whole.memory["optimizer"] == pytest.approx(params * moments)
    assert whole.memory["params"] - sharded.memory["params"] == pytest.approx(params * master)
    with pytest.raises(HyperjaxError, match=r"train.optimizer_state='remainders' .* train.dtype=float32"):
        load_config(None, ["train.optimizer_state=remainders"])
    with pytest.raises(HyperjaxError, match=r"train\.optimizer_state='fp32' is not one of \('float32', 'remainders'"):
        load_config(None, ["train.optimizer_state=fp32"])


def test_fsdp_without_a_master_keeps_16_bit_weight_shards():
    sets = ["parallel.fsdp=8", "parallel.data=1", "emulate.devices=8", "parallel.tensor=1", "train.dtype=bfloat16"]
    master, none = predict(sets), predict([*sets, "train.optimizer_state=bfloat16"])
    shards = master.stages[0].memory["optimizer"] / 8  # float32 moments: 8 bytes a parameter's shard
    assert none.stages[0].memory["optimizer"] == pytest.approx(shards * 4)
    assert master.stages[0].memory["params"] - none.stages[0].memory["params"] == pytest.approx(shards * 2)


def test_recompute_modules_drop_what_they_name_and_rerun_its_ops():
    flash = ["parallel.tensor=8", "model.attention_kernel=flash"]
    kept = predict(flash)
    named = predict([*flash, "train.recompute=selective", "train.recompute_modules=[norms, mlp_act]"])
    assert kept.breakdown_s["recompute"] == 0 < named.breakdown_s["recompute"]
    layer = named.stages[0].parts[0].layer
    dropped = (layer.activation_bytes["norms"] + layer.activation_bytes["mlp_act"]) * named.stages[0].in_flight
    saved = kept.stages[0].memory["activations"] - named.stages[0].memory["activations"]
    assert saved == pytest.approx(dropped * named.stages[0].layers)
    with pytest.raises(HyperjaxError, match=r"train.recompute_modules=\['norm'\] must name .*'norms'"):
        load_config(None, ["train.recompute_modules=[norm]"])
    with pytest.raises(HyperjaxError, match=r"recompute_modules=\['norms'\] .* train.recompute='full'; set"):
        load_config(None, ["train.recompute=full", "train.recompute_modules=[norms]"])


def test_predict_cli_json(capsys):
    assert main(["predict", str(ROOT / "configs/quickstart.yaml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in (
        "step_time_s",
        "devices",
        "model_flops_per_step",
        "mfu",
        "memory_per_device_gib",
        "fits",
        "breakdown_s",
    ):
        assert key in data
    assert data["devices"] == 8
    assert set(data["memory_per_device_gib"]) == {"params", "optimizer", "gradients", "activations", "peak"}
    assert set(data["breakdown_s"]) == {"compute", "exposed_communication", "pipeline_bubble", "recompute", "optimizer"}
    assert data["run"]["devices"] == 8 and data["run"]["parallel"]["data"] == 4  # the run train starts


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (["parallel.tensor=3"], r"tensor=3 x pipeline=1 = 3 do not divide the 8 devices"),
        (["parallel.tensor=8", "model.heads=4"], r"dimension '(kv_)?heads' of size 4 is not divisible"),
        (["parallel.pipeline=3"], r"parallel.pipeline=3 does not divide the 8 devices"),
        (["parallel.schedule=interleaved"], r"the interleaved schedule needs virtual_stages > 1"),
        (
            ["parallel.data=5"],
            r"data=5 x fsdp=1 x expert=1 x context=1 x tensor=2 x pipeline=1 = 10, but there are 8 devices",
        ),
        (["model.attention_impl=flash2"], r"model.attention_impl='flash2' names a fused attention kernel, but"),
        (
            ["hardware=dgx-h100", "model.attention_kernel=flash", "model.attention_impl=flash3"],
            r"model.attention_impl='flash3' is not a fused attention kernel of preset .* lists \['cudnn', 'flash2'\]",
        ),
        (
            ["train.cross_entropy=eagr"],
            r"train.cross_entropy='eagr' is not one of \('fused', 'jit', 'eager'\); did you mean 'eager'\?",
        ),
        (
            ["parallel.context_impl=rings"],
            r"parallel.context_impl='rings' is not one of \('allgather', 'ring'\); did you mean 'ring'\?",
        ),
        (
            ["parallel.context=2", "parallel.tensor=1", "parallel.context_impl=ring"],
            r"parallel.context_impl=ring runs a fused attention kernel per block of keys, but "
            r"model.attention_kernel='materialized' .* set model.attention_kernel: flash, or parallel.context_impl",
        ),
    ],
)
def test_predict_errors_exit_2(capsys, sets, pattern):
    args = ["predict", str(ROOT / "configs/quickstart.yaml")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    with pytest.raises(HyperjaxError):
        estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", sets)))


def test_fused_attention_is_priced_at_its_kernels_measured_rate():
    """The attention core of a fused kernel costs its FLOPs at the preset's measured rate for that kernel: on an
    H100, FlashAttention-2 takes longer than cuDNN's kernel, and the step with it longer by about the difference
    of forward plus backward over the layers."""
    base = [
        "hardware=dgx-h100",
        "model.attention_kernel=flash",
        "model.seq_len=4096",
        "model.d_model=1024",
        "model.heads=8",
        "train.recompute=none",
    ]
    flash2 = estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*base, "model.attention_impl=flash2"])))
    cudnn = estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*base, "model.attention_impl=cudnn"])))
    default = estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", base)))
    assert default.step_time_s == cudnn.step_time_s  # the preset's fused_attention
    hw = load_hardware("dgx-h100")
    (f2, b2), (fc, bc) = (hw.device.attention_rates(k, 4096) for k in ("flash2", "cudnn"))
    run = resolve(load_config(ROOT / "configs/quickstart.yaml", base))
    m, micro = run.config.model, run.micro_batch
    flops = micro * m.heads / run.axes["tensor"] * 2 * m.seq_len**2 * 2 * m.head_dim * 0.5
    per_layer = flops / hw.matmul_flops(run.dtype) * ((1 / f2 - 1 / fc) + 2.5 * (1 / b2 - 1 / bc))
    extra = (flash2.step_time_s - cudnn.step_time_s) / (m.layers * run.microbatches)
    assert extra == pytest.approx(per_layer, rel=0.02)


def test_shard_overrides_the_estimate_does_not_price_are_named(capsys):
    """An override that moves a logical axis onto or off a mesh axis of more than one device is named by
    predict (text and JSON) and plan (each candidate); one that restates a rule, or names an axis of one
    device, changes nothing priced and is not."""
    from hyperjax.cost.unpriced import unpriced_overrides

    quick = str(ROOT / "configs/quickstart.yaml")

    def named(shard: dict, *sets: str, config: str = quick, **parallel: int) -> tuple[str, ...]:
        sets = (f"shard={json.dumps(shard)}", *sets, *(f"parallel.{k}={v}" for k, v in parallel.items()))
        return unpriced_overrides(resolve(load_config(config, sets), 8))

    assert named({}, data=4, tensor=2) == ()
    moved = {"vocab": None, "act_vocab": None, "heads": "tensor", "embed": "fsdp", "mlp": ["tensor", "data"]}
    assert named(moved, data=4, tensor=2) == ("shard.act_vocab=null", "shard.mlp=[tensor, data]", "shard.vocab=null")
    assert named({"vocab": None, "embed": None}, data=8, tensor=1) == ()  # no tensor axis, no fsdp axis to leave
    # axes the model does not name: experts' in a dense model, kv_heads under latent attention, layers
    absent = {"expert_mlp": None, "experts": "data", "layers": "fsdp"}
    assert named(absent, data=2, fsdp=2, tensor=2) == ()
    latent = {"kv_heads": None, "act_kv_heads": None, "heads": None}
    mla = ("model.layers=2", *DEEPSEEK_PARTS)
    assert named(latent, *mla, config=str(ROOT / "configs/moe-tiny.yaml"), data=1, expert=4, tensor=2) == (
        "shard.heads=null",
    )
    # MPMD submeshes: an override counts where the stage's modules name the axis
    vlm = str(ROOT / "configs/vlm-tiny-mpmd.yaml")
    encoder_split = (
        "mpmd.submeshes=[{name: vision, modules: [encoder], devices: 2, tensor: 2}, "
        "{name: language, modules: [language_model], devices: 6}]"
    )
    assert named({"vocab": None, "mlp": None}, config=vlm) == ("shard.mlp=null", "shard.vocab=null")
    # the tensor axis is the encoder's alone, whose modules name no vocabulary
    assert named({"vocab": None, "mlp": None}, encoder_split, config=vlm) == ("shard.mlp=null",)
    sets = ["--set", "parallel.data=4", "--set", "parallel.tensor=2", "--set", "shard={vocab: null, act_vocab: null}"]
    assert main(["predict", quick, *sets, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unpriced"] == ["shard.act_vocab=null", "shard.vocab=null"]
    assert main(["predict", quick, *sets]) == 0
    assert "not priced: shard.act_vocab=null, shard.vocab=null" in capsys.readouterr().out
    assert main(["predict", quick, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unpriced"] == []
    assert main(["predict", quick, *sets, "--inference", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unpriced"] == ["shard.act_vocab=null", "shard.vocab=null"]
    assert main(["plan", quick, "--devices", "8", "--json", "--top", "50", *sets[4:]]) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    for c in found:
        assert c["unpriced"] == (["shard.act_vocab=null", "shard.vocab=null"] if c["parallel.tensor"] > 1 else [])
    assert {c["parallel.tensor"] > 1 for c in found} == {True, False}
    assert main(["plan", quick, "--devices", "8", "--top", "50", *sets[4:]]) == 0
    rows = [str(i) for i, c in enumerate(found, 1) if c["unpriced"]]
    assert f"not priced (rows {', '.join(rows)}): shard.act_vocab=null, shard.vocab=null" in capsys.readouterr().out
