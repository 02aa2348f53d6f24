import sys
import time

import pytest

from hyperjax.emulate import describe_exit, free_port, launch

PY = sys.executable


def child(code: str) -> list[str]:
    return [PY, "-c", code]


def test_all_succeed_and_output_is_prefixed(capfd):
    assert launch([child("print('hello from 0')"), child("print('hello from 1')")]) == 0
    out = capfd.readouterr().out
    assert "[p0] hello from 0" in out
    assert "[p1] hello from 1" in out
    assert "started process 0 (pid" in out


def test_failure_stops_the_others_quickly(capfd):
    start = time.monotonic()
    status = launch([child("import time; time.sleep(60)"), child("import sys; sys.exit(3)")])
    assert time.monotonic() - start < 15
    assert status == 3
    err = capfd.readouterr().err
    assert "emulated process 1 (pid" in err
    assert "exited with status 3" in err
    assert "stopping the other 1 running process(es)" in err


def test_killed_child_is_named(capfd):
    status = launch(
        [child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), child("import time; time.sleep(60)")]
    )
    assert status == 128 + 9
    assert "emulated process 0" in capfd.readouterr().err


def test_hung_child_after_others_finish(capfd):
    start = time.monotonic()
    status = launch([child("pass"), child("import time; time.sleep(60)")], exit_timeout_s=1.0)
    assert status == 1
    assert time.monotonic() - start < 15
    assert "process(es) [1] still running" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (0, "exited with status 0"),
        (2, "exited with status 2"),
        (-9, "was killed by SIGKILL"),
        (-15, "was killed by SIGTERM"),
    ],
)
def test_describe_exit(code, text):
    assert describe_exit(code) == text


def test_free_port():
    port = free_port()
    assert 1024 <= port < 65536
