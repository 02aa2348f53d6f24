"""A placement applied on the emulated mesh: the same losses, and host-placed state in pinned_host."""

import contextlib
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from hyperjax import load_config, resolve
from hyperjax.cli.main import main
from hyperjax.models import build_model
from hyperjax.offload import block_policies, from_patterns
from hyperjax.offload.apply import layer_of
from hyperjax.train import prepare
from hyperjax.train.programs import build_program
from tests.tiers import SLOW

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs/quickstart.yaml"


def run(sets, steps=3):
    cfg = load_config(QUICKSTART, [*sets, f"train.steps={steps}"])
    plan = prepare(resolve(cfg))
    t = cfg.train
    policies = block_policies(plan.offload.placement, cfg.model.layers) if plan.offload is not None else None
    model = build_model(cfg.model, dtype=t.dtype, recompute=t.recompute, seed=t.seed, policies=policies)
    program = build_program(plan, model)
    step, state = program.advance, program.state
    losses = []
    for i in range(steps):
        state, metrics = step(state, i)
        losses.append(float(metrics["loss"]))
    return plan, state, losses


def kinds(tree):
    """``{(layer, memory kind)}`` of every leaf inside the blocks."""
    return {
        (layer_of(path), leaf.sharding.memory_kind)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if layer_of(path) is not None
    }


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The losses without offload."""
    return run([])[2]


@pytest.mark.parametrize(
    "sets",
    [
        ["offload.policy=auto", "offload.device_memory_gib=0.02"],
        pytest.param(["offload.policy=greedy", "offload.device_memory_gib=0.02", "train.micro_batch=2"], marks=SLOW),
        # host gradients accumulated inside each replica, then summed in buckets
        pytest.param(
            [
                "offload.policy=greedy",
                "offload.device_memory_gib=0.02",
                "train.micro_batch=2",
                "parallel.gradient_buckets=true",
            ],
            marks=SLOW,
        ),
    ],
    ids=["auto", "greedy-accumulating", "greedy-accumulating-buckets"],
)
def test_offload_keeps_the_losses_and_puts_state_in_pinned_host(sets, reference):
    plan, state, losses = run(sets)
    placement = plan.offload.placement
    assert plan.offload.fits and placement.on("host")  # the budget forced something off the device
    assert losses == pytest.approx(reference, rel=1e-4)
    for kind, tree in (("params", state["params"]), ("optimizer", state["opt_state"])):
        expected = {
            (i, "pinned_host" if placement[f"layers.{i}.{kind}"] == "host" else "device")
            for i in range(plan.run.config.model.layers)
        }
        assert kinds(tree) == expected, kind
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state["params"]["embed"])} == {"device"}


def test_manual_activation_offload_and_recompute_keep_the_losses(reference, tmp_path):
    manual = {
        "layers.*.act.qkv": "host",
        "layers.*.act.mlp_hidden": "host",
        "layers.1.act.attn_core": "recompute",
        "layers.2.act.norms": "recompute",
        "layers.0.params": "host",
        "layers.3.act.block_in": "host",
    }
    path = tmp_path / "manual.yaml"
    cfg = QUICKSTART.read_text() + "offload: " + json.dumps({"policy": "manual", "manual": manual}) + "\n"
    path.write_text(cfg)
    cfg = load_config(path, ["train.steps=3"])
    plan = prepare(resolve(cfg))
    placement = plan.offload.placement
    assert placement["layers.3.act.qkv"] == "host" and placement["layers.2.act.norms"] == "recompute"
    model = build_model(cfg.model, seed=cfg.train.seed, policies=block_policies(placement, cfg.model.layers))
    assert model.policies[1] == (("block_in", "norms", "attn_out", "mlp_act"), ("qkv", "mlp_hidden"))  # core recomputed
    assert model.policies[3] == (("norms", "attn_core", "attn_out", "mlp_act"), ("block_in", "qkv", "mlp_hidden"))
    program = build_program(plan, model)
    step, state = program.advance, program.state
    losses = []
    for i in range(3):
        state, metrics = step(state, i)
        losses.append(float(metrics["loss"]))
    assert losses == pytest.approx(reference, rel=1e-4)


def block_inputs_kept(patterns):
    """``(on the device, on the host)``: how many block inputs the backward keeps, by its saved residuals."""
    cfg = load_config(QUICKSTART, [])
    m = cfg.model
    model = build_model(m, seed=0, policies=block_policies(from_patterns(patterns, m.layers), m.layers))
    graph, state = nnx.split(model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda s, t: nnx.merge(graph, s)(t).sum(), state, jnp.zeros((2, m.seq_len), jnp.int32))
    lines = out.getvalue().splitlines()
    return (
        sum("named 'block_in'" in line for line in lines),
        sum(line.startswith(f"f32<host>[2,{m.seq_len},{m.d_model}]") for line in lines),
    )


def test_a_block_input_placed_on_the_host_leaves_the_device():
    layers = load_config(QUICKSTART, []).model.layers
    assert block_inputs_kept({"layers.*.act.*": "recompute"}) == (layers, 0)  # the boundary, kept on the device
    # the backward reads every block's input from its host copy, and no device copy is kept
    assert block_inputs_kept({"layers.*.act.*": "recompute", "layers.*.act.block_in": "host"}) == (0, layers)
    assert block_inputs_kept({"layers.*.act.*": "recompute", "layers.1.act.block_in": "host"}) == (layers - 1, 1)


def test_train_refuses_a_budget_nothing_fits(capsys):
    code = main(["train", str(QUICKSTART), "--set", "offload.policy=auto", "--set", "offload.device_memory_gib=0.001"])
    err = capsys.readouterr().err
    assert code == 2
    assert "offload.device_memory_gib=0.001" in err and "cannot leave the device" in err
    assert "Traceback" not in err


def test_predict_json_reports_the_offload(capsys):
    args = ["predict", str(QUICKSTART), "--json", "--set", "offload.policy=auto"]
    assert main([*args, "--set", "offload.device_memory_gib=0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    off = out["offload"]
    assert {"placement", "host_gib_per_device", "transfer_s", "exposed_transfer_s"} <= set(off)
    assert off["fits"] and out["fits"] and off["placement"]
    assert out["step_time_s"] == pytest.approx(off["step_time_s"])
    assert main([*args, "--set", "offload.device_memory_gib=0.001"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["offload"]["fits"] is False and out["offload"]["smallest_budget_gib"] > 0.001
