"""``hyperjax plan`` with a budget that only offloading meets."""

import json
from pathlib import Path

from hyperjax.cli.main import main

QUICKSTART = Path(__file__).parents[2] / "configs/quickstart.yaml"
ARGS = [
    *("plan", str(QUICKSTART), "--devices", "8", "--json"),
    *("--set", "model.layers=16", "--set", "offload.device_memory_gib=0.01"),
]


def test_plan_offloads_when_nothing_else_fits(capsys):
    assert main(ARGS) == 2  # no strategy fits 0.01 GiB without the placement pass
    assert "fits 0.01 GiB" in capsys.readouterr().err
    assert main([*ARGS, "--set", "offload.policy=auto"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    assert best["offload.policy"] == "auto" and best["offload"]["fits"] and best["peak_gib"] <= 0.01
    assert best["offload"]["placement"]
    assert all(c["step_time_s"] >= best["step_time_s"] for c in out["candidates"])


def test_plan_reports_fits_false_when_no_placement_fits(capsys):
    args = ["plan", str(QUICKSTART), "--devices", "8", "--json", "--set", "offload.device_memory_gib=0.0005"]
    assert main([*args, "--set", "offload.policy=auto"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["fits"] is False and out["fitting"] == 0
    assert out["smallest_budget_gib"] > 0.0005 and out["cannot_fit"]
    assert "smallest" not in captured.err or "GiB" in captured.err
    assert "Traceback" not in captured.err
