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
    """A selection that can hold a ``large`` or ``multiprocess`` test runs in one process: each of those
    starts a dozen processes or emulates hundreds of devices, and two at once would share the cores and
    memory one already fills. The fast tier, and the slow tier's 8-device runs and sweeps alone
    (``-m "slow and not large and not multiprocess"``), take xdist's count."""
    marks = config.option.markexpr or ""
    if "slow" not in marks or "not slow" in marks:
        return None
    return None if "not large" in marks and "not multiprocess" in marks else 0


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(CACHE, ignore_errors=True)
