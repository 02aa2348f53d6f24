"""The placement pass: the exact solver against greedy and brute force, and the model against the estimate."""

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hyperjax import ConfigError, estimate, load_config, load_hardware, resolve
from hyperjax.offload import (
    Placement,
    brute_force,
    build_problem,
    evaluate,
    from_patterns,
    from_recompute,
    greedy,
    offload_pass,
    solve_exact,
    with_offload,
)
from hyperjax.offload.problem import GIB
from hyperjax.offload.solve import ceil_gib, minimum_memory

ROOT = Path(__file__).parents[2]
HW = load_hardware("cloudmatrix384")


def config(**sets):
    return load_config(
        ROOT / "configs/quickstart.yaml", ["emulate.devices=null", *(f"{k}={v}" for k, v in sets.items())]
    )


def problem_of(cfg, budget_bytes, prefetch=1):
    base = dataclasses.replace(resolve(cfg), recompute="none")
    return build_problem(estimate(base), hardware=HW, budget_bytes=budget_bytes, prefetch=prefetch)


def only(problem, keep):
    """``problem`` with only the groups matching ``keep``; the others stay on the device (fixed memory)."""
    fixed = list(problem.fixed)
    groups = {}
    for g, options in problem.groups.items():
        if any(k in g for k in keep):
            groups[g] = options
        else:
            fixed = [fixed[0] + options["device"].memory[0], fixed[1] + options["device"].memory[1]]
    return dataclasses.replace(problem, groups=groups, fixed=tuple(fixed))


@pytest.mark.parametrize(
    ("recompute", "tensor", "reforward"),
    [
        ("none", 2, "needed"),
        ("selective", 2, "needed"),
        ("full", 1, "needed"),
        ("full", 1, "whole"),
        ("none", 1, "needed"),
    ],
)
def test_the_placement_of_train_recompute_prices_as_the_estimate(recompute, tensor, reforward):
    cfg = config(
        **{
            "train.recompute": recompute,
            "train.reforward": reforward,
            "parallel.tensor": tensor,
            "parallel.data": 4,
            "train.micro_batch": 2,
        }
    )
    est = estimate(resolve(cfg))
    priced = evaluate(problem_of(cfg, HW.device.hbm_bytes), from_recompute(recompute, cfg.model.layers))
    assert priced.transfer_s == 0.0 and priced.host_bytes == 0.0
    if reforward == "needed":
        # every activation recomputed by name is JAX's full recomputation: the block's input alone kept, all of
        # the forward re-run but the MLP's output product
        assert priced.peak_bytes == pytest.approx(est.memory_per_device_gib["peak"] * GIB, rel=1e-9)
        assert priced.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
        return
    # PyTorch's checkpoints, one an activation, are selective recomputation of them all: each keeps its input
    # (the norms' inputs stay, the mid-block residual among them), where the full one keeps the block's input
    # alone and re-runs the products whose output only joins the block's output too
    every = config(**{"train.recompute": "selective", "train.reforward": "whole",
                      "train.recompute_modules": "[norms, qkv, attn_core, attn_out, mlp_hidden, mlp_act]",
                      "parallel.tensor": tensor, "parallel.data": 4, "train.micro_batch": 2})  # fmt: skip
    each = estimate(resolve(every))
    assert priced.peak_bytes == pytest.approx(each.memory_per_device_gib["peak"] * GIB, rel=1e-9)
    assert priced.step_time_s == pytest.approx(each.step_time_s, rel=1e-9)
    kept = sum(p.layers * p.layer.recompute_keeps_bytes["norms"] for p in est.stages[0].parts)
    assert kept > 0 and priced.peak_bytes > est.memory_per_device_gib["peak"] * GIB
    tail = sum(p.layers * (p.layer.forward_s - sum(p.layer.recompute_by_name_s.values())) for p in est.stages[0].parts)
    assert tail > 0
    assert priced.step_time_s == pytest.approx(est.step_time_s - est.run.microbatches * tail, rel=1e-9)


@pytest.mark.parametrize("fraction", [0.15, 0.3, 0.6, 0.9])
def test_exact_is_optimal_against_brute_force_on_one_layer(fraction):
    cfg = config(**{"model.layers": 1, "parallel.tensor": 1})
    full = problem_of(cfg, math.inf)
    top = evaluate(full, Placement(())).peak_bytes
    low = minimum_memory(full).peak_bytes
    problem = dataclasses.replace(full, budget_bytes=low + fraction * (top - low))
    best = brute_force(problem)  # 3^5 x 2^4 = 3888 placements
    exact = solve_exact(problem)
    assert best is not None and exact is not None and exact.fits
    assert exact.step_time_s == pytest.approx(best.step_time_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("fraction", "prefetch"), [(0.2, 1), (0.5, 2), (0.8, 0)])
def test_exact_is_optimal_against_brute_force_on_two_layers(fraction, prefetch):
    cfg = config(**{"model.layers": 2, "parallel.tensor": 1, "train.micro_batch": 4})
    full = only(problem_of(cfg, math.inf, prefetch), ("params", "optimizer", "act.qkv", "act.attn_core"))
    top = evaluate(full, Placement(())).peak_bytes
    low = minimum_memory(full).peak_bytes
    problem = dataclasses.replace(full, budget_bytes=low + fraction * (top - low))
    best = brute_force(problem)  # (2 x 2 x 3 x 3)^2 = 1296 placements
    exact = solve_exact(problem)
    assert exact.step_time_s == pytest.approx(best.step_time_s, rel=1e-9, abs=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 6),
    width=st.sampled_from([128, 256, 512]),
    seq=st.sampled_from([128, 512, 2048]),
    batch=st.sampled_from([8, 32]),
    tensor=st.sampled_from([1, 2]),
    prefetch=st.integers(0, 3),
    fraction=st.floats(0.0, 1.2),
)
# in seconds HiGHS's absolute tolerances let the first come back slower than greedy's; in bytes it failed the second
@example(layers=4, width=128, seq=512, batch=8, tensor=1, prefetch=1, fraction=0.91796875)
@example(layers=6, width=256, seq=512, batch=8, tensor=2, prefetch=0, fraction=0.93147858420242)
def test_exact_is_never_worse_than_greedy(layers, width, seq, batch, tensor, prefetch, fraction):
    cfg = config(
        **{
            "model.layers": layers,
            "model.d_model": width,
            "model.d_ff": 4 * width,
            "model.seq_len": seq,
            "train.global_batch": batch,
            "parallel.tensor": tensor,
        }
    )
    full = problem_of(cfg, math.inf, prefetch)
    top = evaluate(full, Placement(())).peak_bytes
    low = minimum_memory(full).peak_bytes
    problem = dataclasses.replace(full, budget_bytes=low + fraction * (top - low))
    exact, base = solve_exact(problem), greedy(problem)
    assert exact is not None  # the budget is at least the smallest peak
    assert exact.fits and exact.peak_bytes <= problem.budget_bytes
    if base is not None:
        assert exact.step_time_s <= base.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("budget", [0.02, 0.03, 0.04])
def test_greedy_fits_where_the_leanest_placement_fits(budget):
    """Evicting every group to its faster option (the host) left the host's staging buffers over these budgets,
    and the pass said nothing fits, advising a budget below the one given; greedy now evicts to the leanest
    option when the fastest never fits, and a pass that finds nothing takes the smallest-peak placement when
    that fits."""
    cfg = config(**{"offload.policy": "greedy", "offload.device_memory_gib": budget})
    full = problem_of(cfg, budget * GIB)
    assert minimum_memory(full).fits
    found = greedy(full)
    assert found is not None and found.fits and found.peak_bytes <= budget * GIB
    plan = offload_pass(resolve(cfg))
    assert plan.fits and plan.priced.peak_bytes <= budget * GIB


def test_a_tighter_budget_never_speeds_the_step_up():
    cfg = config(**{"model.layers": 4, "parallel.tensor": 1})
    full = problem_of(cfg, math.inf)
    top, low = evaluate(full, Placement(())).peak_bytes, minimum_memory(full).peak_bytes
    times = [
        solve_exact(dataclasses.replace(full, budget_bytes=low + f * (top - low))).step_time_s for f in (1, 0.6, 0.3, 0)
    ]
    assert times == sorted(times)
    assert times[0] == pytest.approx(full.base_step_s)  # everything fits: nothing moves


def squeezed(layers: int = 8, fraction: float = 0.4):
    full = problem_of(config(**{"model.layers": layers, "parallel.tensor": 1}), math.inf)
    top, low = evaluate(full, Placement(())).peak_bytes, minimum_memory(full).peak_bytes
    return dataclasses.replace(full, budget_bytes=low + fraction * (top - low))


def stop_at_the_limit(monkeypatch, **result):
    """HiGHS stopping the exact pass's search at its time limit (status 1) with ``result`` (``x``,
    ``mip_gap``) patched over its own; the smallest-peak search (given no time limit) runs as it is."""
    import hyperjax.offload.solve as solve

    real = solve._milp

    def stopped(*args, **kwargs):
        res = real(*args, **kwargs)
        if len(args) > 4:  # solve_exact's call, which passes its time limit and gap
            res.status = 1
            for k, v in result.items():
                setattr(res, k, v)
        return res

    monkeypatch.setattr(solve, "_milp", stopped)


def test_the_exact_pass_says_what_it_proved_and_when_its_time_ran_out(monkeypatch):
    problem = squeezed()
    done = solve_exact(problem)
    assert not done.time_limited and done.proved_gap is not None and done.proved_gap <= 1e-9
    assert done.placement != Placement(())  # the budget makes it search
    roomy = solve_exact(dataclasses.replace(problem, budget_bytes=math.inf))  # everything on the device is fastest
    assert roomy.placement == Placement(()) and roomy.proved_gap == 0.0 and roomy.host_bytes == 0
    with monkeypatch.context() as m:  # stopped with a placement and a gap proved: both as HiGHS gave them
        stop_at_the_limit(m, mip_gap=0.0123)
        late = solve_exact(problem)
    assert late.time_limited and late.proved_gap == 0.0123 and late.placement == done.placement
    with monkeypatch.context() as m:  # stopped before any: the fallback's, said so, never "nothing fits"
        stop_at_the_limit(m, x=None, mip_gap=math.inf)
        cut = solve_exact(problem)
        assert cut is not None and cut.fits and cut.time_limited and cut.proved_gap is None
        assert cut.placement == greedy(problem).placement and cut.step_time_s >= done.step_time_s
        lean = solve_exact(problem, fallback=lambda _: None)  # no fallback placement: the leanest, if it fits
        assert lean.time_limited and lean.placement == minimum_memory(problem).placement
        assert solve_exact(dataclasses.replace(problem, budget_bytes=1.0)) is None  # nothing fits at all


def test_predict_reports_the_exact_pass_stopping_at_its_limit(monkeypatch, capsys):
    import json

    from hyperjax.cli.main import main

    args = ["predict", str(ROOT / "configs/quickstart.yaml"), "--set", "offload.policy=auto", "--set",
            "offload.device_memory_gib=0.02", "--set", "emulate.devices=null"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    proved = json.loads(capsys.readouterr().out)["offload"]
    assert proved["time_limited"] is False and proved["proved_gap"] <= 1e-9 and proved["host_gib_per_device"] > 0
    stop_at_the_limit(monkeypatch, x=None, mip_gap=math.inf)
    assert main([*args, "--json"]) == 0
    cut = json.loads(capsys.readouterr().out)["offload"]
    assert cut["time_limited"] is True and cut["proved_gap"] is None and cut["fits"]
    assert main(args) == 0
    assert "the exact pass stopped at its time limit: it had found none of its own" in capsys.readouterr().out


def test_a_budget_nothing_fits_names_the_term_and_the_smallest_budget():
    cfg = config(**{"offload.policy": "auto", "offload.device_memory_gib": 0.001, "parallel.data": 4})
    plan = offload_pass(resolve(cfg))
    assert not plan.fits
    out = plan.to_dict()
    assert out["fits"] is False
    assert out["cannot_fit"] in plan.problem.fixed_terms or out["cannot_fit"].startswith("device staging buffer")
    smallest = out["smallest_budget_gib"]
    assert smallest > 0.001
    again = offload_pass(
        resolve(dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, device_memory_gib=smallest)))
    )
    assert again.fits
    assert "offload.device_memory_gib" in str(plan.error()) and f"{smallest:g}" in str(plan.error())


def test_placement_is_a_value(tmp_path):
    p = from_patterns({"layers.*.optimizer": "host", "layers.1.act.qkv": "recompute"}, 3)
    assert (
        p["layers.2.optimizer"] == "host" and p["layers.1.act.qkv"] == "recompute" and p["layers.0.params"] == "device"
    )
    path = tmp_path / "placement.json"
    p.save(path)
    assert Placement.load(path) == p
    assert hash(p) == hash(Placement.load(path))
    assert p.rows(3)[0] == ("0", "device", "host", *["device"] * 8)  # params, optimizer, gradients, 7 activations
    assert from_recompute("selective", 2).block(1)["attn_core"] == "recompute"


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"layers.*.weights": "host"}, "names no tensor group"),
        ({"layers.*.params": "recompute"}, "takes one of"),
        ({"layers.9.params": "host"}, "names no tensor group"),
        ({"layers.*.act.block_in": "recompute"}, "block's input is where its recomputation starts"),
        ({"layers.1.act.block_out": "host"}, "names no tensor group"),
    ],
)
def test_bad_manual_placements_name_the_key(patterns, message):
    with pytest.raises(ConfigError, match=message):
        from_patterns(patterns, 4)


def test_a_block_input_goes_to_the_host_or_stays_never_recomputed():
    """A block's input (MaxText's decoder_layer_input) is a placeable group: on the host it leaves the device
    for every micro-batch in flight, written after the block's forward and read before its backward; it has
    no recompute option, and a wildcard recomputing a block's activations leaves it where it was."""
    cfg = config(**{"model.layers": 3, "parallel.tensor": 1, "train.micro_batch": 2})
    problem = problem_of(cfg, math.inf)
    assert set(problem.groups["layers.1.act.block_in"]) == {"device", "host"}
    assert not any("block" in term for term in problem.fixed_terms)  # no longer a term that cannot leave
    everything = from_patterns({"layers.*.act.*": "recompute"}, 3)
    assert everything["layers.1.act.block_in"] == "device" and everything["layers.1.act.qkv"] == "recompute"
    est = estimate(dataclasses.replace(resolve(cfg), recompute="none"))
    layer = next(p.layer for p in est.stages[0].parts if p.module == "decoder")
    held = est.stages[0].in_flight * layer.activation_bytes["block_in"]
    on_device, on_host = (
        evaluate(problem, from_patterns({"layers.*.act.*": "recompute", **extra}, 3))
        for extra in ({}, {"layers.*.act.block_in": "host"})
    )
    staged = 2 * layer.activation_bytes["block_in"]  # prefetch 1: two layers' inputs in a staging buffer
    assert on_device.phase_bytes[0] - on_host.phase_bytes[0] == pytest.approx(
        HW.device.allocator_factor * (3 * held - staged)
    )
    assert on_host.host_bytes == pytest.approx(3 * held)
    xfer = layer.activation_bytes["block_in"] / HW.host.bandwidth + HW.host.latency
    assert on_host.transfer_s == pytest.approx(2 * 3 * est.run.microbatches * xfer)  # out and back, each layer


def test_host_memory_bounds_what_goes_to_the_host():
    cfg = config(**{"model.layers": 3, "parallel.tensor": 1})
    full = problem_of(cfg, math.inf)
    top, low = evaluate(full, Placement(())).peak_bytes, minimum_memory(full).peak_bytes
    problem = dataclasses.replace(full, budget_bytes=low + 0.3 * (top - low))
    free = solve_exact(problem)
    assert free.placement.on("host")  # with room on the host, the pass uses it
    none = solve_exact(dataclasses.replace(problem, host_bytes=0.0))
    if none is not None:
        assert not none.placement.on("host") and none.host_bytes == 0.0
    assert not evaluate(dataclasses.replace(problem, host_bytes=0.0), free.placement).fits


def test_a_deeper_prefetch_never_prices_a_placement_slower():
    """Buffers for k layers ahead also run every shallower schedule, so the pass prices the fastest: a manual
    placement's step never grows with offload.prefetch, while its staging buffers do, up to the stage's layers
    (a depth past them stages nothing more)."""
    sets = {"offload.policy": "manual", "offload.manual": "{layers.*.act.*: host}"}
    steps, peaks = [], []
    for k in (1, 2, 3, 4, 8):
        result = offload_pass(resolve(config(**sets, **{"offload.prefetch": k})))
        steps.append(result.priced.step_time_s)
        peaks.append(result.priced.peak_bytes)
    assert steps == sorted(steps, reverse=True)
    assert peaks[:4] == sorted(peaks[:4]) and peaks[0] < peaks[3] and peaks[3] == peaks[4]  # 4 layers


def test_every_pipeline_stage_must_fit_not_only_the_fullest():
    """The placement is chosen on the stage that holds the most; a stage past it (here the last, of one
    block and a 128k-token vocabulary's logits) must fit too, under any placement of its own blocks.
    Before, the run was said to fit a budget its last stage can never meet."""
    sets = {
        "model.family": "llama", "model.layers": 32, "model.d_model": 1024, "model.d_ff": 4096,
        "model.vocab": 128000, "model.seq_len": 4096, "model.tie_embeddings": "false",
        "model.attention_kernel": "flash", "train.dtype": "bfloat16", "train.global_batch": 24,
        "parallel.tensor": 1, "parallel.pipeline": 2, "parallel.stage_devices": "[6,2]",
        "parallel.stage_layers": "[31,1]", "offload.policy": "auto",
    }  # fmt: skip
    run = resolve(config(**sets, **{"offload.device_memory_gib": 5}))
    base = estimate(dataclasses.replace(run, recompute="none"))
    assert base.fullest == 0
    last = minimum_memory(build_problem(base, hardware=run.hardware, budget_bytes=5 * GIB, prefetch=1, stage=1))
    assert last.peak_bytes > 5 * GIB  # the last stage's fixed logits alone outgrow the budget
    plan = offload_pass(run)
    assert not plan.fits and plan.cannot_fit.endswith("of stage 1")
    assert plan.smallest_budget_gib == ceil_gib(last.peak_bytes)  # rounded up to three figures
    roomy = offload_pass(resolve(config(**sets, **{"offload.device_memory_gib": plan.smallest_budget_gib})))
    assert roomy.fits


PIPELINE = {
    "model.family": "llama", "model.layers": 32, "model.d_model": 1024, "model.d_ff": 4096,
    "model.vocab": 128000, "model.seq_len": 4096, "model.tie_embeddings": "false",
    "model.attention_kernel": "flash", "train.dtype": "bfloat16", "train.global_batch": 32,
    "parallel.tensor": 1, "parallel.pipeline": 2, "parallel.stage_devices": "[4,4]",
    "parallel.stage_layers": "[20,12]", "offload.policy": "greedy", "offload.device_memory_gib": 12,
}  # fmt: skip


def test_every_stage_over_the_budget_places_its_own_blocks_and_the_slowest_sets_the_step():
    """Both stages of this pipeline hold more than 12 GiB: the first (20 blocks) is the fullest, and the last
    (12 blocks and the logits) must put more of its own on the host for its peak, which costs it more time.
    The step is the slowest stage's. Before, only the fullest stage's placement was priced."""
    result = offload_pass(resolve(config(**PIPELINE)))
    assert result.fits and result.base.fullest == 0
    [(stage, last)] = result.others
    assert stage == 1 and last.fits and last.peak_bytes <= 12 * GIB < result.base.stages[1].memory["peak"]
    assert last.step_time_s > result.priced.step_time_s  # the last stage's placement is the slower
    step = with_offload(result)
    assert result.pace is last and step.step_time_s == last.step_time_s
    stretch = result.problem.stretch
    assert step.breakdown_s["exposed_host_transfer"] == pytest.approx(stretch * last.exposed_transfer_s)
    out = result.to_dict()
    assert out["step_time_s"] == last.step_time_s and out["stages"][0]["stage"] == 1
    assert out["stages"][0]["peak_gib"] == last.peak_bytes / GIB
    # each stage is written with the fullest's figures, under the same keys
    shared = set(out) - {"policy", "budget_gib", "proved_gap", "time_limited", "stages"}
    assert set(out["stages"][0]) - {"stage"} == shared
    assert out["stages"][0]["transfer_s"] == last.transfer_s and out["transfer_s"] == result.priced.transfer_s
    # the same stage priced alone: its own problem, solved by the run's policy
    alone = greedy(build_problem(result.base, hardware=HW, budget_bytes=12 * GIB, prefetch=1, stage=1))
    assert alone.step_time_s == pytest.approx(last.step_time_s)


def test_a_manual_placement_over_the_budget_is_refused_as_such_when_another_would_fit():
    """``offload.manual`` names a placement; where it is over the budget but another placement fits, the error
    says so and points to offload.policy: auto. Before, it said no placement fits and asked for a budget smaller
    than the one given."""
    sets = {"offload.policy": "manual", "offload.manual": "{layers.0.act.*: host}"}
    result = offload_pass(resolve(config(**sets)))
    peak = result.priced.peak_bytes / GIB
    budget = peak / 2
    tight = offload_pass(resolve(config(**sets, **{"offload.device_memory_gib": budget})))
    assert not tight.fits and tight.placeable and tight.smallest_budget_gib <= budget
    assert tight.cannot_fit.startswith("offload.policy=manual's placement")
    message = str(tight.error())
    assert "offload.policy: auto" in message and f"{tight.smallest_budget_gib:g} GiB" in message
    assert "no placement fits" not in message
    # a budget no placement meets keeps the old answer: what cannot leave the device
    none_fits = offload_pass(resolve(config(**sets, **{"offload.device_memory_gib": 1e-4})))
    assert not none_fits.fits and not none_fits.placeable and "no placement fits" in str(none_fits.error())
    assert none_fits.smallest_budget_gib > 1e-4


def test_a_manual_placement_applies_to_every_stage_over_the_budget_by_its_own_block_numbers():
    """In a pipeline, offload.manual's patterns place each stage's own blocks, numbered from 0: a pattern past
    the last stage's 12 blocks is refused naming that stage (before, it was reported as a stage holding no
    decoder block); patterns every stage has place them all, and the slowest stage sets the step."""
    sets = {**PIPELINE, "offload.policy": "manual"}
    with pytest.raises(ConfigError, match=r"pipeline stage 1 \(12 blocks, numbered from 0 .*'layers.15.act.\*'"):
        offload_pass(resolve(config(**sets, **{"offload.manual": "{layers.15.act.*: host}"})))
    result = offload_pass(resolve(config(**sets, **{"offload.manual": "{layers.*.act.*: host}"})))
    [(stage, last)] = result.others
    assert stage == 1 and last.placement.on("host")
    assert result.pace.step_time_s == max(result.priced.step_time_s, last.step_time_s)
