import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from hyperjax import load_hardware
from hyperjax.cli.main import main
from hyperjax.cost import estimate
from hyperjax.cost.trace import simulate, stage_order
from hyperjax.train.config import Config, build

ROOT = Path(__file__).parents[2]
CFG = build(
    Config,
    yaml.safe_load((ROOT / "benchmarks/validation/korthikanti-175b-full-recompute.yaml").read_text())["config"],
    "",
)


@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved", 3), ("1f1b", 1), ("gpipe", 1)])
def test_simulated_schedule_ends_at_the_predicted_step_time(schedule, virtual):
    cfg = dataclasses.replace(
        CFG, parallel=dataclasses.replace(CFG.parallel, schedule=schedule, virtual_stages=virtual)
    )
    est = estimate(cfg, load_hardware("dgx-a100-80g"))
    events = simulate(est)
    end = max(e["ts"] + e["dur"] for e in events) / 1e6
    assert end == pytest.approx(est.step_time_s, rel=1e-9)
    for stage in range(8):
        mine = [e for e in events if e["pid"] == stage and e["tid"] == 0]
        assert sum(e["name"] == "forward" for e in mine) == est.details["microbatches"]
        assert sum(e["name"] == "backward" for e in mine) == est.details["microbatches"]
        starts = [e["ts"] for e in mine]
        assert starts == sorted(starts)  # one stage runs one task at a time, in order


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stage_order_runs_everything_once(schedule):
    for stages in (1, 2, 4, 8):
        for m in (1, 3, 8):
            for s in range(stages):
                order = stage_order(s, stages, m, schedule)
                assert sorted(order) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
                assert all(order.index(("F", j)) < order.index(("B", j)) for j in range(m))


def test_predict_writes_a_trace(tmp_path: Path, capsys):
    path = tmp_path / "step.json"
    assert (
        main(
            [
                "predict",
                str(ROOT / "configs/quickstart.yaml"),
                "--set",
                "parallel.pipeline=2",
                "--set",
                "parallel.tensor=1",
                "--set",
                "parallel.data=4",
                "--set",
                "train.micro_batch=2",
                "--trace",
                str(path),
            ]
        )
        == 0
    )
    data = json.loads(path.read_text())
    names = {e["name"] for e in data["traceEvents"]}
    assert {"forward", "backward", "optimizer step", "process_name"} <= names
    assert {e["pid"] for e in data["traceEvents"]} == {0, 1}
    assert main(["predict", str(ROOT / "configs/quickstart.yaml"), "--trace", "/nonexistent/t.json"]) == 2
