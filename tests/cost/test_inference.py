"""Serving cost: ``predict --inference`` answers for every shipped config, decode is bound by reading the
weights and the cache, the cache is sized per device, and bad serving settings exit 2."""

import json
from pathlib import Path

import pytest

import hyperjax
from hyperjax.cli.main import main
from hyperjax.cost.inference import TRAINING_ONLY, estimate_inference

ROOT = Path(__file__).parents[2]
FIELDS = {"prefill_s", "decode_s_per_token", "tokens_per_s_per_device", "kv_cache_gib_per_device"}
SERVE_70B = [  # Llama-3-70B's shape on one DGX H100 node, tensor 8
    "parallel.data=1", "parallel.pipeline=1", "parallel.virtual_stages=1", "parallel.schedule=1f1b",
    "parallel.sequence_parallel=false", "train.global_batch=1",
]  # fmt: skip


SERVED = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if "\nrl:" not in p.read_text())
"""Every shipped config but those of reinforcement learning, whose rollout is priced inside an iteration."""


@pytest.mark.parametrize("config", SERVED)
def test_predict_inference_answers_for_every_shipped_config(capsys, config):
    assert main(["predict", str(ROOT / "configs" / config), "--inference", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert FIELDS | {"memory_per_device_gib", "fits"} <= set(out)
    assert all(out[k] > 0 for k in FIELDS)
    assert out["prefill_s"] > 0 and out["decode_s_per_token"] > 0


def llama70b(*sets: str):
    cfg = hyperjax.load_config(ROOT / "configs/llama3-70b.yaml", [*SERVE_70B, *sets])
    return estimate_inference(hyperjax.resolve(cfg, 8))


def test_decode_reads_every_weight_and_the_whole_cache():
    est = llama70b("serve.batch=1", "serve.prompt_len=4096", "serve.new_tokens=4096")
    hw = est.run.hardware.device
    # one KV head of 128 per device (8 heads over tensor 8), key and value, bf16, 80 layers, 8192 tokens
    assert est.kv_cache_gib_per_device * 2**30 == pytest.approx(80 * 2 * 128 * 2 * 8192)
    weights = est.memory_per_device_gib["weights"] * 2**30
    assert est.decode_s_per_token > weights / (hw.hbm_bandwidth * hw.memory_efficiency)
    longer = llama70b("serve.batch=1", "serve.prompt_len=65536", "serve.new_tokens=1", "model.seq_len=131072")
    extra = longer.decode_breakdown_s["kv_cache_read"] - est.decode_breakdown_s["kv_cache_read"]
    more = 80 * 2 * 128 * 2 * (65536 + 0.5 - 6144)  # the mean context grows from 4096 + 4096 / 2
    assert extra == pytest.approx(more / (hw.hbm_bandwidth * hw.memory_efficiency), rel=0.1)  # and the scores
    # a batch of 8 reads the weights once: far less than 8 times the time of one sequence
    assert llama70b("serve.batch=8").decode_s_per_token < 1.5 * llama70b("serve.batch=1").decode_s_per_token


def test_a_context_split_holds_its_share_of_the_cache_and_decodes_each_token_whole():
    """Decoding with a context axis, each device of the group keeps its share of the cache by position and
    reads it; the new token's products run whole on every device of the group (they are not split like a
    sequence), and the partial attention outputs are combined over the group."""
    long = ["serve.batch=1", "serve.prompt_len=65536", "serve.new_tokens=1", "model.seq_len=131072"]
    one = estimate_inference(
        hyperjax.resolve(hyperjax.load_config(ROOT / "configs/llama3-70b.yaml", [*SERVE_70B, *long]), 8)
    )
    cfg = hyperjax.load_config(ROOT / "configs/llama3-70b.yaml", [*SERVE_70B, *long, "parallel.context=2"])
    two = estimate_inference(hyperjax.resolve(cfg, 16))
    assert two.kv_cache_gib_per_device == pytest.approx(one.kv_cache_gib_per_device / 2)
    assert (
        two.decode_breakdown_s["kv_cache_read"] < 0.8 * one.decode_breakdown_s["kv_cache_read"]
    )  # each kernel's fixed time stays
    assert two.decode_breakdown_s["weights_and_compute"] == pytest.approx(one.decode_breakdown_s["weights_and_compute"])
    assert two.decode_breakdown_s["communication"] > one.decode_breakdown_s["communication"]


def test_moe_decode_reads_only_the_experts_its_tokens_touch():
    """One sequence's token routes to 2 of Mixtral's 8 experts: decode reads about a quarter of the expert
    weights, so it is far faster than reading every expert."""
    from hyperjax.cost.compute import grouped_gemm_time

    hw = hyperjax.load_hardware("dgx-h100")
    kw = dict(bytes_per_element=2, dtype="bfloat16", hardware=hw)
    two = grouped_gemm_time(2, 14336, 4096, groups=8, **kw)
    every = 8 * grouped_gemm_time(1, 14336, 4096, groups=1, **kw)
    assert two < 0.3 * every
    # in training, rows far outnumber experts: every group is touched, its tiles sharing the kernel's waves
    # with the other groups' (one kernel's last wave idles less than eight kernels' last waves)
    many = grouped_gemm_time(8 * 4096, 14336, 4096, groups=8, **kw)
    apart = 8 * grouped_gemm_time(4096, 14336, 4096, groups=1, **kw) - 7 * hw.device.kernel_overhead
    assert 0.95 * apart < many < apart


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["serve.batch=3"], "serve.batch=3 is split over 4 data-parallel replicas"),
        (["serve.prompt_len=100", "serve.new_tokens=100"], "learned positions reach model.seq_len=128"),
        (["serve.prompt_len=129", "model.family=llama"], "serve.prompt_len=129 is longer than model.seq_len=128"),
        (["serve.batch=0"], "serve.batch=0 must be a positive integer"),
        # training settings serving does not read
        (["train.recompute=full"], "--set train.recompute: predict --inference prices serving, which does not"),
        (["parallel.tp_overlap=pipelined"], "--set parallel.tp_overlap: predict --inference prices serving"),
        (["train.fp8.recipe=rowwise"], "--set train.fp8.recipe: predict --inference prices serving"),
    ],
)
def test_bad_serving_settings_exit_2(capsys, sets, message):
    args = ["predict", str(ROOT / "configs/quickstart.yaml"), "--inference", *(a for s in sets for a in ("--set", s))]
    assert main(args) == 2
    assert message in capsys.readouterr().err


# a setting of each training-only key away from its default, with what it needs beside it
CHANGED = {
    "train.steps": "7",
    "train.lr": "1e-3",
    "train.warmup_steps": "0",
    "train.min_lr_ratio": "0.5",
    "train.weight_decay": "0.0",
    "train.beta1": "0.8",
    "train.beta2": "0.9",
    "train.grad_clip": "0.5",
    "train.grad_dtype": "bfloat16",
    "train.optimizer_state": "bfloat16",
    "train.elementwise": "eager",
    "train.cross_entropy": "eager",
    "train.fp8": "{recipe: tensorwise}",
    "train.recompute": "full",
    "train.reforward": "whole",
    "train.recompute_modules": "[mlp_act]",
    "train.checkpoint_every": "3",
    "train.keep_checkpoints": "1",
    "parallel.zero_stage": "1",
    "parallel.dp_overlap": "none",
    "parallel.tp_overlap": "pipelined",
    "parallel.fsdp_unit": "layer",
    "parallel.fsdp_reshard": "false",
    "parallel.gradient_buckets": "true",
    "parallel.overlap": "two-microbatch",
}
BESIDE = {"train.recompute_modules": ["train.recompute=selective"], "parallel.gradient_buckets": ["parallel.fsdp=1"]}


def test_the_training_keys_serving_refuses_are_the_ones_it_does_not_read():
    """Every key predict --inference refuses leaves the serving estimate as it was, on a layout where each could
    matter (FSDP, tensor and expert parallelism with sequence parallelism, bfloat16 on an FP8 device): the
    refused list holds no key serving reads."""
    base = ["parallel.fsdp=2", "parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true"]
    base += ["train.dtype=bfloat16", "hardware=dgx-h100"]

    def served(sets):
        cfg = hyperjax.load_config(ROOT / "configs/moe-tiny.yaml", [*base, *sets])
        return {k: v for k, v in estimate_inference(hyperjax.resolve(cfg, 8)).to_dict().items() if k != "run"}

    assert set(CHANGED) == set(TRAINING_ONLY)
    for key, value in CHANGED.items():
        beside = BESIDE.get(key, [])
        assert served([f"{key}={value}", *beside]) == served(beside), key
    assert served(["parallel.expert=1", "parallel.data=2"]) != served([])  # a read key changes it


def test_trace_is_refused_with_inference(capsys, tmp_path):
    args = ["predict", str(ROOT / "configs/quickstart.yaml"), "--inference", "--trace", str(tmp_path / "t.json")]
    assert main(args) == 2
    assert "--trace" in capsys.readouterr().err


def test_published_dense_decode_rows_are_predicted_within_a_third():
    """The validation rows (benchmarks/validation/inference): every dense decode figure within 35 %."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from validate import serving_row

    rows = [serving_row(p) for p in sorted((ROOT / "benchmarks/validation/inference").glob("*.yaml"))]
    dense = [r["decode_s_per_token"]["error"] for r in rows if r["kind"] == "dense"]
    dense = [e for e in dense if e is not None]
    assert len(dense) >= 6 and max(abs(e) for e in dense) < 0.35


def test_inference_fits_the_offload_budget_and_places_what_does_not(capsys):
    base = [
        "predict", str(ROOT / "configs/llama3-70b.yaml"), "--inference", "--json", "--devices", "8",
        "--set", "parallel.data=1", "--set", "parallel.pipeline=1", "--set", "parallel.virtual_stages=1",
        "--set", "parallel.schedule=1f1b", "--set", "serve.prompt_len=32000", "--set", "serve.new_tokens=1",
        "--set", "serve.batch=4", "--set", "model.seq_len=32768",
    ]  # fmt: skip

    def answer(*sets: str) -> dict:
        assert main([*base, *(x for s in sets for x in ("--set", s))]) == 0
        return json.loads(capsys.readouterr().out)

    whole = answer()
    assert whole["fits"] and "offload" not in whole and whole["memory_per_device_gib"]["peak"] > 20
    squeezed = answer("offload.device_memory_gib=20")  # the budget judges fits, not the 80 GB of HBM
    assert not squeezed["fits"]
    placed = answer("offload.device_memory_gib=20", "offload.policy=auto")
    offload = placed["offload"]
    assert placed["fits"] and offload["fits"] and offload["peak_gib"] <= 20 and offload["budget_gib"] == 20
    assert offload["kv_blocks_on_host"] > 0 and offload["decode_s_per_token"] > offload["device_only_s_per_token"]
    # one answer: the run's step, throughput and memory are the placement's, the fetches a term of their own
    exposed = offload["decode_s_per_token"] - offload["device_only_s_per_token"]
    assert offload["policy"] == "auto" and placed["decode_breakdown_s"]["exposed_host_fetch"] == exposed
    assert placed["decode_s_per_token"] == pytest.approx(squeezed["decode_s_per_token"] + exposed, rel=1e-12)
    assert placed["decode_s_per_token"] == pytest.approx(sum(placed["decode_breakdown_s"].values()), rel=1e-12)
    assert placed["tokens_per_s_per_device"] == pytest.approx(4 / 8 / placed["decode_s_per_token"], rel=1e-9)
    mem, squeezed_mem = placed["memory_per_device_gib"], squeezed["memory_per_device_gib"]
    assert mem["peak"] == offload["peak_gib"] and mem["host"] == offload["host_gib"]
    assert mem["kv_cache"] == pytest.approx(squeezed_mem["kv_cache"] - offload["kv_cache_host_gib"], rel=1e-9)
    assert placed["kv_cache_gib_per_device"] == pytest.approx(mem["kv_cache"], rel=1e-9)
    greedy = answer("offload.device_memory_gib=20", "offload.policy=greedy")["offload"]
    assert greedy["policy"] == "greedy" and greedy["decode_s_per_token"] >= offload["decode_s_per_token"] * (1 - 1e-3)
    assert main([*base, "--set", "offload.policy=manual"]) == 2  # manual names training's groups
    assert "offload.policy='manual'" in capsys.readouterr().err
    assert main([*base, "--set", "offload.policy=auto", "--set", "offload.prefetch=0"]) == 2
    assert "offload.prefetch=0: serving fetches" in capsys.readouterr().err


def test_predict_inference_prints_the_serving_layout(capsys):
    """A forward pass has no micro-batches, schedule, optimizer sharding or gradient buckets: the strategy line
    of ``predict --inference`` names the stages and axes alone."""
    assert main(["predict", str(ROOT / "configs/llama3-70b.yaml"), "--inference"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "strategy:" in x)
    assert line.strip().startswith("strategy: pipeline 128 devices (data=16,tensor=8)")
    assert "micro-batches" not in line and "interleaved" not in line and "gradient buckets" not in line
    assert main(["predict", str(ROOT / "configs/llama3-70b.yaml")]) == 0
    assert "32 micro-batches" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("model", "tensor"),
    [
        (dict(family="llama", d_model=256, heads=8, kv_heads=2), 1),
        (dict(family="llama", d_model=256, heads=8, kv_heads=2), 2),
        (dict(family="llama", d_model=256, heads=8, kv_heads=1), 4),  # one head: every device holds it
        (dict(family="llama", attention="mla", heads=8, kv_lora_rank=64, rope_head_dim=16, qk_norm=False), 4),
    ],
)
def test_the_priced_cache_is_the_cache_generation_allocates(model, tensor):
    from hyperjax.config import ModelConfig
    from hyperjax.cost.inference import kv_bytes_per_token
    from hyperjax.models.decode import cache_bytes

    m = ModelConfig(**model)
    held = cache_bytes(m, "bfloat16", 3, 17, lambda axis: tensor if axis == "act_kv_heads" else 1)  # rounded up
    assert held == m.layers * 3 * 17 * kv_bytes_per_token(m, tensor, 2) > 0


def test_a_vision_encoder_runs_once_in_the_prefill_and_holds_no_cache():
    """A vision-language model's encoder encodes the image in the prefill, over its patches; a decode step
    runs the language model alone, and only its blocks cache keys and values. Before, every new token paid
    the encoder's blocks and the encoder held a cache."""
    path = ROOT / "configs" / "vlm-8b-cm384.yaml"
    est = {
        n: estimate_inference(hyperjax.resolve(hyperjax.load_config(path, [f"model.vision.layers={n}"])))
        for n in (1, 24, 96)
    }
    assert est[1].decode_s_per_token == est[24].decode_s_per_token == est[96].decode_s_per_token
    assert est[1].kv_cache_gib_per_device == est[96].kv_cache_gib_per_device
    assert est[1].prefill_s < est[24].prefill_s < est[96].prefill_s


def test_image_tokens_are_prefilled_and_cached_with_the_prompt():
    """A vision-language model's image tokens prefix every prompt in the language model: the prefill runs over
    them and the cache holds them. Before, the cache and the prefill counted the text prompt alone."""
    path = ROOT / "configs" / "vlm-8b-cm384.yaml"
    sets = ["serve.prompt_len=512", "serve.new_tokens=512"]
    est = {
        size: estimate_inference(
            hyperjax.resolve(hyperjax.load_config(path, [*sets, f"model.vision.image_size={size}"]))
        )
        for size in (14, 336)  # 1 and 576 image tokens
    }
    assert [e.image_tokens for e in est.values()] == [1, 576]
    assert est[336].cached_tokens == 576 + 512 + 512
    ratio = est[336].kv_cache_gib_per_device / est[14].kv_cache_gib_per_device
    assert ratio == pytest.approx((576 + 1024) / (1 + 1024))
    assert est[336].prefill_s > 1.4 * est[14].prefill_s  # the language model prefills 1,088 tokens, not 513
    assert est[336].to_dict()["image_tokens"] == 576


def test_a_token_crosses_every_chunk_boundary_of_an_interleaved_pipeline():
    """Virtual stages put consecutive chunks on consecutive stages round the pipeline: a token crosses
    chunks - 1 boundaries, not stages - 1, each a hand-over of its hidden state."""
    path = ROOT / "configs" / "llama3-70b.yaml"
    sets = {v: ["parallel.schedule=1f1b"] if v == 1 else [] for v in (1, 5, 10)}
    est = {
        v: estimate_inference(hyperjax.resolve(hyperjax.load_config(path, [f"parallel.virtual_stages={v}", *s])))
        for v, s in sets.items()
    }
    p = len(est[1].run.stages)
    hop = {v: e.decode_breakdown_s["communication"] for v, e in est.items()}
    per = (hop[10] - hop[5]) / (5 * p)  # one boundary's hand-over more per chunk added
    assert per > 0
    assert hop[5] - hop[1] == pytest.approx(per * (5 * p - 1 - (p - 1)), rel=0.25)
    assert est[1].prefill_s < est[5].prefill_s < est[10].prefill_s
