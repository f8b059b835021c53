"""The agent's watch over this machine's GPUs: read each through NVML, move the jobs off one that fails.

A hook of the agent's rounds (:attr:`torpor.apps.agent.service.Agent.round_hooks`). Every ``every_s`` it
reads every GPU (:meth:`torpor.adapters.nvml.Nvml.read`: temperature and slowdown threshold, XID
events, uncorrectable ECC errors, fallen off the bus) and keeps the last minutes of readings;
:func:`torpor.policy.gpuhealth.judge` says whether a GPU fails. When one starts to, an event says why,
and each running job that holds that GPU is hibernated (its image then goes to the durable tier, as
every image does), once per failure. A GPU that recovers gets an event too.

The agent's ``/metrics`` carries the latest readings (:meth:`GpuWatch.families`). A machine where NVML
cannot be opened (no NVIDIA driver: every machine this project's tests run on) is not watched, and its
``/metrics`` has no GPU readings. Only NVML is a stand-in in the tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from torpor.adapters import gpu, nvml
from torpor.adapters.system import procfs
from torpor.apps.agent.wire import checkpoint_costs
from torpor.core.recordtypes import Care, Checkpoint, Job, JobName, JobState
from torpor.errors import CudaError
from torpor.policy import gpuhealth

log = logging.getLogger("torpor.agent")

#: why the agent hibernated a job (its care's ``hibernated_by``)
BY_GPU = "gpu"
#: seconds between two readings of the GPUs
EVERY_S = 5.0


class Acting(Protocol):
    """What the watch asks of the agent (:class:`torpor.apps.agent.service.Agent`)."""

    def submit(
        self, name: JobName, action: str, reason: str, work: Callable[[JobName], dict[str, Any]]
    ) -> Any: ...
    def hibernate(self, name: JobName, by: str) -> Checkpoint: ...
    def event(self, job: str | None, action: str, reason: str, **detail: object) -> None: ...


class GpuWatch:
    """Reads the GPUs every ``every_s`` and hibernates the jobs of a failing one (``nvml`` opens NVML)."""

    def __init__(
        self,
        agent: Acting,
        nvml_loader: Callable[[], nvml.Nvml] = nvml.load,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._agent = agent
        self._load = nvml_loader
        self._reader: nvml.Nvml | None = None
        self._minors: dict[str, int] = {}
        self._off = False
        self._every_s = every_s
        self._clock = clock
        self._read_at = float("-inf")
        self._history: dict[str, list[gpuhealth.Reading]] = {}
        self._verdicts: dict[str, gpuhealth.Verdict] = {}
        #: the jobs hibernated (or tried) for the failure of each GPU: each once per failure
        self._moved: dict[str, set[JobName]] = {}

    def __call__(self, jobs: list[Job], cares: dict[JobName, Care]) -> None:
        now = self._clock()
        if self._off or now - self._read_at < self._every_s:
            return
        self._read_at = now
        reader = self._open()
        if reader is None:
            return
        try:
            readings = reader.read()
        except CudaError as exc:
            log.warning("cannot read the GPUs: %s", exc.message)
            return
        for health in readings:
            kept = self._history.setdefault(health.uuid, [])
            kept.append(gpuhealth.Reading(**asdict(health)))
            kept[:] = gpuhealth.trim(kept, now)
            self._judge(health.uuid, gpuhealth.judge(kept, now), jobs)

    def latest(self) -> list[gpuhealth.Reading]:
        """The newest reading of each GPU."""
        return [kept[-1] for kept in self._history.values() if kept]

    def families(self) -> Iterator[Metric]:
        """The latest readings as metric families (a prometheus_client collector's ``collect``)."""
        temperature = GaugeMetricFamily(
            "torpor_gpu_temperature_celsius", "Each GPU's temperature, as NVML last read it.", labels=["gpu"]
        )
        slowdown = GaugeMetricFamily(
            "torpor_gpu_slowdown_celsius", "The temperature at which each GPU slows down.", labels=["gpu"]
        )
        ecc = GaugeMetricFamily(
            "torpor_gpu_ecc_uncorrected",
            "Uncorrectable ECC errors of each GPU since its driver loaded (NVML's volatile count).",
            labels=["gpu"],
        )
        failing = GaugeMetricFamily(
            "torpor_gpu_failing",
            "1 while the agent judges the GPU failing and moves its jobs off it (policy.gpuhealth).",
            labels=["gpu"],
        )
        for reading in self.latest():
            if reading.temperature_c is not None:
                temperature.add_metric([reading.uuid], reading.temperature_c)
            if reading.slowdown_c is not None:
                slowdown.add_metric([reading.uuid], reading.slowdown_c)
            if reading.ecc_uncorrected is not None:
                ecc.add_metric([reading.uuid], reading.ecc_uncorrected)
            verdict = self._verdicts.get(reading.uuid)
            failing.add_metric([reading.uuid], 1.0 if verdict is not None and verdict.evacuate else 0.0)
        yield from (temperature, slowdown, ecc, failing)

    def collect(self) -> Iterator[Metric]:
        return self.families()

    def _open(self) -> nvml.Nvml | None:
        if self._reader is None:
            try:
                self._reader = self._load()
                self._minors = {device.uuid: device.minor for device in self._reader.gpus()}
            except CudaError as exc:
                self._off = True
                if gpu.driver_version() is not None:
                    log.warning("the GPUs are not watched: %s", exc.message)
                return None
        return self._reader

    def _judge(self, uuid: str, verdict: gpuhealth.Verdict, jobs: list[Job]) -> None:
        before = self._verdicts.get(uuid)
        self._verdicts[uuid] = verdict
        reading = self._history[uuid][-1]
        detail = {k: v for k, v in asdict(reading).items() if v not in (None, ())}
        if verdict.evacuate and not (before and before.evacuate):
            self._agent.event(None, "gpu", f"GPU {uuid} is failing: {verdict.reason}", **detail)
        elif before and before.evacuate and not verdict.evacuate:
            self._agent.event(None, "gpu", f"GPU {uuid} is healthy again", **detail)
            self._moved.pop(uuid, None)
        elif verdict.watching and not (before and before.watching):
            self._agent.event(None, "gpu", f"GPU {uuid}: {verdict.watching}, watched", **detail)
        if verdict.evacuate:
            self._move_off(uuid, verdict.reason or "failing", jobs)

    def _move_off(self, uuid: str, reason: str, jobs: list[Job]) -> None:
        minor = self._minors.get(uuid)
        moved = self._moved.setdefault(uuid, set())
        for job in jobs:
            if job.state != JobState.RUNNING or job.pid is None or job.name in moved or minor is None:
                continue
            if minor not in gpu.gpu_minors(procfs.namespace_members(job.pid)):
                continue
            why = f"GPU {uuid} is failing: {reason}"
            if self._agent.submit(job.name, "hibernate", why, self._hibernate) is not None:
                moved.add(job.name)  # a job busy with another action is tried again the next reading

    def _hibernate(self, name: JobName) -> dict[str, Any]:
        return checkpoint_costs(self._agent.hibernate(name, BY_GPU))
