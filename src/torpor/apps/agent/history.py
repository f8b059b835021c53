"""Each job's memory over the last hour, for the page's charts: samples the agent takes in its rounds.

Nothing else keeps a job's memory over time. The records hold states, checkpoints and events, and
``/metrics`` gives Prometheus the present value to keep. So the agent keeps a short history in its own
memory: one sample every :data:`SAMPLE_EVERY_S` of each job, at most :data:`WINDOW_S` of them, a bounded
ring per job. An agent started again starts with empty charts (the checkpoints on them come from the
records, and are there at once).

A job's memory is read as the page's Memory column reads it (the PSS of its processes, counted once);
a hibernated job holds none, so its line drops to zero while it sleeps. One sample each few seconds,
not each round: the scheduler reads the same memory every round already, and a large job's read walks
its page tables.

What it leaves to others: drawing (:mod:`torpor.apps.agent.charts`), when to sample (the agent's round).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torpor.adapters.system import procfs
from torpor.core.recordtypes import LIVE_STATES, Job, JobState

#: how far back the charts look, in seconds
WINDOW_S = 3600.0
#: seconds between two samples of a job's memory (at most one a round: a longer round samples less often)
SAMPLE_EVERY_S = 5.0


@dataclass(frozen=True)
class Sample:
    """A job's memory (bytes) at ``at``."""

    at: float
    bytes: int


class MemoryHistory:
    """The last :data:`WINDOW_S` of samples of each job; the rounds' thread writes, the page's reads."""

    def __init__(self, window_s: float = WINDOW_S, every_s: float = SAMPLE_EVERY_S) -> None:
        self.window_s = window_s
        self.every_s = every_s
        self._rings: dict[str, deque[Sample]] = {}
        self._last_at: float | None = None
        self._lock = threading.Lock()

    def due(self, now: float) -> bool:
        """Whether a round at ``now`` should sample (the last sample is ``every_s`` old, or none yet)."""
        return self._last_at is None or now - self._last_at >= self.every_s or now < self._last_at

    def record(self, now: float, memory: Mapping[str, int]) -> None:
        """One sample of each job in ``memory``; rings with nothing left in the window are dropped."""
        size = math.ceil(self.window_s / self.every_s) + 1
        with self._lock:
            self._last_at = now
            for name, value in memory.items():
                self._rings.setdefault(name, deque(maxlen=size)).append(Sample(now, int(value)))
            for name in list(self._rings):
                ring = self._rings[name]
                while ring and ring[0].at < now - self.window_s:
                    ring.popleft()
                if not ring:
                    del self._rings[name]

    def sample(self, now: float, jobs: Iterable[Job]) -> None:
        """Sample the memory of ``jobs`` (a round's) if one is due: the live ones' PSS, a hibernated one's 0."""
        if not self.due(now):
            return
        self.record(now, job_memory(jobs))

    def samples(self) -> dict[str, list[Sample]]:
        """Each job's samples, oldest first (a copy)."""
        with self._lock:
            return {name: list(ring) for name, ring in self._rings.items()}


def job_memory(jobs: Iterable[Job]) -> dict[str, int]:
    """What each job holds now: a live job's processes' PSS, a hibernated job's nothing; others are left out."""
    memory: dict[str, int] = {}
    for job in jobs:
        if job.state == JobState.HIBERNATED:
            memory[job.name] = 0
        elif job.state in LIVE_STATES and job.pid is not None:
            memory[job.name] = procfs.resident_bytes(procfs.namespace_members(job.pid))
    return memory
