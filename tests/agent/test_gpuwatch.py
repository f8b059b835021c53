"""The agent's watch over the GPUs (torpor.apps.agent.gpuwatch) against a stand-in for NVML.

NVML is the stand-in (no machine these tests run on has an NVIDIA GPU); the jobs' processes are real and
hold ``nvidia0`` or ``nvidia1`` in a folder of the test's that stands for ``/dev``, so the watch finds
which jobs use the failing GPU as it would on a GPU machine. The agent is a recorder of what the watch
asks of it; the agent's own rounds, with a real state directory, run the watch in tests/agent/test_agent.py
only as far as this machine goes: no NVML, no watch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from conftest import gpu_holders
from torpor.adapters import cuda, gpu, nvml
from torpor.apps.agent import gpuwatch
from torpor.apps.agent.gpuwatch import BY_GPU, GpuWatch
from torpor.core.recordtypes import Checkpoint, CheckpointId, CheckpointKind, Job, JobName, JobState

UUIDS = ["GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"]


class Readings:
    """NVML's stand-in: two GPUs, whose next readings a test sets."""

    def __init__(self) -> None:
        self.next: dict[str, nvml.Health] = {}
        self.at = 0.0

    def driver_version(self) -> str:
        return "575.51.03"

    def gpus(self) -> list[nvml.Device]:
        return [nvml.Device(uuid, "NVIDIA H200", 2**37, minor) for minor, uuid in enumerate(UUIDS)]

    def read(self) -> list[nvml.Health]:
        return [
            self.next.get(uuid, nvml.Health(uuid, self.at, 50.0, 90.0, ecc_uncorrected=0)) for uuid in UUIDS
        ]


class Recorder:
    """The agent, as far as the watch uses it: what it was asked to do."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []
        self.hibernated: list[tuple[str, str]] = []
        self.busy: set[str] = set()

    def submit(
        self, name: JobName, action: str, reason: str, work: Callable[[JobName], dict[str, Any]]
    ) -> Any:
        if name in self.busy:
            return None
        assert action == "hibernate"
        work(name)
        return object()

    def hibernate(self, name: JobName, by: str) -> Checkpoint:
        self.hibernated.append((name, by))
        return Checkpoint(CheckpointId("c1"), name, CheckpointKind.HIBERNATE, 0.0, 0.1, 0.2, 10, "4.1", None)

    def event(self, job: str | None, action: str, reason: str, **detail: object) -> None:
        self.events.append((reason, detail))


def job(name: str, pid: int) -> Job:
    return Job(
        JobName(name), ["sleep"], "/", JobState.RUNNING, pid, None, None, "", 0.0, 0.0, None, None, None, None
    )


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Job]]:
    """A job on GPU 0, a job on GPU 1, a job on none."""
    monkeypatch.setattr(gpu, "NVIDIA_DEVICE_PREFIX", str(tmp_path / "dev" / "nvidia"))
    # a job's processes are those of its own PID namespace; these share the test's, so each is one
    monkeypatch.setattr(gpuwatch.procfs, "namespace_members", lambda pid: [pid])
    with gpu_holders(tmp_path / "dev", 2) as pids:
        yield [job(name, pid) for name, pid in zip(("on-0", "on-1", "cpu"), pids, strict=True)]


def _watch(readings: Readings, agent: Recorder, clock: list[float]) -> GpuWatch:
    return GpuWatch(agent, lambda: readings, every_s=5.0, clock=lambda: clock[0])


def test_a_gpu_off_the_bus_has_its_jobs_hibernated_once_and_the_others_run_on(jobs: list[Job]) -> None:
    readings, agent, clock = Readings(), Recorder(), [100.0]
    watch = _watch(readings, agent, clock)
    watch(jobs, {})
    assert agent.hibernated == [] and agent.events == []
    clock[0] = 103.0
    readings.next[UUIDS[1]] = nvml.Health(UUIDS[1], 103.0, lost=True)
    watch(jobs, {})  # within every_s of the last reading: not read again
    assert agent.hibernated == []
    clock[0] = 105.0
    watch(jobs, {})
    assert agent.hibernated == [("on-1", BY_GPU)]
    assert agent.events[0][0] == f"GPU {UUIDS[1]} is failing: the GPU has fallen off the bus"
    assert agent.events[0][1]["lost"] is True
    clock[0] = 110.0
    watch(jobs, {})
    assert agent.hibernated == [("on-1", BY_GPU)]  # once per failure
    assert len(agent.events) == 1


def test_a_job_busy_with_another_action_is_moved_at_the_next_reading(jobs: list[Job]) -> None:
    readings, agent, clock = Readings(), Recorder(), [0.0]
    watch = _watch(readings, agent, clock)
    readings.next[UUIDS[0]] = nvml.Health(UUIDS[0], 0.0, 50.0, 90.0, xids=(79,))
    agent.busy.add("on-0")
    watch(jobs, {})
    assert agent.hibernated == []
    agent.busy.clear()
    clock[0] = 5.0
    watch(jobs, {})  # the XID is still among the readings kept
    assert agent.hibernated == [("on-0", BY_GPU)]


def test_a_passing_hot_spike_is_watched_then_healthy_and_metrics_carry_the_readings(jobs: list[Job]) -> None:
    readings, agent, clock = Readings(), Recorder(), [0.0]
    watch = _watch(readings, agent, clock)
    readings.next[UUIDS[0]] = nvml.Health(UUIDS[0], 0.0, 93.0, 90.0, ecc_uncorrected=0)
    watch(jobs, {})
    assert agent.events[0][0].startswith(f"GPU {UUIDS[0]}: hot for 0 s of 60 s (93 °C")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(watch)
    text = generate_latest(registry).decode()
    assert f'torpor_gpu_temperature_celsius{{gpu="{UUIDS[0]}"}} 93.0' in text
    assert f'torpor_gpu_slowdown_celsius{{gpu="{UUIDS[1]}"}} 90.0' in text
    assert f'torpor_gpu_failing{{gpu="{UUIDS[0]}"}} 0.0' in text
    for at in range(5, 70, 5):  # it stays hot: after 60 s its job is moved
        clock[0] = float(at)
        readings.next[UUIDS[0]] = nvml.Health(UUIDS[0], float(at), 93.0, 90.0, ecc_uncorrected=0)
        watch(jobs, {})
    assert agent.hibernated == [("on-0", BY_GPU)]
    assert f'torpor_gpu_failing{{gpu="{UUIDS[0]}"}} 1.0' in generate_latest(registry).decode()
    clock[0] = 70.0
    del readings.next[UUIDS[0]]
    watch(jobs, {})
    assert agent.events[-1][0] == f"GPU {UUIDS[0]} is healthy again"


def test_a_machine_without_nvml_is_not_watched_and_not_asked_again(jobs: list[Job]) -> None:
    opened = []

    def no_nvml() -> nvml.Nvml:
        opened.append(1)
        raise cuda.CudaError("NVML did not start: NVML Shared Library Not Found")

    agent, clock = Recorder(), [0.0]
    watch = GpuWatch(agent, no_nvml, every_s=5.0, clock=lambda: clock[0])
    for at in (0.0, 5.0, 10.0):
        clock[0] = at
        watch(jobs, {})
    assert opened == [1] and agent.events == [] and watch.latest() == []


def test_on_this_machine_nvml_opens_or_says_why_in_one_line() -> None:
    try:
        nvml.load()
    except cuda.CudaError as exc:
        assert "\n" not in exc.message and ("NVML did not start" in exc.message or "pynvml" in exc.message)
    else:
        pytest.skip("this machine has an NVIDIA driver")
