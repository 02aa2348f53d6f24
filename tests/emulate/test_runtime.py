import pytest

from hyperjax import EmulationError
from hyperjax.emulate import MAX_DEVICES_PER_PROCESS, Cluster, plan_processes
from hyperjax.emulate.runtime import files_per_device

BIG = 10**9  # an open-file limit that never binds


@pytest.mark.parametrize(("devices", "expected"), [(1, 1), (8, 1), (256, 1), (384, 2), (512, 2), (1000, 4)])
def test_fewest_processes_under_256(devices, expected):
    assert plan_processes(devices, fd_limit=BIG) == expected
    assert devices // plan_processes(devices, fd_limit=BIG) <= MAX_DEVICES_PER_PROCESS


@pytest.mark.parametrize(("devices", "expected"), [(384, 12), (512, 32), (256, 1)])
def test_open_file_limit_adds_processes(devices, expected):
    processes = plan_processes(devices, fd_limit=20000)
    assert processes == expected
    if processes > 1:  # enough processes for the limit, and no fewer would do
        assert devices // processes * files_per_device(devices) < 20000
        fewer = max(p for p in range(1, processes) if devices % p == 0)
        with pytest.raises(EmulationError):
            plan_processes(devices, fewer, fd_limit=20000)


def test_requested_processes():
    assert plan_processes(384, 12, fd_limit=20000) == 12
    assert plan_processes(8, 2) == 2


def test_one_process_above_256_is_refused():
    with pytest.raises(
        EmulationError,
        match=r"384 devices per process \(384 devices over 1 process\) exceeds the 256-device limit .* deadlock.*"
        r"\(--processes 2\)",
    ):
        plan_processes(384, 1, fd_limit=BIG)


def test_too_few_processes_for_open_files():
    with pytest.raises(
        EmulationError, match=r"192 devices per process .* open files .* limit of 20000 .*\(--processes 12\)"
    ):
        plan_processes(384, 2, fd_limit=20000)


def test_uneven_split():
    with pytest.raises(EmulationError, match=r"384 devices cannot be split evenly over 5 processes"):
        plan_processes(384, 5)


@pytest.mark.parametrize(
    ("devices", "processes", "pattern"), [(0, None, "devices=0"), (8, 0, "processes=0"), (-3, None, "devices=-3")]
)
def test_non_positive(devices, processes, pattern):
    with pytest.raises(EmulationError, match=pattern):
        plan_processes(devices, processes)


def test_impossible_file_limit():
    with pytest.raises(EmulationError, match="even one device per process needs"):
        plan_processes(4096, fd_limit=2000)


def test_memory_bound():
    with pytest.raises(EmulationError, match=r"need 4096 emulating processes .* GiB of memory"):
        plan_processes(4096, fd_limit=8000)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, "is not HOST:PORT"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, r"--process-id 2 must be in \[0, 2\)"),
        ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, "--num-processes 0 must be at least 1"),
    ],
)
def test_cluster_validation(kwargs, pattern):
    with pytest.raises(EmulationError, match=pattern):
        Cluster(**kwargs)
