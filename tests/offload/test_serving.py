"""The serving placement pass: weights and KV-cache blocks between device and host for decode. The exact
pass equals brute force on a small problem, beats or equals greedy, and the longest context grows with it."""

import math
from pathlib import Path

import pytest

import hyperjax
from hyperjax.cost.inference import estimate_inference
from hyperjax.errors import ConfigError
from hyperjax.offload import brute_force
from hyperjax.offload.serving import longest_context, place, serve_problem

SETS = [  # a small llama on one cloudmatrix384 device, one sequence
    "model.family=llama", "model.layers=3", "model.d_model=256", "model.heads=4", "model.kv_heads=2",
    "model.d_ff=512", "model.vocab=256", "model.seq_len=1048576", "hardware=cloudmatrix384", "emulate.devices=1",
    "parallel.data=1", "parallel.tensor=1", "train.global_batch=1", "train.dtype=bfloat16", "serve.batch=1",
    "serve.prompt_len=1024", "serve.new_tokens=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def est():
    return estimate_inference(hyperjax.resolve(hyperjax.load_config(None, SETS), 1))


@pytest.fixture(scope="module")
def deep():
    """Twelve layers: a layer's staging buffer is small beside the cache it lets leave the device."""
    sets = [*SETS, "model.layers=12"]
    return estimate_inference(hyperjax.resolve(hyperjax.load_config(None, sets), 1))


def test_exact_equals_brute_force_and_beats_greedy(est):
    layer = est.layers[0]
    context, block = 3 * 4096, 4096
    everything = est.fixed_bytes + sum(x.weight_bytes + x.kv_bytes_per_token * context for x in est.layers)
    for share in (0.8, 0.9):  # budgets that force part of the cache or the weights off the device
        problem = serve_problem(est, context=context, budget_bytes=share * 1.05 * everything, block_tokens=block)
        assert len(problem.groups) == 3 * (1 + 3)
        exact, brute, greedy = place(problem, "exact"), brute_force(problem), place(problem, "greedy")
        assert exact is not None and brute is not None and exact.fits
        assert exact.step_time_s == pytest.approx(brute.step_time_s, rel=1e-3)
        assert greedy is None or exact.step_time_s <= greedy.step_time_s + 1e-12
        assert exact.step_time_s >= problem.base_step_s
        assert layer.kv_bytes_per_token == 2 * 2 * 64 * 2  # two KV heads of 64, key and value, bf16


def test_exact_stopped_before_any_placement_takes_the_serving_greedy_pass(est, monkeypatch):
    import hyperjax.offload.solve as solve

    context, block = 3 * 4096, 4096
    everything = est.fixed_bytes + sum(x.weight_bytes + x.kv_bytes_per_token * context for x in est.layers)
    problem = serve_problem(est, context=context, budget_bytes=0.8 * 1.05 * everything, block_tokens=block)
    greedy = place(problem, "greedy")  # a decode step's greedy pass: every group's reuse distance is one step
    assert greedy is not None and not place(problem, "exact").time_limited
    real = solve._milp
    monkeypatch.setattr(solve, "_milp", lambda *a, **k: real(*a, **k).__class__(x=None, status=1, fun=None))
    cut = place(problem, "exact")
    assert cut.time_limited and cut.proved_gap is None and cut.placement == greedy.placement


def test_a_budget_nothing_fits_reports_the_smallest_peak_any_placement_reaches(capsys):
    from hyperjax.cli.predict import print_serving_placement
    from hyperjax.offload.serving import serving_pass
    from hyperjax.offload.solve import minimum_memory

    est = estimate_inference(hyperjax.resolve(hyperjax.load_config(None, [*SETS, "offload.policy=greedy"]), 1))
    placed = serving_pass(est, budget_bytes=1.0)  # one byte: nothing fits
    context = est.prompt_len + est.new_tokens
    problem = serve_problem(est, context=context, budget_bytes=1.0, block_tokens=context)
    assert not placed.fits and placed.peak_gib == pytest.approx(minimum_memory(problem).peak_bytes / 2**30, rel=1e-12)
    assert placed.weights_on_host == len(est.layers) and placed.host_gib > 0  # here every layer's weights go
    print_serving_placement(placed)
    assert "does not fit: no placement reaches a smaller peak" in capsys.readouterr().out


def test_no_offload_longest_context_is_the_closed_form(est):
    budget = 0.5 * 2**30
    got = longest_context(est, budget_bytes=budget, policy="none", block_tokens=1024)
    per_token = sum(x.kv_bytes_per_token for x in est.layers)
    weights = sum(x.weight_bytes for x in est.layers)
    want = math.floor((budget / 1.05 - est.fixed_bytes - weights) / per_token / 1024) * 1024
    assert got.context == want and got.slowdown == 0.0 and got.host_gib == 0.0


def test_offload_serves_longer_contexts_and_says_what_it_costs(deep):
    est, budget = deep, 0.5 * 2**30
    none = longest_context(est, budget_bytes=budget, policy="none", block_tokens=32768, limit=1 << 22)
    hidden = longest_context(
        est, budget_bytes=budget, policy="exact", max_slowdown=0.0, block_tokens=32768, limit=1 << 22
    )
    loose = longest_context(
        est, budget_bytes=budget, policy="exact", max_slowdown=0.5, block_tokens=32768, limit=1 << 22
    )
    assert none.context <= hidden.context <= loose.context and loose.context > none.context
    assert hidden.slowdown <= 1e-9 and 0 <= loose.slowdown <= 0.5 and loose.host_gib > 0
    assert loose.peak_gib <= 0.5


def test_bad_serving_problem_is_refused(est):
    with pytest.raises(ConfigError, match="context=0"):
        serve_problem(est, context=0, budget_bytes=2**30)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_the_device_only_step_is_the_whole_decode_step(pipeline):
    """The placement prices the fullest stage's layers; the rest of the step (the other stages', the head, the
    hand-overs) is one more window, so with nothing on the host it is the estimate's decode step."""
    sets = [*SETS, "model.layers=4", "emulate.devices=2", "parallel.pipeline=2" if pipeline > 1 else "parallel.data=2"]
    sets += ["train.global_batch=4", "serve.batch=2", "offload.policy=greedy"]
    est = estimate_inference(hyperjax.resolve(hyperjax.load_config(None, sets)))
    assert len(est.layers) == 4 // pipeline
    ctx = est.prompt_len + est.new_tokens / 2  # the context the estimate's decode step reads
    windows = sum(x.rest_s + x.kv_read_s(ctx, est.run.hardware) for x in est.layers) + est.other_s
    assert windows == pytest.approx(est.decode_s_per_token, rel=1e-9)
    placed = hyperjax.offload.serving.serving_pass(est, budget_bytes=2**40)
    assert placed.decode_s_per_token == placed.device_only_s_per_token
    assert placed.device_only_s_per_token == pytest.approx(est.decode_s_per_token, rel=0.01)  # its own context


def test_every_pipeline_stage_places_its_own_layers():
    """The placement is chosen on the stage that holds the most; each other stage over the budget places its
    own layers by the same pass, and a token waits for the fetches each leaves exposed. A stage that cannot
    fit (here one with nothing of its own to place) makes the run not fit. Before, Llama-3-70B's four stages
    at 3 GiB were said to fit with only the first placed, decoding at the first stage's price."""
    import dataclasses

    from hyperjax.offload.serving import serving_pass

    path = Path(__file__).parents[2] / "configs" / "llama3-70b.yaml"
    cfg = hyperjax.load_config(path, ["offload.policy=auto"])
    est = estimate_inference(hyperjax.resolve(cfg))
    budget = 3 * 2**30
    assert len(est.others) == 3 and all(peak > budget for _, _, peak in est.others)
    alone = serving_pass(dataclasses.replace(est, others=()), budget_bytes=budget)
    every = serving_pass(est, budget_bytes=budget)
    assert every.fits and alone.fits
    assert every.decode_s_per_token > 2 * alone.decode_s_per_token  # three more stages' fetches exposed
    stuck = dataclasses.replace(est, others=(((), 0.0, 4 * 2**30),))  # 4 GiB of nothing it could move
    assert not serving_pass(stuck, budget_bytes=budget).fits
