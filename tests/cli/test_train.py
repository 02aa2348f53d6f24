import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyperjax.cli.main import main

CONFIGS = Path(__file__).parents[2] / "configs"
QUICK = str(CONFIGS / "quickstart.yaml")


def test_train_writes_metrics_plot_and_summary(capsys, tmp_path: Path):
    metrics = tmp_path / "m.jsonl"
    args = ["train", QUICK, "--steps", "3", "--metrics-out", str(metrics), "--out-dir", str(tmp_path), "--profile"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "summary" in out and "per-device memory of the compiled step" in out and "emulated step time" in out
    assert "collectives of the last step" in out
    rows = json.loads((tmp_path / "collectives.json").read_text())["collectives"]
    assert {(r["kind"], r["participants"], r["processes"]) for r in rows} == {
        ("all-reduce", 2, 1),
        ("all-reduce", 4, 1),
    }
    assert all(r["seconds"] > 0 and r["bytes"] > 0 and r["arrays"] >= r["count"] for r in rows)
    printed = {}  # the table's cells: collective, devices, processes, count, arrays, MiB, seconds, share
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 8 and cells[0] == "all-reduce":
            printed[int(cells[1])] = cells
    for r in rows:
        cells = printed[r["participants"]]
        assert cells[3:6] == [str(r["count"]), str(r["arrays"]), f"{r['bytes'] / 2**20:.2f}"]
        assert float(cells[6]) == pytest.approx(r["seconds"], abs=1e-3) and cells[7].endswith("%")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in lines)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
def test_explain_in_launched_processes(tmp_path: Path):
    """Launched processes are told nothing --explain refuses (the launcher's --out-dir is for training)."""
    cmd = [sys.executable, "-m", "hyperjax", "train", QUICK, "--explain", "--set", "emulate.processes=2"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "blocks/0/mlp/w_in" in result.stdout and not list(tmp_path.iterdir())


def test_explain(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", QUICK, "--explain", "--set", "parallel.fsdp=2", "--set", "parallel.tensor=4"]) == 0
    out = capsys.readouterr().out
    assert "blocks/0/mlp/w_in" in out and "('fsdp', 'tensor')" in out.replace("(fsdp, tensor)", "('fsdp', 'tensor')")
    assert "total" in out
    assert not list(tmp_path.iterdir())  # it trains nothing, so it makes no runs/ folder
    # what only training reads is refused, and no folder is made for it
    assert main(["train", QUICK, "--explain", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    assert "--explain prints where every parameter lives" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    # a pipeline's stages each lay out their own layers: named, not blamed on the mesh's sizes as before
    for sets in (["parallel.pipeline=2"], ["model.moe={experts: 4, top_k: 2}", "parallel.pipeline=2"]):
        assert main(["train", QUICK, "--explain", *(a for s in sets for a in ("--set", s))]) == 2
        err = capsys.readouterr().err
        assert "not in the 2 stages of this run (parallel.pipeline=2)" in err and "multiply to" not in err, err
        assert "or set parallel.pipeline=1 to explain one program" in err
    assert main(["train", str(Path(QUICK).parent / "vlm-tiny-mpmd.yaml"), "--explain"]) == 2
    assert "(mpmd.submeshes); --plan-only lists each stage's devices and axes, or drop mpmd.submeshes" in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--set", "parallel.tensr=2"], r"unknown config key parallel.tensr; did you mean parallel.tensor\?"),
        (["--set", "parallel.tensor=3"], r"do not divide the 8 devices"),
        (
            ["--set", "model.heads=4", "--set", "parallel.tensor=8"],
            r"dimension '(kv_)?heads' of size 4 is not divisible",
        ),
        (["--steps", "0"], r"--steps 0 must be a positive integer"),
        (["--metrics-out", "/nonexistent/m.jsonl"], r"folder '/nonexistent' does not exist"),
        (["--profile", "--plan-only"], r"--profile times the last training step"),
        (["--plan-only", "--process-id", "1"], r"--process-id joins a running job, but --plan-only .* drop one"),
        (["--plan-only", "--explain"], r"--explain prints where every parameter lives .* drop one of them"),
        (["--explain", "--steps", "5"], r"--steps sets how training runs .* --explain .* trains nothing; drop one"),
        (["--explain", "--metrics-out", "m.jsonl"], r"--metrics-out sets how training runs or where it writes"),
        (["--platform", "auto"], r"--platform auto runs on this host's accelerators .* joining flags"),
        (["--plan-only", "--platform", "auto"], r"--platform auto chooses the devices .* --plan-only .* drop one"),
        (
            [
                "--set",
                "emulate.processes=2",
                "--coordinator",
                "127.0.0.1:1",
                "--num-processes",
                "1",
                "--process-id",
                "0",
            ],
            r"emulate.processes 2 asks for 2 process\(es\), but --num-processes 1 joins a job of 1",
        ),
        (
            ["--set", "parallel.gradient_buckets=true", "--set", "parallel.data=1", "--set", "parallel.tensor=8"],
            r"parallel.gradient_buckets=true needs data-parallel replicas .* set it to null or false",
        ),
        (
            ["--set", "parallel.gradient_buckets=true", "--set", "parallel.pipeline=2", "--set", "parallel.tensor=4"],
            r"parallel.gradient_buckets=true needs data-parallel replicas to sum: data > 1 on some stage .* null",
        ),
        (
            ["--profile", "--steps", "1", "--set", "parallel.pipeline=2", "--set", "parallel.tensor=1"],
            r"--profile: collectives are timed in one SPMD program, not in the 2 pipeline .* drop --profile",
        ),
        (["--set", "train.seed=-1"], r"train.seed=-1 must be in \[0, 2\*\*63\)"),
        (["--set", "train.seed=99999999999999999999999"], r"train.seed=99999999999999999999999 must be in"),
        (["--set", "train.steps=99999999999999999999"], r"train.steps=99999999999999999999 must be below 2\*\*31"),
        # a model whose state alone outgrows this machine is refused before any process starts
        (
            ["--set", "model.layers=100", "--set", "model.d_model=65536", "--set", "model.heads=64"],
            r"training this model on 8 emulated devices holds about [\d,]+ GiB of parameters, gradients and "
            r"optimizer state .* more than this machine's \d+ GiB of memory; train a smaller model",
        ),
    ],
)
def test_bad_input_exits_2(capsys, args, pattern):
    assert main(["train", QUICK, *args]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (
            ["--profile", "--steps", "1"],
            r"--profile: .* paired forward and backward programs of parallel.overlap=fb-pair",
        ),
        (
            ["--set", "offload.policy=manual", "--set", "offload.manual={layers.1.optimizer: host}"],
            r"offload.policy='manual': .* paired forwards and backwards \(parallel.overlap: fb-pair\)",
        ),
    ],
)
def test_paired_steps_refuse_what_needs_one_program(capsys, args, pattern):
    """Without a pipeline, fb-pair runs the step as paired per-chunk programs: what applies to one SPMD
    program (profiling its collectives, an offload placement) is refused by name."""
    paired = ["--set", "parallel.expert=2", "--set", "parallel.overlap=fb-pair", "--set", "train.microbatches=2"]
    assert main(["train", str(CONFIGS / "moe-tiny.yaml"), *paired, *args]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err


def test_missing_config_from_the_shell():
    result = subprocess.run([sys.executable, "-m", "hyperjax", "train", "nope.yaml"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "config file 'nope.yaml' does not exist" in result.stderr and "Traceback" not in result.stderr


def train_losses(
    config: str, *args: str, tmp_path: Path, name: str = "m", env: dict[str, str | None] | None = None
) -> tuple[list[float], str]:
    """Run ``hyperjax train`` in a subprocess (``env`` set in its environment, ``None`` values removed); return
    the per-step losses and its stdout and stderr."""
    changes = env or {}
    environment = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    metrics = tmp_path / f"{name}.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperjax",
            "train",
            config,
            *args,
            "--metrics-out",
            str(metrics),
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=environment,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], result.stdout + result.stderr


@pytest.mark.slow  # a 50-step run
def test_quickstart_learns(tmp_path: Path):
    losses, _ = train_losses(QUICK, tmp_path=tmp_path)
    assert len(losses) == 50
    assert losses[-1] < 0.6 * losses[0]  # byte-level text: from ~5.6 (uniform) to well below


@pytest.mark.large
@pytest.mark.multiprocess
def test_gpt_tiny_cm384_trains_on_384_devices(tmp_path: Path):
    losses, out = train_losses(str(CONFIGS / "gpt-tiny-cm384.yaml"), "--steps", "3", "--profile", tmp_path=tmp_path)
    assert "384 emulated cloudmatrix384 devices" in out and "gradient buckets over data" in out
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    assert losses[2] < losses[0]
    rows = json.loads((tmp_path / "collectives.json").read_text())["collectives"]
    crossing = [r for r in rows if r["processes"] > 1]
    # the gradients cross processes once: one flat array over one replica per process (12), after the
    # sum inside each process; tensor parallelism stays inside the processes
    assert [(r["kind"], r["participants"], r["processes"], r["arrays"]) for r in crossing] == [
        ("all-reduce", 12, 12, 1)
    ]


@pytest.mark.parametrize(
    ("sets", "pattern"),
    [
        (["model.moe.top_k=9"], r"model.moe.top_k=9 exceeds model.moe.experts=8: .* choose top_k <= 8"),
        (["parallel.expert=3"], r"model.moe.experts=8 is not divisible by parallel.expert=3; choose an expert degree"),
        (["model.moe.capacity_factor=0"], r"model.moe.capacity_factor=0.0 must be > 0 .* or null for dropless"),
        (["model.moe.capacity_factor=-1"], r"model.moe.capacity_factor=-1.0 must be > 0"),
        (["model.moe.router=top1"], r"model.moe.router='top1' is not one of \('softmax', 'sigmoid'\)"),
        (["model.moe.balance=aux_los"], r"model.moe.balance='aux_los' is not one of .*did you mean 'aux_loss'"),
        (["model.moe.experts=0"], r"model.moe.experts"),
        (["model.moe.first_dense=4"], r"model.moe.first_dense=4 leaves no MoE layer among model.layers=4"),
        (["model.moe=null"], r"parallel.expert=4 shards the experts .* but model.moe is null"),
        (["parallel.expert_tensor=1", "parallel.tensor=2", "parallel.expert=2"], r"set parallel.sequence_parallel"),
        (["model.moe.expert=8"], r"unknown config key model.moe.expert; did you mean model.moe.experts\?"),
    ],
)
@pytest.mark.parametrize("command", ["train", "predict"])
def test_bad_moe_configs_exit_2(capsys, command, sets, pattern):
    args = [command, str(CONFIGS / "moe-tiny.yaml")]
    assert main([*args, *(x for s in sets for x in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err


@pytest.mark.slow  # a 20-step run
def test_moe_tiny_learns_and_reports_its_router(tmp_path: Path):
    losses, out = train_losses(str(CONFIGS / "moe-tiny.yaml"), "--steps", "20", tmp_path=tmp_path)
    assert "strategy: data=2, expert=4" in out and "expert load in the last step (8 experts, top-2)" in out
    assert losses[-1] < 0.7 * losses[0]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    for r in records:
        assert r["aux_loss"] > 0.9 and r["expert_load_max_over_mean"] >= 1 and r["dropped_fraction"] == 0


@pytest.mark.large
@pytest.mark.multiprocess
def test_moe_cm384_spreads_experts_over_the_supernode(tmp_path: Path):
    losses, out = train_losses(str(CONFIGS / "moe-cm384.yaml"), tmp_path=tmp_path)
    assert "384 emulated cloudmatrix384 devices (12 process(es)); strategy: expert=48, tensor=8" in out
    assert "expert load in the last step (96 experts, top-2)" in out
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    assert losses[2] < losses[0]


@pytest.mark.multiprocess
def test_two_processes_give_the_same_losses(tmp_path: Path):
    def run(processes: int, env: dict[str, str | None] | None = None) -> tuple[list[float], str]:
        args = ("--steps", "3", "--set", f"emulate.processes={processes}")
        return train_losses(QUICK, *args, tmp_path=tmp_path, name=f"m{processes}", env=env)

    # JAX's compiler log, without the session's compilation cache, as a user runs it; a process waiting for a
    # program that never comes fails within two minutes, not twenty
    log = {
        "JAX_DEBUG_LOG_MODULES": "jax._src.compiler",
        "JAX_COMPILATION_CACHE_DIR": None,
        "JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS": "120000",
    }
    two, out = run(2, log)  # data=4 over two processes: the replicas sum their gradients in buckets, inside processes
    assert two == pytest.approx(run(1)[0], rel=1e-6)  # against XLA's reductions in one process
    # the step spans both processes: process 0 compiles it and hands it over; process 1 compiles nothing of it
    assert re.search(r"\[p0\].*compiling and sharing module: jit_step\b", out), out[-3000:]
    assert re.search(r"\[p1\].*Waiting for module: jit_step from process 0", out), out[-3000:]
    assert not re.search(r"\[p1\].*compiling and sharing module", out)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("config", "sets"),
    [
        # the encoder's submesh in process 0, the language model's across processes 0 and 1
        ("vlm-tiny-mpmd.yaml", ()),
        # a 2-stage GPT pipeline, one stage per process (the tied embedding crosses too)
        ("quickstart.yaml", ("--set", "parallel.tensor=1", "--set", "parallel.pipeline=2")),
    ],
    ids=["vlm", "pipeline"],
)
def test_mpmd_across_processes_gives_the_same_losses(tmp_path: Path, config: str, sets: tuple[str, ...]):
    def run(processes: int) -> list[float]:
        args = ("--steps", "3", *sets, "--set", f"emulate.processes={processes}")
        return train_losses(str(CONFIGS / config), *args, tmp_path=tmp_path, name=f"m{processes}")[0]

    two = run(2)
    assert two == pytest.approx(run(1), rel=1e-4)


@pytest.mark.large
@pytest.mark.multiprocess
def test_vlm_cm384_trains_mpmd_across_processes(tmp_path: Path):
    # one step of the shipped config: its two micro-batches cross from the encoder's 4 processes to the language
    # model's 8 and back; later steps across processes are the 2-process MPMD oracle's (test below)
    log = {"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
    losses, out = train_losses(str(CONFIGS / "vlm-cm384.yaml"), "--steps", "1", tmp_path=tmp_path, env=log)
    assert "384 emulated cloudmatrix384 devices (12 process(es))" in out and "mpmd vision: 128 devices" in out
    assert len(losses) == 1 and 0 < losses[0] < 10
    # each submesh's programs are compiled by its first process alone: process 0 for the encoder's 0-3, process 4
    # for the language model's 4-11
    sharing = set(re.findall(r"\[p(\d+)\].*compiling and sharing module", out))
    assert sharing == {"0", "4"}, sharing


def test_a_diverged_run_stops_at_the_step_and_keeps_only_finite_records(capsys, tmp_path: Path):
    """A loss that is not finite poisons every later step: the run stops there (exit 2) naming the step and the
    fix, the metrics hold the steps before it as valid JSON, and no checkpoint of the diverged state is made."""
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    sets = ["--set", "train.lr=1.0e+9", "--set", "train.warmup_steps=0", "--set", "train.checkpoint_every=1"]
    args = ["train", QUICK, "--steps", "4", *sets, "--metrics-out", str(metrics), "--checkpoint-dir", str(ck)]
    assert main([*args, "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    step = int(re.search(r"step (\d+): the loss is nan", err).group(1))
    assert "lower train.lr or raise train.warmup_steps" in err and "Traceback" not in err
    lines = metrics.read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the metrics")) for line in lines]
    assert [r["step"] for r in records] == list(range(1, step))
    assert all(math.isfinite(r["loss"]) for r in records)
    from hyperjax.train.checkpoint import saved_steps

    assert saved_steps(ck) == list(range(1, step))[-3:]  # the newest kept, none of the diverged step
    assert f"the last checkpoint, {ck / str(step - 1)}, is kept" in err


@pytest.mark.slow
def test_a_pipelines_summary_says_its_memory_is_the_state_it_holds(capsys, tmp_path: Path):
    """A schedule of per-chunk programs is measured by the parameters, gradient accumulators and optimizer
    state its fullest stage holds, not by a compiled step's activations: the summary says so."""
    small = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.d_ff=256", "model.seq_len=32"]
    small += ["train.global_batch=16", "parallel.pipeline=2", "parallel.tensor=1", "train.microbatches=4"]
    args = ["train", QUICK, "--steps", "1", "--out-dir", str(tmp_path), *(x for s in small for x in ("--set", s))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "per-device memory of the held state (parameters, gradient accumulators, optimizer state" in out


def test_a_batch_the_machine_cannot_hold_exits_2_before_any_device(tmp_path, capsys):
    args = ["train", QUICK, "--set", "train.global_batch=1000000000", "--out-dir", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "train.global_batch=1000000000: a step's 129,000,000,000 tokens take about" in err, err
    assert "Traceback" not in err
