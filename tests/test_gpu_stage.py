"""The CUDA stage of a checkpoint (torpor.adapters.gpu.CudaStage) against a stand-in for NVIDIA's driver.

The processes are real: each holds a file open under a folder that stands for ``/dev/nvidia``, and the
stage finds them through /proc as it finds GPU users. Only the driver is a stand-in (``FakeDriver``, at
the seam of torpor.adapters.cuda.Driver): no machine these tests run on has an NVIDIA GPU. It keeps the
order of the calls and the state the driver's API defines for each process."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.adapters import cuda, gpu
from torpor.errors import CheckpointFailed, UsageError
from torpor.settings import Settings


class FakeDriver:
    """The checkpoint API's states and transitions; ``fail`` makes one call fail for one process."""

    def __init__(self, pids: list[int], fail: tuple[str, int] | None = None) -> None:
        self.states = dict.fromkeys(pids, "running")
        self.calls: list[tuple[str, int]] = []
        self.fail = fail
        self.together = threading.Barrier(len(pids), timeout=5)  # checkpoints wait for each other
        self._lock = threading.Lock()

    def lock(self, pid: int, timeout_ms: int) -> None:
        assert timeout_ms > 0
        self._step("lock", pid, "running", "locked")

    def checkpoint(self, pid: int) -> None:
        self.together.wait()  # every checkpoint runs at the same time, or this times out
        self._step("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid: int) -> None:
        self._step("restore", pid, "checkpointed", "locked")

    def unlock(self, pid: int) -> None:
        self._step("unlock", pid, "locked", "running")

    def state(self, pid: int) -> str | None:
        return self.states.get(pid)

    def _step(self, call: str, pid: int, before: str, after: str) -> None:
        with self._lock:
            self.calls.append((call, pid))
            if self.states.get(pid) != before:
                raise cuda.CudaError(f"{call} of process {pid}: CUDA_ERROR_ILLEGAL_STATE")
            if self.fail == (call, pid):
                raise cuda.CudaError(f"the CUDA driver could not {call} process {pid}: CUDA_ERROR_UNKNOWN")
            self.states[pid] = after


@pytest.fixture
def gpu_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Three processes holding a file under the stand-in for /dev/nvidia, and one that holds none."""
    devices = tmp_path / "nvidia"
    devices.mkdir()
    monkeypatch.setattr(gpu, "NVIDIA_DEVICE_PREFIX", str(devices))
    processes = []
    for n in range(3):
        (devices / str(n)).touch()
        with open(devices / str(n)) as held:
            processes.append(subprocess.Popen(["sleep", "60"], stdin=held))
    processes.append(subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL))
    yield [p.pid for p in processes]
    for each in processes:
        each.kill()
        each.wait()


def _stage(driver: FakeDriver) -> gpu.CudaStage:
    return gpu.CudaStage(lambda: driver)


def test_every_gpu_process_is_locked_then_all_are_checkpointed_at_once_and_given_back_after(
    gpu_users: list[int],
) -> None:
    users = gpu_users[:3]
    driver = FakeDriver(users)
    stage = _stage(driver)
    stage.before_dump(gpu_users)
    assert driver.calls[:3] == [("lock", pid) for pid in users]
    assert sorted(driver.calls[3:]) == sorted(("checkpoint", pid) for pid in users)
    assert driver.states == dict.fromkeys(users, "checkpointed")  # the process without a GPU: untouched
    driver.calls.clear()
    stage.after_dump(gpu_users, leave_running=True)
    assert sorted(driver.calls[:3]) == sorted(("restore", pid) for pid in users)
    assert driver.calls[3:] == [("unlock", pid) for pid in users]
    assert driver.states == dict.fromkeys(users, "running")


def test_a_lock_that_fails_unlocks_those_taken_and_checkpoints_nothing(gpu_users: list[int]) -> None:
    users = gpu_users[:3]
    driver = FakeDriver(users, fail=("lock", users[1]))
    stage = _stage(driver)
    with pytest.raises(CheckpointFailed) as caught:
        stage.before_dump(gpu_users)
    assert f"could not lock process {users[1]}" in caught.value.message
    assert "the job runs on, its GPU untouched" in caught.value.details
    assert driver.calls == [("lock", users[0]), ("lock", users[1]), ("unlock", users[0])]
    assert driver.states == dict.fromkeys(users, "running")
    stage.after_dump(gpu_users, leave_running=True)  # the dump's finally: nothing is left to give back
    assert len(driver.calls) == 3


def test_a_checkpoint_that_fails_gives_the_others_their_state_back_and_unlocks_all(
    gpu_users: list[int],
) -> None:
    users = gpu_users[:3]
    driver = FakeDriver(users, fail=("checkpoint", users[2]))
    with pytest.raises(CheckpointFailed, match=f"could not checkpoint process {users[2]}"):
        _stage(driver).before_dump(gpu_users)
    assert sorted(call for call in driver.calls if call[0] == "restore") == [
        ("restore", p) for p in users[:2]
    ]
    assert driver.states == dict.fromkeys(users, "running")


def test_a_hibernated_job_is_not_given_its_gpu_back(gpu_users: list[int]) -> None:
    driver = FakeDriver(gpu_users[:3])
    stage = _stage(driver)
    stage.before_dump(gpu_users)
    calls = len(driver.calls)
    stage.after_dump(gpu_users, leave_running=False)
    assert len(driver.calls) == calls


def test_a_restored_tree_gets_the_state_of_its_checkpointed_processes_back(
    gpu_users: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    users = gpu_users[:3]
    driver = FakeDriver(users)
    driver.states[users[0]] = "running"  # restored, but CUDA state of its own: left alone
    driver.states.update(dict.fromkeys(users[1:], "checkpointed"))
    monkeypatch.setattr(gpu, "driver_version", lambda: "570.86.15")
    _stage(driver).after_restore(gpu_users)
    assert sorted(driver.calls) == sorted(
        [*(("restore", p) for p in users[1:]), *(("unlock", p) for p in users[1:])]
    )
    assert driver.states == dict.fromkeys(users, "running")


def test_a_job_without_a_gpu_never_loads_the_driver(
    gpu_users: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_driver() -> cuda.Driver:
        raise AssertionError("the driver was loaded")

    stage = gpu.CudaStage(no_driver)
    stage.before_dump(gpu_users[3:])
    stage.after_dump(gpu_users[3:], leave_running=True)
    monkeypatch.setattr(gpu, "driver_version", lambda: None)
    stage.after_restore(gpu_users)


def test_by_default_a_gpu_job_is_refused_naming_the_setting(gpu_users: list[int]) -> None:
    with pytest.raises(CheckpointFailed, match="TORPOR_GPU=unverified"):
        gpu.stage("").before_dump(gpu_users)
    assert isinstance(gpu.stage("unverified"), gpu.CudaStage)


def test_the_setting_takes_only_what_it_knows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORPOR_GPU", "yes")
    with pytest.raises(UsageError, match="TORPOR_GPU='yes' must be empty"):
        Settings.from_environment(home=str(tmp_path))
    monkeypatch.setenv("TORPOR_GPU", "Unverified")
    assert Settings.from_environment(home=str(tmp_path)).gpu == "unverified"


def test_without_libcuda_loading_the_driver_says_so_in_one_line() -> None:
    try:
        cuda.load()
    except cuda.CudaError as exc:
        assert "\n" not in exc.message
        assert "cannot be loaded" in exc.message or "r570" in exc.message or "did not start" in exc.message
    else:
        pytest.skip("this machine has a CUDA driver with the checkpoint API")
