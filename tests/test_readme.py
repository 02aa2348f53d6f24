"""The README's Python examples run as shown."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in re.findall(r"print\(.*\)\s+# (\S+)", code):  # "# 32768 bytes" -> the output shows 32768
        assert expected.split()[0].rstrip(":") in result.stdout, (expected, result.stdout)
