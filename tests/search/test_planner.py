import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from hyperjax import ConfigError, estimate, load_config, load_hardware, plan, resolve
from hyperjax.cli.main import main
from hyperjax.config import Config, build
from hyperjax.search import SEARCHED, candidate, divisors, strategies, submesh_strategies
from hyperjax.search.strategies import apply

ROOT = Path(__file__).parents[2]


def calibration(name: str) -> Config:
    return build(Config, yaml.safe_load((ROOT / "benchmarks/validation" / name).read_text())["config"], "")


@pytest.mark.parametrize(
    "name",
    ["korthikanti-22b-sp-selective.yaml", "korthikanti-175b-sp-selective.yaml", "korthikanti-175b-full-recompute.yaml"],
)
def test_plan_beats_or_matches_the_published_strategy(name):
    cfg = calibration(name)
    published = estimate(resolve(cfg))
    found = plan(cfg, published.devices, keep=3)
    best = found.best
    assert found.priced >= found.fitting > 0
    assert best[0].estimate.step_time_s <= published.step_time_s * (1 + 1e-9)
    assert best[0].estimate.fits
    # the winner really is what its overrides say
    again = estimate(resolve(candidate(cfg, best[0].overrides), published.devices))
    assert again.step_time_s == pytest.approx(best[0].estimate.step_time_s)
    assert again.run == best[0].run


def test_every_candidate_is_valid_and_covers_the_devices():
    cfg = calibration("korthikanti-22b-sp-selective.yaml")
    seen = list(strategies(cfg, 16))
    assert len(seen) > 20
    for o in seen:
        product = (
            o["parallel.data"]
            * o["parallel.fsdp"]
            * o["parallel.tensor"]
            * o["parallel.context"]
            * o["parallel.pipeline"]
        )
        assert product == 16
        assert cfg.model.heads % o["parallel.tensor"] == 0


def test_searched_names_every_parallel_key_a_strategy_sets():
    """plan holds a searched key given with --set: SEARCHED must name each key the search writes."""
    written = set()
    for name, devices, accumulate in (("qwen3-235b-a22b.yaml", 256, True), ("gpt3-175b.yaml", 64, False)):
        cfg = load_config(ROOT / "configs" / name)
        for o in strategies(cfg, devices, accumulate=accumulate):
            written |= {k.removeprefix("parallel.") for k in o if k.startswith("parallel.")}
    assert written == SEARCHED


def test_plan_cli_json(capsys):
    args = ["plan", str(ROOT / "configs/quickstart.yaml"), "--devices", "8", "--json", "--top", "3"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["candidates"]) == 3
    assert data["best"] == data["candidates"][0]
    times = [c["step_time_s"] for c in data["candidates"]]
    assert times == sorted(times)
    assert {"parallel.tensor", "parallel.pipeline", "train.recompute", "step_time_s"} <= set(data["best"])


def test_plan_cli_holds_a_searched_key_set_on_the_command_line(capsys):
    """``--set parallel.tensor=4`` keeps the search to tensor 4 (it was ignored, the search varying it anyway);
    a value no strategy passes exits 2 naming it; a key the search does not vary stays a plain setting."""
    quick = str(ROOT / "configs/quickstart.yaml")
    base = ["plan", quick, "--devices", "8", "--json", "--top", "50"]
    assert main([*base, "--set", "parallel.tensor=4", "--set", "parallel.zero_stage=1"]) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    assert found and {(c["parallel.tensor"], c["parallel.zero_stage"]) for c in found} == {(4, 1)}
    assert main([*base]) == 0
    assert len({c["parallel.tensor"] for c in json.loads(capsys.readouterr().out)["candidates"]}) > 1
    assert main(["plan", quick, "--devices", "8", "--set", "parallel.tensor=3"]) == 2
    err = capsys.readouterr().err  # with why: the sizes a tensor degree must divide
    assert "has parallel.tensor=3 (parallel.tensor=3 must divide the 8 devices, model.heads=8, model.d_ff=1024)" in err
    gqa = ["--set", "model.family=llama", "--set", "model.kv_heads=2", "--set", "parallel.tensor=4"]
    assert main(["plan", quick, "--devices", "8", *gqa]) == 2
    assert "(parallel.tensor=4 must divide model.kv_heads=2); drop" in capsys.readouterr().err  # grouped queries
    assert main(["plan", quick, "--devices", "8", "--set", "parallel.tensor=2", "--set", "parallel.context=8"]) == 2
    assert "(parallel.context=8 must divide the 4 devices parallel.tensor=2 leaves); drop" in capsys.readouterr().err
    assert main(["plan", quick, "--devices", "8", "--set", "parallel.context=3"]) == 2
    assert "(parallel.context=3 must divide the 8 devices, model.seq_len=128); drop" in capsys.readouterr().err
    assert main(["plan", quick, "--devices", "64", "--set", "parallel.context=32"]) == 2  # divides both
    assert "(parallel.context=32: the search tries context splits of 16 or fewer); drop" in capsys.readouterr().err
    sets = ["--set", "parallel.tensor=3", "--set", "parallel.sequence_parallel=true"]
    assert main(["plan", quick, "--devices", "8", *sets]) == 2
    assert "has parallel.sequence_parallel=true, parallel.tensor=3 (" in capsys.readouterr().err  # as YAML
    assert main([*base, "--set", "parallel.tp_overlap=bulk"]) == 0
    capsys.readouterr()
    # as one mapping too; a key a dense model's strategies lack and a null (derived) degree hold nothing
    assert (
        main([*base, "--set", "parallel={tensor: 4}", "--set", "parallel.expert=1", "--set", "parallel.data=null"]) == 0
    )
    assert {c["parallel.tensor"] for c in json.loads(capsys.readouterr().out)["candidates"]} == {4}
    # train.recompute too (the search kept the first that fits, "none" here, whatever it said)
    for sets in (["train.recompute=full"], ["train={recompute: full}"]):
        assert main([*base, *(a for s in sets for a in ("--set", s))]) == 0
        assert {c["train.recompute"] for c in json.loads(capsys.readouterr().out)["candidates"]} == {"full"}


def test_plan_cli_holds_a_schedule_and_chooses_its_virtual_stages(capsys):
    """A held ``parallel.schedule`` leaves the virtual stages to the search: interleaved over a config of one
    virtual stage (it was refused as the config's invalid pair) and 1F1B over one of five; both held hold both."""
    quick = str(ROOT / "configs/quickstart.yaml")
    base = ["plan", quick, "--devices", "8", "--json", "--top", "50"]
    held = lambda c: (c["parallel.schedule"], c["parallel.virtual_stages"])
    for sets in (["parallel.schedule=interleaved"], ["parallel={schedule: interleaved}"]):
        assert main([*base, *(a for s in sets for a in ("--set", s))]) == 0
        found = json.loads(capsys.readouterr().out)["candidates"]
        assert found and {held(c) for c in found} == {("interleaved", 2)}  # 4 layers: 2 stages of 2 chunks
    deep = ["--set", "model.layers=12", "--set", "parallel.schedule=interleaved"]
    assert main([*base, *deep]) == 0
    assert {held(c)[1] for c in json.loads(capsys.readouterr().out)["candidates"]} > {2}  # 3 or 4 priced too
    assert main([*base, *deep, "--set", "parallel.virtual_stages=3"]) == 0
    assert {held(c) for c in json.loads(capsys.readouterr().out)["candidates"]} == {("interleaved", 3)}
    five = ["plan", str(ROOT / "configs/llama3-70b.yaml"), "--devices", "64", "--json", "--top", "20"]
    assert main([*five, "--set", "parallel.schedule=1f1b"]) == 0  # the config: interleaved, 5 virtual stages
    assert {held(c) for c in json.loads(capsys.readouterr().out)["candidates"]} == {("1f1b", 1)}


def test_plan_cli_holds_the_micro_batch_and_their_count_set_on_the_command_line(capsys):
    """``--set train.micro_batch=2`` keeps every candidate to micro-batches of 2 rows (one stage accumulating
    them, a pipeline running them; both were ignored, the search choosing its own), ``train.microbatches``
    to that many a step; a count no strategy runs exits 2 naming it."""
    quick = str(ROOT / "configs/quickstart.yaml")
    base = ["plan", quick, "--devices", "8", "--json", "--top", "500"]

    def runs(found: list[dict]) -> set[tuple[int, int, int]]:  # (pipeline, rows, micro-batches) of each
        out = set()
        for c in found:
            per_replica = 32 // (c["parallel.data"] * c["parallel.fsdp"])
            rows = c["train.micro_batch"] or per_replica
            assert (c["micro_batch_rows"], c["microbatches"]) == (rows, per_replica // rows), c
            out.add((c["parallel.pipeline"], rows, per_replica // rows))
        return out

    assert main(base) == 0
    assert len({rows for _, rows, _ in runs(json.loads(capsys.readouterr().out)["candidates"])}) > 2
    for sets in (["train.micro_batch=2"], ["train={micro_batch: 2}"]):
        assert main([*base, *(a for s in sets for a in ("--set", s))]) == 0
        held = runs(json.loads(capsys.readouterr().out)["candidates"])
        assert {rows for _, rows, _ in held} == {2}, held
        assert {p for p, _, _ in held} > {1} and any(p == 1 and n > 1 for p, _, n in held), held
    assert main([*base, "--set", "train.microbatches=4"]) == 0
    held = runs(json.loads(capsys.readouterr().out)["candidates"])
    assert held and {n for _, _, n in held} == {4}, held
    assert main([*base, "--set", "train.microbatches=64"]) == 2
    err = capsys.readouterr().err
    assert "has train.microbatches=64; drop train.microbatches" in err and "micro_batch_rows, microbatches" in err


def test_plan_cli_accumulate(capsys):
    """``plan --accumulate`` searches one stage in micro-batches of ``train.micro_batch`` too, an MoE's
    forwards paired with the previous backward (fb-pair); without a micro-batch to accumulate it exits 2."""
    moe = str(ROOT / "configs/moe-tiny.yaml")
    args = ["plan", moe, "--devices", "8", "--json", "--top", "5000", "--accumulate", "--set", "train.micro_batch=1"]
    assert main(args) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    one = [c for c in found if c["parallel.pipeline"] == 1 and c["train.micro_batch"] == 1]
    assert {c.get("parallel.overlap", "none") for c in one} >= {"none", "fb-pair"}
    # the micro-batch given is the size accumulated, beside one stage's every row at once: not held
    assert any(c["parallel.pipeline"] == 1 and c["train.micro_batch"] is None for c in found)
    assert main(["plan", moe, "--devices", "8", "--accumulate"]) == 2
    assert "--accumulate searches one stage in micro-batches of train.micro_batch" in capsys.readouterr().err
    assert main(["plan", str(ROOT / "configs/grpo-tiny.yaml"), "--devices", "8", "--accumulate"]) == 2
    assert "an rl: config's plan accumulates its learner's micro-batches already" in capsys.readouterr().err


def test_nothing_fits(capsys):
    args = [
        "plan",
        str(ROOT / "configs/quickstart.yaml"),
        "--devices",
        "2",
        "--set",
        "model.layers=4000",
        "--set",
        "model.d_model=8192",
        "--set",
        "model.heads=64",
        "--set",
        "model.d_ff=32768",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    fits = r"none of the \d+ strategies on 2 devices fits 119 GiB per device; as it is, the leanest needs"
    assert re.search(fits, err), err
    assert err.rstrip().endswith("Use more devices, a smaller model or offload.policy: auto.")


def test_nothing_fits_for_mpmd_submeshes_answers_in_json(capsys):
    args = ["plan", str(ROOT / "configs/vlm-8b-cm384.yaml"), "--devices", "2", "--json"]
    assert main(args) == 2
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["fits"] is False and "none of the" in report["error"] and "Traceback" not in out.err
    assert [s["name"] for s in report["leanest"]["mpmd.submeshes"]] == ["vision", "language"]
    # the placement pass cannot place a vision-language model's groups, so it is not suggested
    assert "offload" not in report["error"] and report["error"].endswith("Use more devices, a smaller model.")


GPT_22B = "korthikanti-22b-sp-selective.yaml"
GPT_OSS = "megatron-bridge-gpt-oss-120b-h100-64.yaml"
MOE_SMALL = ["model.layers=6", "model.moe.first_dense=1", "model.moe.every=2", "train.global_batch=64"]
SMALL = [  # searches small enough to price exhaustively: (config, devices, overrides)
    (GPT_22B, 16, []),
    (GPT_22B, 8, ["train.global_batch=16"]),
    (GPT_22B, 32, ["model.family=llama", "model.kv_heads=8", "train.global_batch=64"]),
    (GPT_OSS, 16, [*MOE_SMALL, "emulate.devices=16"]),  # dense and MoE blocks, expert degree searched
]


def small_case(name: str, overrides: list[str]) -> Config:
    from hyperjax.config import apply_override

    raw = yaml.safe_load((ROOT / "benchmarks/validation" / name).read_text())["config"]
    for item in overrides:
        apply_override(raw, item)
    return build(Config, raw, "")


@pytest.mark.parametrize(("name", "devices", "overrides"), SMALL)
def test_pruned_search_is_the_exhaustive_one(name, devices, overrides):
    cfg = small_case(name, overrides)
    fast = plan(cfg, devices, keep=5)
    full = plan(cfg, devices, keep=5, prune=False)
    assert fast.priced < full.priced and fast.searched == full.searched
    assert [c.overrides for c in fast.best] == [c.overrides for c in full.best]
    assert [c.estimate.step_time_s for c in fast.best] == [c.estimate.step_time_s for c in full.best]


def test_the_search_prices_as_predict_does():
    """Brute force: every strategy resolved and priced on the public path gives the search's answer."""
    from hyperjax.errors import HyperjaxError
    from hyperjax.search import price
    from hyperjax.search.strategies import RECOMPUTE

    cfg = small_case(GPT_22B, ["train.global_batch=16"])
    hw = load_hardware(cfg.hardware)
    brute = []
    for i, combo in enumerate(strategies(cfg, 8)):
        for recompute in RECOMPUTE:
            try:
                est = price(cfg, {**combo, "train.recompute": recompute}, 8, hw)
            except HyperjaxError:
                break
            if est.memory_per_device_gib["peak"] * 2**30 <= hw.device.hbm_bytes:
                brute.append((est.step_time_s, i, {**combo, "train.recompute": recompute}))
                break
    brute.sort(key=lambda x: (x[0], x[1]))
    found = plan(cfg, 8, keep=3)
    assert [c.overrides for c in found.best] == [o for _, _, o in brute[:3]]
    assert [c.estimate.step_time_s for c in found.best] == pytest.approx([t for t, _, _ in brute[:3]], rel=1e-12)


@pytest.mark.parametrize(
    ("name", "overrides", "every"),
    [(GPT_22B, ["train.global_batch=32"], 7), (GPT_OSS, [*MOE_SMALL, "emulate.devices=16"], 5)],
    ids=["dense", "moe"],
)
def test_the_bound_never_exceeds_the_estimate(name, overrides, every):
    from hyperjax.errors import HyperjaxError
    from hyperjax.search import candidate
    from hyperjax.search.bounds import lower_bound
    from hyperjax.search.strategies import RECOMPUTE

    cfg = small_case(name, overrides)
    hw = load_hardware(cfg.hardware)
    checked = 0
    for combo in list(strategies(cfg, 16))[::every]:
        bound = lower_bound(cfg, combo, hw, hw.device.hbm_bytes)
        for recompute in RECOMPUTE:
            try:
                named = {"train.recompute_modules": None} if recompute != "selective" else {}  # selective's only
                est = estimate(resolve(candidate(cfg, {**combo, "train.recompute": recompute, **named}), 16))
            except HyperjaxError:
                break
            if est.fits:  # the bound holds for the strategy as the search keeps it: the first that fits
                assert bound <= est.step_time_s * (1 + 1e-12), (combo, recompute)
                checked += 1
                break
    assert checked > 20


def test_plan_json_reports_the_search(capsys):
    args = ["plan", str(ROOT / "configs/quickstart.yaml"), "--devices", "8", "--json", "--top", "2"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["searched"] >= data["priced"] >= data["fitting"] > 0 and data["seconds"] > 0


@pytest.mark.slow  # a long search
def test_plan_finds_expert_parallel_strategies_for_deepseek_v3_on_a_supernode():
    cfg = load_config(ROOT / "configs/deepseek-v3-671b.yaml")
    found = plan(cfg, 384, keep=3)
    assert found.best and all(c.estimate.fits for c in found.best)
    assert all(c.run.parallel["expert"] > 1 for c in found.best)
    assert all(c.estimate.communication_s["expert_parallel"] > 0 for c in found.best)


def test_the_search_keeps_the_precision_the_config_states():
    cfg = load_config(
        ROOT / "configs/quickstart.yaml", ["hardware=dgx-h100", "train.fp8.recipe=blockwise", "train.dtype=bfloat16"]
    )
    found = plan(cfg, 8, keep=3)
    assert found.best and all(c.run.config.train.fp8 == cfg.train.fp8 for c in found.best)
    assert all(c.estimate.fp8 is not None and c.estimate.fp8["recipe"] == "blockwise" for c in found.best)


def test_plan_refuses_a_fused_kernel_the_preset_does_not_measure():
    """The planner checks model.attention_impl before pricing anything, as resolve does."""
    cfg = load_config(
        ROOT / "configs/quickstart.yaml",
        ["hardware=dgx-h100", "model.attention_kernel=flash", "model.attention_impl=flash3"],
    )
    with pytest.raises(ConfigError, match=r"model.attention_impl='flash3' is not a fused attention kernel"):
        plan(cfg, 8)


def test_accumulated_micro_batches_of_one_stage_are_searched_paired():
    """Gradient accumulation on one stage also runs paired (``fb-pair`` without a pipeline, Megatron-Core's
    EP overlap), faster than unpaired; not where the step must be one SPMD program."""
    from hyperjax.search import price

    cfg = small_case(GPT_OSS, [*MOE_SMALL, "emulate.devices=16", "train.micro_batch=1"])
    found = plan(cfg, 16, keep=4000, accumulate=True)
    paired = [c for c in found.best if c.overrides["parallel.pipeline"] == 1 and c.run.overlap == "fb-pair"]
    assert paired and all(c.run.schedule == "1f1b" and c.run.microbatches >= 2 for c in paired)
    hw = load_hardware(cfg.hardware)
    for c in paired[:3]:
        plain = price(cfg, {**c.overrides, "parallel.overlap": "none"}, 16, hw)
        assert c.run.staged and not plain.run.staged and c.estimate.step_time_s < plain.step_time_s
    # an RL learner runs one SPMD program: its search offers no pairs
    alone = plan(cfg, 16, keep=4000, accumulate=True, one_program=True)
    one = [c for c in alone.best if c.overrides["parallel.pipeline"] == 1 and c.run.microbatches > 1]
    assert one and not any(c.run.overlap == "fb-pair" for c in one)


def test_mpmd_splits_are_searched_with_and_without_fsdp_in_each_submesh():
    """A vision-language model's MPMD splits: whole tier groups for the encoder, the rest for the language
    model, each submesh's weights whole on its data ranks or sharded over as many as its model width divides;
    sharding a submesh's state stores less of it on each device, and the search keeps such splits."""
    cfg = load_config(ROOT / "configs/vlm-8b-cm384.yaml")
    hw = load_hardware(cfg.hardware)
    splits = list(submesh_strategies(cfg, hw, 384))
    node = hw.tiers[0].group_size
    width = lambda sub: (cfg.model.vision if sub.modules == ("encoder",) else cfg.model).d_model  # 1024, 4096
    shards = lambda sub: math.gcd(sub.devices // sub.tensor, width(sub))  # FSDP ranks its weights allow
    for o in splits:
        encoder, lm = o["mpmd.submeshes"]
        assert encoder.devices % node == 0 and encoder.devices + lm.devices == 384
        assert all(sub.fsdp in (1, shards(sub)) and sub.tensor <= node for sub in (encoder, lm))
    ways = lambda sub: 2 if shards(sub) > 1 else 1  # FSDP over one data rank is no FSDP
    whole = {(e.devices, e.tensor, lm.tensor): ways(e) * ways(lm) for e, lm in (o["mpmd.submeshes"] for o in splits)}
    assert len(splits) == sum(whole.values()) > 4 * 300  # each submesh sharded or not, where it has data ranks

    def priced(encoder_fsdp: int, lm_fsdp: int):
        e, lm = next(
            (e, lm)
            for e, lm in (o["mpmd.submeshes"] for o in splits)
            if (e.devices, e.tensor, lm.tensor) == (192, 2, 2)
        )
        subs = (dataclasses.replace(e, fsdp=encoder_fsdp), dataclasses.replace(lm, fsdp=lm_fsdp))
        return estimate(resolve(candidate(cfg, {"mpmd.submeshes": subs}), 384))

    plain, sharded = priced(1, 1), priced(32, 32)  # 96 data ranks each; widths 1024 and 4096
    assert [(s.axes["fsdp"], s.axes["data"]) for s in sharded.run.stages] == [(32, 3), (32, 3)]
    assert sharded.memory_per_device_gib["peak"] < plain.memory_per_device_gib["peak"]
    found = plan(cfg, 384, keep=10_000)
    mpmd = [c.overrides["mpmd.submeshes"] for c in found.best if c.overrides.get("mpmd.submeshes")]
    assert any(sub.fsdp > 1 for subs in mpmd for sub in subs)


def test_mpmd_splits_reset_the_whole_runs_degrees():
    """A config whose whole-run degrees an MPMD run would refuse still has its MPMD splits searched: a split
    takes its submeshes' degrees (and keeps sequence parallelism where a submesh has a tensor axis)."""
    sets = ["parallel.tensor=2", "parallel.data=2", "parallel.sequence_parallel=true"]
    cfg = load_config(ROOT / "configs/vlm-tiny-mpmd.yaml", sets)
    found = plan(cfg, 8, keep=1000)
    mpmd = [c for c in found.best if c.overrides.get("mpmd.submeshes")]
    assert mpmd and any(not c.overrides.get("mpmd.submeshes") for c in found.best)
    for c in mpmd:
        tensor = max(s.axes["tensor"] for s in c.run.stages)
        assert c.run.sequence_parallel == (tensor > 1)
    assert {max(s.axes["tensor"] for s in c.run.stages) for c in mpmd} == {1, 2, 4}


def test_a_candidate_without_a_modifiers_feature_resets_it():
    """The config's modifiers hold where a candidate has their feature and are reset where it has not, so no
    candidate is lost to the run's refusal of them; its overrides name each reset, and alone over the config
    they resolve to the run it priced."""
    quick = ROOT / "configs/quickstart.yaml"
    sets = ["parallel.fsdp_reshard=false", "parallel.tp_overlap=bulk"]
    cfg = load_config(quick, sets)
    found, plain = plan(cfg, 8, keep=1000, prune=False), plan(load_config(quick), 8, keep=1000, prune=False)
    assert found.priced == plain.priced and len(found.best) == len(plain.best)
    for c in found.best:
        p = c.run.config.parallel
        assert p.fsdp_reshard is (p.fsdp == 1) and p.tp_overlap == ("bulk" if p.tensor > 1 else "none")
        assert c.overrides.get("parallel.fsdp_reshard", False) is p.fsdp_reshard
        assert c.overrides.get("parallel.tp_overlap", "bulk") == p.tp_overlap
        assert resolve(apply(cfg, c.overrides), 8).config.parallel == p
    assert {(c.run.config.parallel.fsdp > 1, c.run.config.parallel.tensor > 1) for c in found.best} == {
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    }
    # held degrees that leave no strategy the feature: named, not reset in every candidate unsaid
    with pytest.raises(ConfigError, match=r"parallel.tp_overlap=bulk says how tensor parallelism runs, but no "):
        plan(cfg, 8, where={"parallel.tensor": 1})
    assert all(c.run.config.parallel.fsdp_reshard is False for c in plan(cfg, 8, where={"parallel.fsdp": 2}).best)


def test_an_mpmd_split_without_a_modifiers_feature_resets_it():
    cfg = load_config(ROOT / "configs/vlm-tiny-mpmd.yaml", ["parallel.tp_overlap=bulk"])
    found = plan(cfg, 8, keep=1000).best
    tensor = lambda c: max(s.axes["tensor"] for s in c.run.stages)
    assert {(bool(c.overrides.get("mpmd.submeshes")), tensor(c) > 1) for c in found} == {
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    }
    for c in found:
        assert c.run.config.parallel.tp_overlap == ("bulk" if tensor(c) > 1 else "none")


def test_divisors_pair_up_to_the_square_root():
    """Every divisor, ascending, found in square-root time: a device count of 10^12 (13 x 13 divisors)
    answers at once rather than counting to it."""
    for n in range(1, 1500):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    big = divisors(10**12)
    assert len(big) == 169 and big == sorted(big) and all(10**12 % d == 0 for d in big)


def test_plan_tries_no_zero_stage_the_runtime_cannot_shard():
    # 6 devices: a data degree of 3 or 6 divides none of the quick start's dimensions, so ZeRO is refused there
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["train.global_batch=30"])
    found = plan(cfg, 6, keep=100, prune=False)
    assert found.fitting > 0
    for c in found.best:
        run = resolve(candidate(cfg, c.overrides), 6)  # what the plan lists resolves, at its ZeRO stage
        assert run.zero_stage == 0 or run.parallel["data"] in (1, 2), c.overrides
    with pytest.raises(ConfigError, match=r"with parallel.zero_stage=1 is refused: .* no dimension of it divides by 3"):
        plan(cfg, 6, where={"parallel.zero_stage": 1})


def test_plan_prices_mpmd_splits_at_the_configs_zero_stage():
    # a split carries no parallel.zero_stage of its own: it runs, and is checked and priced, at the config's
    cfg = load_config(ROOT / "configs/vlm-tiny-mpmd.yaml", ["parallel.zero_stage=1"])
    splits = [c for c in plan(cfg, 8, keep=1000).best if c.overrides.get("mpmd.submeshes")]
    assert splits and all(c.run.zero_stage == 1 for c in splits)


def test_a_candidate_that_exchanges_no_tokens_or_gathers_no_weights_resets_their_settings():
    """A mixture of experts' dispatcher holds where a candidate spreads its experts and resets where every
    device holds them all; FP8 weight gathers hold where a candidate runs FSDP. Each reset is in the
    candidate's overrides, which alone over the config resolve to the run it priced."""
    moe = load_config(ROOT / "configs/moe-tiny.yaml", ["parallel.dispatcher=alltoall"])
    found = plan(moe, 8, keep=1000).best
    exchanges = lambda p: p.expert > 1 or (p.tensor > 1 and p.expert_tensor == 1)
    assert {exchanges(c.run.config.parallel) for c in found} == {False, True}
    for c in found:
        p = c.run.config.parallel
        assert p.dispatcher == ("alltoall" if exchanges(p) else "deepep")
        assert c.overrides.get("parallel.dispatcher", "alltoall") == p.dispatcher
        assert resolve(apply(moe, c.overrides), 8).config.parallel == p
    with pytest.raises(ConfigError, match=r"parallel.dispatcher='alltoall' says how a mixture of experts' token "):
        plan(moe, 8, where={"parallel.expert": 1, "parallel.tensor": 1})
    sets = ["hardware=dgx-h100", "train.fp8.recipe=tensorwise", "train.fp8.all_gather=true"]
    fp8 = load_config(ROOT / "configs/quickstart.yaml", sets)
    found = plan(fp8, 8, keep=1000).best
    assert {c.run.config.parallel.fsdp > 1 for c in found} == {False, True}
    for c in found:
        gathers = c.run.config.parallel.fsdp > 1 or (c.run.config.parallel.fsdp_context and c.run.axes["context"] > 1)
        assert c.run.config.train.fp8.all_gather is gathers
        assert c.overrides.get("train.fp8.all_gather", True) is gathers
        assert resolve(apply(fp8, c.overrides), 8).config.train == c.run.config.train
    with pytest.raises(ConfigError, match=r"train.fp8.all_gather=true says how FSDP runs, but no strategy"):
        plan(fp8, 8, where={"parallel.fsdp": 1, "parallel.context": 1})
