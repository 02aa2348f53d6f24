"""Every command's ``--help`` fits a screen and shows an example; ``hyperjax --version`` answers."""

import os
from importlib.metadata import version

import pytest

from hyperjax.cli.main import COMMANDS, main

SCREEN = (80, 40)  # columns, lines


@pytest.fixture
def screen(monkeypatch):
    monkeypatch.setitem(os.environ, "COLUMNS", str(SCREEN[0]))


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_fits_a_screen_and_shows_an_example(screen, capsys, command):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"] if command else ["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    lines = out.rstrip("\n").splitlines()
    assert len(lines) <= SCREEN[1], f"{len(lines)} lines"
    assert max(map(len, lines)) <= SCREEN[0], max(lines, key=len)
    if command:
        assert f"\n  hyperjax {command} " in "\n" + out.partition("\nexamples:\n")[2]
        assert f"usage: hyperjax {command} " in out


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hyperjax {version('hyperjax')}"
