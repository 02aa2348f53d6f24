"""Test session set-up: 8 emulated CPU devices, fixed before anything starts the JAX backend; one compilation
cache for the session; the slow tier.

Many tests compile the same program (a one-device reference run, the quick start behind several command-line
tests, a checkpoint's writer and its reader). JAX's persistent compilation cache, in a folder of this session's
own, compiles each once: the tests' processes and the processes they start (whose environment carries the
folder) read it; each of pytest-xdist's workers keeps a folder of its own. The folder starts empty, so a test's
result never depends on an earlier session.
"""

import os
import shutil
import tempfile

import jax
import pytest

CACHE = tempfile.mkdtemp(prefix="hyperjax-test-cache-")
for name, value in {
    "JAX_COMPILATION_CACHE_DIR": CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}.items():
    os.environ[name] = value
    jax.config.update(name.lower(), int(value) if value == "0" else value)

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

SLOW_MARKERS = ("slow", "large", "multiprocess")
"""A test with any of these markers is in the slow tier: ``pytest -q -m slow`` runs it, ``pytest -q`` does not."""


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in SLOW_MARKERS[1:]) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """The slow tier in one process: its tests start a dozen processes or emulate hundreds of devices each,
    and two at once would share the cores and memory they already fill. The fast tier: xdist's count."""
    marks = config.option.markexpr or ""
    return 0 if "slow" in marks and "not slow" not in marks else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(CACHE, ignore_errors=True)
