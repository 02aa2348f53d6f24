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
    """One process for a ``-m`` selection that names ``slow``, ``large`` or ``multiprocess`` (``-m slow``,
    ``-m "slow and (large or multiprocess)"``): those tests start a dozen processes or emulate hundreds of
    devices each, and two at once would share the cores and memory one already fills. xdist's count for the
    rest: the fast tier (``not slow``), and a selection that excludes both ``large`` and ``multiprocess``
    (``-m "slow and not large and not multiprocess"``: the slow tier's 8-device runs and sweeps), which CI runs
    with ``--dist worksteal`` so that one long file does not hold a worker after the other is done: on two
    cores its 176 tests took 16.3 minutes so, against about 19 in one process (the whole slow tier's 25.8 minutes
    in one process, less its 384-device and several-process part's 6.7)."""
    marks = config.option.markexpr or ""
    if "not slow" in marks or ("not large" in marks and "not multiprocess" in marks):
        return None
    return 0 if any(m in marks for m in SLOW_MARKERS) else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(CACHE, ignore_errors=True)
