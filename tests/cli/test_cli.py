import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hyperjax.cli.main import main

CLI = [sys.executable, "-m", "hyperjax"]
CONFIGS = Path(__file__).parents[2] / "configs"
JOIN_ONE = [
    "selftest",
    "--hardware",
    "dgx-h100",
    "--devices",
    "8",
    "--coordinator",
    "127.0.0.1:1",
    "--num-processes",
    "1",
]
JOIN_ONE += ["--process-id", "0"]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_topology_prints_the_machine(capsys):
    assert main(["topology", "cloudmatrix384"]) == 0
    out = capsys.readouterr().out
    for text in ("384 x Ascend 910C", "node", "supernode", "rdma", "392.0", "151 GB/s", "data=48,tensor=8"):
        assert text in out


def test_topology_lists_presets(capsys):
    assert main(["topology"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("cloudmatrix384", "supernode-12x32", "dgx-a100-80g", "dgx-h100", "tpu-v5p"))


def test_topology_json_lists_presets_too(capsys):
    assert main(["topology", "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert {"cloudmatrix384", "dgx-h100", "tpu-v5p"} <= {p["name"] for p in shipped}
    assert all(p["description"] for p in shipped)


def test_topology_json(capsys):
    assert main(["topology", "dgx-h100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tiers"][0]["bandwidth"] == 450e9
    assert data["default_axes"] == {"data": 8, "tensor": 8}
    assert data["device"]["matmul_precision"] == {"float32": "tf32"}


def test_topology_says_how_float32_products_run(capsys):
    assert main(["topology", "dgx-h100"]) == 0
    assert "float32 matrix products run as tf32" in capsys.readouterr().out
    assert main(["topology", "cloudmatrix384"]) == 0
    assert "matrix products run as" not in capsys.readouterr().out


QUICK_SIX = ["train", str(CONFIGS / "quickstart.yaml"), "--devices", "6", "--set", "train.global_batch=30"]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["topology", "cm384"], r"unknown hardware preset 'cm384'.*Known presets: .*cloudmatrix384"),
        (["selftest", "--hardware", "nope"], r"unknown hardware preset 'nope'"),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--axes", "data=2,tensor=3"],
            r"mesh axes \{'data': 2, 'tensor': 3\} multiply to 6 devices but 8 devices are in use",
        ),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--axes", "data=0,tensor=8"],
            r"mesh axis 'data' has size 0",
        ),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--axes", "data:8"],
            r"malformed mesh axes 'data:8'.*e\.g\. --axes data=12,tensor=32",
        ),
        (["selftest", "--hardware", "cloudmatrix384", "--devices", "0"], r"--devices 0 must be a positive integer"),
        (["selftest", "--hardware", "cloudmatrix384", "--devices", "-8"], r"--devices -8 must be a positive integer"),
        (["plan", str(CONFIGS / "quickstart.yaml"), "--devices", "0"], r"^hyperjax plan: error: --devices 0 must be"),
        (["plan", str(CONFIGS / "quickstart.yaml"), "--devices", "8", "--top", "0"], r"error: --top 0 must be a"),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--processes", "1"],
            r"384 devices per process .* 256-device limit",
        ),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--processes", "3"],
            r"8 devices cannot be split evenly over 3 processes",
        ),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--json", "/nonexistent/x.json"],
            r"--json '/nonexistent/x.json': folder '/nonexistent' does not exist",
        ),
        (
            ["selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--coordinator", "127.0.0.1:1"],
            r"--coordinator, --num-processes and --process-id must be given together",
        ),
        (
            ["selftest", "--hardware", "dgx-h100", "--devices", "8", "--platform", "auto"],
            r"--platform auto runs on this host's accelerators .* drop --platform, or add the joining flags",
        ),
        (
            [*JOIN_ONE, "--processes", "2"],
            r"--processes 2 asks for 2 process\(es\), but --num-processes 1 joins a job of 1; drop --processes",
        ),
        (
            ["predict", str(CONFIGS / "quickstart.yaml"), "--set", "parallel.overlap=two-microbatch"],
            r"parallel.overlap='two-microbatch' hides a mixture of experts' all-to-all, but the model has no MoE",
        ),
        (
            [*QUICK_SIX, "--set", "parallel.zero_stage=2"],
            r"tensor 'embed' .* zero_stage=2 shards its state over mesh axis 'data' \(3 devices\)",
        ),
        (
            [
                "train",
                str(CONFIGS / "moe-tiny.yaml"),
                "--set",
                "parallel.overlap=fb-pair",
                "--set",
                "train.microbatches=1",
            ],
            r"parallel.overlap='fb-pair' without a pipeline .* 1 micro-batch; set train.microbatches >= 2",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, args, pattern):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err


def test_a_key_set_again_takes_the_later_value(capsys):
    sets = ["--set", "parallel.tensor=2", "--set", "train.steps=3", "--set", "parallel.tensor=4"]
    assert main(["predict", str(CONFIGS / "quickstart.yaml"), *sets, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["parallel"]["tensor"] == 4


def test_bad_input_from_the_shell_has_no_traceback():
    result = run_cli("selftest", "--hardware", "cloudmatrix384", "--axes", "data=12,tensor=x")
    assert result.returncode == 2
    assert "size 'x' of axis 'tensor' is not an integer" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_reader_that_stops_early_ends_the_command_without_a_traceback():
    """``hyperjax plan ... --json | head -1``: the closed pipe ends the command quietly, as a shell tool
    killed by SIGPIPE ends (status 141)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [*CLI, "predict", str(CONFIGS / "quickstart.yaml"), "--json"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        proc.stdout.close()  # no reader: the first write fails
        err = proc.stderr.read().decode()
        status = proc.wait(timeout=300)
    assert status == 141 and err == ""


def test_selftest_8_devices_in_process(capsys, tmp_path: Path):
    out = tmp_path / "selftest.json"
    assert (
        main(
            [
                "selftest",
                "--hardware",
                "cloudmatrix384",
                "--devices",
                "8",
                "--axes",
                "data=2,tensor=4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "selftest passed: 10/10 collectives matched numpy" in text
    data = json.loads(out.read_text())
    assert data["passed"] and data["devices"] == 8 and len(data["checks"]) == 10
    assert [p.name for p in tmp_path.iterdir()] == ["selftest.json"]  # no temporary left behind


@pytest.mark.multiprocess
def test_selftest_two_processes():
    result = run_cli(
        "selftest", "--hardware", "dgx-a100-80g", "--devices", "8", "--processes", "2", "--axes", "data=2,tensor=4"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 emulated devices in 2 process(es)" in result.stdout
    assert "selftest passed: 10/10" in result.stdout
    assert "[Gloo]" not in result.stdout  # native chatter is kept out of the log


@pytest.mark.multiprocess
def test_killing_a_process_stops_the_launcher():
    proc = subprocess.Popen(
        [*CLI, "selftest", "--hardware", "cloudmatrix384", "--devices", "8", "--processes", "2", "--iters", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        victim = None
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        for line in proc.stdout:
            if m := re.search(r"process 1 \(pid (\d+)\)", line):
                victim = int(m.group(1))
            if line.startswith("[p0] selftest on"):  # both processes are up and running collectives
                break
            assert time.monotonic() < deadline, "the job did not start"
        assert victim is not None
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - killed_at < 30
        assert proc.returncode != 0
        assert f"emulated process 1 (pid {victim}) was killed by SIGKILL" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.large
def test_selftest_256_devices_one_process():
    result = run_cli("selftest", "--hardware", "cloudmatrix384", "--devices", "256")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "256 emulated devices in 1 process(es)" in result.stdout
    assert "selftest passed: 10/10" in result.stdout


@pytest.mark.large
@pytest.mark.multiprocess
def test_selftest_384_devices_cloudmatrix(tmp_path: Path):
    out = tmp_path / "st.json"
    result = run_cli("selftest", "--hardware", "cloudmatrix384", "--json", str(out), timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert "384 emulated devices in" in result.stdout
    data = json.loads(out.read_text())
    assert data["devices"] == 384 and data["passed"]
    assert data["axes"] == {"data": 48, "tensor": 8}
    assert all(c["ok"] for c in data["checks"]) and len(data["checks"]) == 10


def test_predict_reports_the_moe_all_to_all(capsys):
    assert main(["predict", str(CONFIGS / "deepseek-v3-671b.yaml"), "--set", "parallel.overlap=fb-pair", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    a = d["all_to_all"]
    assert 0 < a["hidden_fraction"] < 1 and a["exposed_s"] < a["total_s"]
    assert d["run"]["overlap"] == "fb-pair"
    assert main(["predict", str(CONFIGS / "deepseek-v3-671b.yaml")]) == 0
    assert "MoE all-to-all (none overlap)" in capsys.readouterr().out


def test_predict_names_the_budget_it_judges_fit_against(capsys):
    """The verdict names the budget and both sizes, as serving's does: the preset's usable memory, or
    offload.device_memory_gib when set."""
    assert main(["predict", str(CONFIGS / "quickstart.yaml"), "--set", "offload.device_memory_gib=0.01"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(
        r"does not fit \(\w+ is the largest term\) in offload.device_memory_gib: peak [\d.]+ GiB of 0.01 GiB", out
    )
    assert main(["predict", str(CONFIGS / "quickstart.yaml")]) == 0
    assert re.search(r"fits in device memory: peak [\d.]+ GiB of [\d.]+ GiB", capsys.readouterr().out)
