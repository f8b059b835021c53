"""The GPU part of checkpoints and restores against stand-ins for NVIDIA's driver and NVML: the CUDA stage
(torpor.adapters.gpu.CudaStage) and what is refused, kept and remapped around it (torpor.core.gpujobs).

The processes are real: each holds a file open in a folder that stands for ``/dev`` (``nvidia0``…), and
the stage finds them through /proc as it finds GPU users. Only the driver and NVML are stand-ins
(``FakeDriver`` at the seam of torpor.adapters.cuda.Driver, ``FakeNvml`` at torpor.adapters.nvml.Nvml):
no machine these tests run on has an NVIDIA GPU. The driver's stand-in keeps the order of the calls and
the state the driver's API defines for each process."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from conftest import gpu_holders
from torpor.adapters import cuda, gpu, nvml
from torpor.core.gpujobs import GPUS_FILE, GpuJobs
from torpor.errors import CheckpointFailed, RestoreFailed, UsageError
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

    def restore(self, pid: int, pairs: Sequence[tuple[str, str]] = ()) -> None:
        self.pairs = tuple(pairs)
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
    """Three processes holding /dev/nvidia0, 1 and 2 (stand-ins in a folder of the test's), and one that
    holds none."""
    monkeypatch.setattr(gpu, "NVIDIA_DEVICE_PREFIX", str(tmp_path / "dev" / "nvidia"))
    with gpu_holders(tmp_path / "dev", 3) as pids:
        yield pids


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


def test_a_restored_tree_gets_the_state_of_its_checkpointed_processes_back(gpu_users: list[int]) -> None:
    users = gpu_users[:3]
    driver = FakeDriver(users)
    driver.states[users[0]] = "running"  # restored, but CUDA state of its own: left alone
    driver.states.update(dict.fromkeys(users[1:], "checkpointed"))
    pairs = (("GPU-" + "1" * 32, "GPU-" + "2" * 32),)
    _stage(driver).after_restore(gpu_users, pairs)
    assert sorted(driver.calls) == sorted(
        [*(("restore", p) for p in users[1:]), *(("unlock", p) for p in users[1:])]
    )
    assert driver.pairs == pairs  # the map reaches the driver
    assert driver.states == dict.fromkeys(users, "running")


def test_a_job_without_a_gpu_never_loads_the_driver(gpu_users: list[int]) -> None:
    def no_driver() -> cuda.Driver:
        raise AssertionError("the driver was loaded")

    stage = gpu.CudaStage(no_driver)
    stage.before_dump(gpu_users[3:])
    stage.after_dump(gpu_users[3:], leave_running=True)


def test_the_gpus_a_process_uses_are_the_minors_of_the_device_files_it_holds(gpu_users: list[int]) -> None:
    assert gpu.gpu_minors(gpu_users[:2]) == {0, 1}
    assert gpu.gpu_minors(gpu_users[3:]) == set()


def test_a_gpu_uuid_becomes_the_drivers_sixteen_bytes() -> None:
    assert (
        cuda.uuid_bytes("GPU-6f3b1c2a-0d4e-5f60-7182-93a4b5c6d7e8").hex()
        == "6f3b1c2a0d4e5f60718293a4b5c6d7e8"
    )
    with pytest.raises(ValueError, match="not a GPU UUID"):
        cuda.uuid_bytes("6f3b1c2a")


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


# -- what is refused, what the image keeps, where a restore goes (torpor.core.gpujobs) ------------------


def device(minor: int, name: str = "NVIDIA H200", mig: bool = False) -> nvml.Device:
    return nvml.Device(f"GPU-{minor:08x}-0000-0000-0000-000000000000", name, 143_771_090_944, minor, mig)


class FakeNvml:
    """NVML's answers (:class:`torpor.adapters.nvml.Nvml`): a driver version and the GPUs."""

    def __init__(self, gpus: list[nvml.Device], version: str = "575.51.03") -> None:
        self.devices = gpus
        self.version = version

    def driver_version(self) -> str:
        return self.version

    def gpus(self) -> list[nvml.Device]:
        return self.devices

    def read(self) -> list[nvml.Health]:
        return []


def _jobs(driver: FakeDriver, reader: FakeNvml, mps: bool = False, choice: str = "unverified") -> GpuJobs:
    return GpuJobs(choice, _stage(driver), lambda: reader, lambda: mps)


def test_by_default_a_gpu_job_is_refused_naming_the_setting(gpu_users: list[int], tmp_path: Path) -> None:
    driver = FakeDriver(gpu_users[:3])
    with pytest.raises(CheckpointFailed, match="TORPOR_GPU=unverified"):
        _jobs(driver, FakeNvml([]), choice="").before_dump(gpu_users)
    assert driver.calls == []
    _jobs(driver, FakeNvml([]), choice="").before_dump(gpu_users[3:])  # a CPU job passes


@pytest.mark.parametrize(
    ("reader", "mps", "refusal"),
    [
        (FakeNvml([device(0), device(1), device(2)], "550.54.14"), False, "needs r570"),
        (FakeNvml([device(0), device(1, mig=True), device(2)]), False, "MIG"),
        (FakeNvml([device(0), device(1), device(2)]), True, "MPS"),
    ],
)
def test_an_old_driver_a_mig_gpu_or_mps_is_refused_before_anything_is_locked(
    gpu_users: list[int], tmp_path: Path, reader: FakeNvml, mps: bool, refusal: str
) -> None:
    driver = FakeDriver(gpu_users[:3])
    with pytest.raises(CheckpointFailed, match=refusal) as caught:
        _jobs(driver, reader, mps).before_dump(gpu_users)
    assert "the job runs on, its GPU untouched" in caught.value.details
    assert driver.calls == []
    assert not (tmp_path / GPUS_FILE).exists()


def test_the_image_keeps_the_gpus_the_job_used_and_only_those(gpu_users: list[int], tmp_path: Path) -> None:
    driver = FakeDriver(gpu_users[:3])
    reader = FakeNvml([device(n) for n in range(4)] + [device(5, mig=True)])  # 3 and 5: not the job's
    jobs = _jobs(driver, reader)
    said = jobs.before_dump(gpu_users)
    assert said is not None and said.startswith("GPU stage: 3 CUDA process(es) locked and checkpointed in ")
    assert driver.states == dict.fromkeys(gpu_users[:3], "checkpointed")
    assert not (
        tmp_path / GPUS_FILE
    ).exists()  # written once the dump went through: a retry empties the folder
    jobs.after_dump(gpu_users, True, tmp_path)
    noted = json.loads((tmp_path / GPUS_FILE).read_text())
    assert noted["driver"] == "575.51.03"
    assert [each["uuid"] for each in noted["gpus"]] == [device(n).uuid for n in range(3)]
    assert driver.states == dict.fromkeys(gpu_users[:3], "running")


def test_a_failed_dump_gives_the_gpu_back_and_notes_nothing(gpu_users: list[int], tmp_path: Path) -> None:
    driver = FakeDriver(gpu_users[:3])
    jobs = _jobs(driver, FakeNvml([device(n) for n in range(3)]))
    jobs.before_dump(gpu_users)
    jobs.after_dump(gpu_users, True, None)
    assert driver.states == dict.fromkeys(gpu_users[:3], "running")
    assert not (tmp_path / GPUS_FILE).exists()


def test_a_restore_goes_onto_the_same_gpus_or_others_of_their_type_and_is_refused_elsewhere(
    gpu_users: list[int], tmp_path: Path
) -> None:
    driver = FakeDriver(gpu_users[:3])
    hibernated = _jobs(driver, FakeNvml([device(n) for n in range(3)]))
    hibernated.before_dump(gpu_users)
    hibernated.after_dump(gpu_users, False, tmp_path)
    assert _jobs(driver, FakeNvml([device(n) for n in range(4)])).before_restore(tmp_path) == ()
    moved = _jobs(driver, FakeNvml([device(n) for n in (0, 1, 7)])).before_restore(tmp_path)
    assert moved is not None and dict(moved)[device(2).uuid] == device(7).uuid
    with pytest.raises(
        RestoreFailed, match=r"cannot restore this GPU job here: .*3 × NVIDIA H200.*2 × NVIDIA H200"
    ):
        _jobs(driver, FakeNvml([device(0), device(1)])).before_restore(tmp_path)
    with pytest.raises(RestoreFailed, match="NVIDIA H100"):
        _jobs(driver, FakeNvml([device(n, "NVIDIA H100") for n in range(3)])).before_restore(tmp_path)
    with pytest.raises(RestoreFailed, match="needs TORPOR_GPU=unverified"):
        _jobs(driver, FakeNvml([]), choice="").before_restore(tmp_path)

    def no_nvml() -> nvml.Nvml:
        raise cuda.CudaError("NVML did not start: Driver Not Loaded")

    with pytest.raises(RestoreFailed, match="holds GPU state, but NVML did not start"):
        GpuJobs("unverified", _stage(driver), no_nvml).before_restore(tmp_path)
    (tmp_path / GPUS_FILE).write_text('{"gpus": [{"uuid": "GPU-1", "name": "x", "memory_bytes": 1}]}')
    with pytest.raises(RestoreFailed, match="not a GPU UUID"):
        _jobs(driver, FakeNvml([])).before_restore(tmp_path)
    (tmp_path / GPUS_FILE).write_text("{")
    with pytest.raises(RestoreFailed, match="cannot be read"):
        _jobs(driver, FakeNvml([])).before_restore(tmp_path)


def test_an_image_without_gpu_state_neither_opens_nvml_nor_touches_the_driver(
    gpu_users: list[int], tmp_path: Path
) -> None:
    def no_nvml() -> nvml.Nvml:
        raise AssertionError("NVML was opened")

    def no_driver() -> cuda.Driver:
        raise AssertionError("the driver was loaded")

    jobs = GpuJobs("unverified", gpu.CudaStage(no_driver), no_nvml)
    pairs = jobs.before_restore(tmp_path)
    assert pairs is None
    jobs.after_restore(gpu_users, pairs)
    assert jobs.before_dump(gpu_users[3:]) is None


def test_doctor_lists_the_gpus_nvml_reports_or_says_why_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    from torpor.core import doctor

    monkeypatch.setattr(nvml, "load", lambda: FakeNvml([device(0), device(1, mig=True)]))
    gpus, error = doctor._gpus("575.51.03")
    assert error is None
    assert [(g["minor"], g["name"], g["mig"]) for g in gpus] == [
        (0, "NVIDIA H200", False),
        (1, "NVIDIA H200", True),
    ]
    assert doctor._gpus(None) == ([], None)  # no driver: NVML is not opened

    def no_nvml() -> nvml.Nvml:
        raise cuda.CudaError("NVML did not start: Driver Not Loaded")

    monkeypatch.setattr(nvml, "load", no_nvml)
    assert doctor._gpus("575.51.03") == ([], "NVML did not start: Driver Not Loaded")
