"""The public API is what the packages re-export, and the benchmarks use nothing else."""

import ast
import importlib
from pathlib import Path

import pytest

import hyperjax

BENCHMARKS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))
TAUGHT = [  # what the README and docs/ teach, from the top level
    "load_config",
    "resolve",
    "Run",
    "train",
    "estimate",
    "plan",
    "make_schedule",
    "Placement",
    "build_model",
    "Strategy",
    "make_mesh",
    "load_hardware",
    "start_devices",
]


def test_the_top_level_exports_what_the_readme_teaches():
    assert set(TAUGHT) <= set(hyperjax.__all__)
    for name in hyperjax.__all__:
        assert getattr(hyperjax, name) is not None, name
    for internal in ("Cluster", "plan_processes", "MAX_DEVICES_PER_PROCESS"):  # emulation internals
        assert internal not in hyperjax.__all__


def public(module: str) -> set[str]:
    mod = importlib.import_module(module)
    return set(getattr(mod, "__all__", [n for n in vars(mod) if not n.startswith("_")]))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmarks_import_only_the_public_api(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hyperjax"):
            assert node.module.count(".") <= 1, f"{path.name}: from {node.module} import ... (a private module)"
            names = public(node.module)
            for alias in node.names:
                assert alias.name in names, f"{path.name}: {alias.name} is not public in {node.module}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("hyperjax.") or alias.name.count(".") <= 1, alias.name
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hyperjax":
            assert node.attr in hyperjax.__all__, f"{path.name}: hyperjax.{node.attr} is not exported"


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmarks_parse_their_command_line(path):
    """Every benchmark reads its arguments with argparse: ``--help`` says what it measures, and a flag it does
    not know is refused (exit 2) rather than ignored while the whole benchmark runs."""
    tree = ast.parse(path.read_text())
    calls = {
        node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert "parse_args" in calls, f"{path.name} reads no command line"
    assert "argv" not in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}, f"{path.name} reads sys.argv"


@pytest.mark.slow
def test_the_emulation_benchmark_writes_its_json(tmp_path):
    """A short run of ``benchmarks/emulation.py`` prints its table and writes its JSON (the model as data)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "emulation.json"
    script = BENCHMARKS[0].parent / "emulation.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "1", "--rounds", "1", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps_each"] == 1 and result["model"]["d_model"] > 0
    refused = subprocess.run([sys.executable, str(script), "--rounds", "0"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--rounds 0: at least 1" in refused.stderr
