import json
import re
from pathlib import Path

import pytest
import yaml

from hyperjax import estimate, plan, resolve
from hyperjax.cli.main import main
from hyperjax.config import Config, build
from hyperjax.search import candidate, strategies

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
    best, priced, fitting = plan(cfg, published.devices, keep=3)
    assert priced >= fitting > 0
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


def test_plan_cli_json(capsys):
    args = ["plan", str(ROOT / "configs/quickstart.yaml"), "--devices", "8", "--json", "--top", "3"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["candidates"]) == 3
    assert data["best"] == data["candidates"][0]
    times = [c["step_time_s"] for c in data["candidates"]]
    assert times == sorted(times)
    assert {"parallel.tensor", "parallel.pipeline", "train.recompute", "step_time_s"} <= set(data["best"])


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
    assert re.search(r"none of the \d+ strategies on 2 devices fits 119 GiB per device; the leanest needs", err), err
