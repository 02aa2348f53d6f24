import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest
import yaml

from hyperjax import estimate, load_config, resolve
from hyperjax.cli.main import main
from hyperjax.config import Config, build
from hyperjax.cost.trace import simulate
from hyperjax.mpmd.timing import replay

ROOT = Path(__file__).parents[2]
CFG = build(
    Config,
    yaml.safe_load((ROOT / "benchmarks/validation/korthikanti-175b-full-recompute.yaml").read_text())["config"],
    "",
)


@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved", 3), ("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1)])
def test_simulated_schedule_ends_at_the_predicted_step_time(schedule, virtual):
    cfg = dataclasses.replace(
        CFG, parallel=dataclasses.replace(CFG.parallel, schedule=schedule, virtual_stages=virtual)
    )
    est = estimate(resolve(cfg))
    events = simulate(est)
    end = max(e["ts"] + e["dur"] for e in events) / 1e6
    assert end == pytest.approx(est.step_time_s, rel=1e-4)  # the estimate rounds task-length ratios
    m = est.run.microbatches
    for stage in range(8):
        mine = [e for e in events if e["pid"] == stage and e["tid"] == 0]
        assert sum(e["name"] == "forward" for e in mine) == m * virtual
        assert sum(e["name"] == "backward" for e in mine) == m * virtual
        assert sum(e["name"] == "weight gradient" for e in mine) == (m if schedule == "zero-bubble" else 0)
        ends = [(e["ts"], e["ts"] + e["dur"]) for e in mine]
        assert all(b[0] >= a[1] - 1e-6 for a, b in itertools.pairwise(ends))  # one task at a time


def test_predicted_bubble_is_the_replayed_grid():
    """The estimate's bubble is the trace's idle time: both come from one grid and one set of task lengths."""
    for schedule, virtual in (("1f1b", 1), ("interleaved", 2), ("zero-bubble", 1)):
        cfg = dataclasses.replace(
            CFG, parallel=dataclasses.replace(CFG.parallel, schedule=schedule, virtual_stages=virtual)
        )
        est = estimate(resolve(cfg))
        sched, seconds = est.schedule()
        makespan = max(e for _, _, e in replay(sched, seconds).values())
        busy = sum(seconds.values()) / sched.stages
        assert est.breakdown_s["pipeline_bubble"] == pytest.approx(makespan - busy, rel=1e-3)


def test_zero_bubble_beats_1f1b_in_prediction():
    times = {}
    for schedule in ("1f1b", "zero-bubble"):
        parallel = dataclasses.replace(CFG.parallel, schedule=schedule, virtual_stages=1)
        cfg = dataclasses.replace(CFG, parallel=parallel)
        times[schedule] = estimate(resolve(cfg)).breakdown_s["pipeline_bubble"]
    assert times["zero-bubble"] < 0.75 * times["1f1b"]  # W (a third of the work here) fills the cool-down


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


def test_a_trace_is_written_through_a_link_and_never_over_a_device_or_pipe(tmp_path: Path):
    """--trace through a symbolic link writes the file it names (the link stays), with the user's umask;
    a pipe (or a device) is refused before any work rather than replaced by the rename."""
    quick = str(ROOT / "configs/quickstart.yaml")
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(real)
    assert main(["predict", quick, "--trace", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["traceEvents"]
    umask = os.umask(0)
    os.umask(umask)
    assert real.stat().st_mode & 0o777 == 0o666 & ~umask
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    assert main(["predict", quick, "--trace", str(pipe)]) == 2
    assert pipe.is_fifo()


def test_all_to_alls_run_in_the_chunks_that_hold_moe_blocks():
    sets = ["parallel.tensor=1", "parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    sets += ["train.microbatches=4", "parallel.stage_layers=[0,2,2,0]"]
    est = estimate(resolve(load_config(ROOT / "configs" / "moe-tiny.yaml", sets)))
    chunks = {e["args"]["task"].split(".")[1] for e in simulate(est) if "lane task" in e.get("args", {})}
    assert chunks == {"1", "2"}  # the embedding's and the loss's chunks exchange nothing


@pytest.mark.parametrize(
    "sets",
    [["offload.device_memory_gib=0.05"], ["offload.device_memory_gib=0.03", "parallel.pipeline=2", "parallel.data=2"]],
)
def test_an_offloaded_step_is_traced_as_its_placement_prices_it(tmp_path: Path, capsys, sets):
    """Under a placement the trace adds the recomputation it chose and the host transfers it leaves exposed,
    so it ends at the step predict prints, not at the step without the placement."""
    path = tmp_path / "step.json"
    args = ["predict", str(ROOT / "configs/quickstart.yaml"), "--json", "--trace", str(path)]
    args += [a for s in ["offload.policy=auto", *sets] for a in ("--set", s)]
    assert main(args) == 0
    step = json.loads(capsys.readouterr().out)["step_time_s"]
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in events) / 1e6 == pytest.approx(step, rel=1e-4)
    assert {"recomputation (placement)", "exposed host transfers"} & {e["name"] for e in events}


@pytest.mark.parametrize(
    ("config", "sets"),
    [
        ("moe-tiny.yaml", ["parallel.tensor=1", "parallel.pipeline=2", "train.microbatches=4"]),
        ("quickstart.yaml", ["parallel.pipeline=2", "parallel.tensor=1", "parallel.data=4", "train.micro_batch=2"]),
        ("deepseek-v3-671b.yaml", []),
    ],
)
def test_a_trace_is_refused_past_the_events_it_draws(config, sets, tmp_path: Path, capsys, monkeypatch):
    """The events a trace would hold are counted before it is drawn (as many as are drawn, give or take a
    tenth), and a step of more than ``TRACE_EVENTS`` is refused with its counts and the fix, writing nothing,
    where drawing its grid of tasks would run for minutes (12.5 million micro-batches) and write gigabytes."""
    from hyperjax.cost import trace

    run = resolve(load_config(ROOT / "configs" / config, sets))
    drawn = len(simulate(estimate(run)))
    monkeypatch.setattr(trace, "TRACE_EVENTS", int(drawn * 0.9))
    args = ["predict", str(ROOT / "configs" / config), *(f"--set={s}" for s in sets), "--trace", str(tmp_path / "t")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"on {run.chunks} model chunks" in err and "a smaller train.global_batch" in err
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(trace, "TRACE_EVENTS", int(drawn * 1.1))
    assert main(args) == 0 and (tmp_path / "t").is_file()
