"""What the scheduler decides from: a frozen snapshot of one node, and the rules' few settings.

The agent builds a :class:`Snapshot` each round from its records (the jobs), its settings (budget,
quotas) and its readings (``/proc/meminfo``, ``/proc/pressure/memory``, each job's cgroup), and passes
``now``. Nothing here reads any of them; sizes are bytes, times are seconds on the agent's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from torpor.policy.scheduler.sizes import format_size

MiB = 1 << 20
GiB = 1 << 30


class State(StrEnum):
    """Where a job is, as far as memory goes."""

    QUEUED = "queued"  # submitted, never started: holds nothing
    STARTING = "starting"  # being started or resumed: holds its memory already
    RUNNING = "running"  # holds its memory; the only state a victim is taken from
    HIBERNATING = "hibernating"  # being checkpointed away: holds its memory until that is over
    HIBERNATED = "hibernated"  # its image is stored, it holds nothing


class Cause(StrEnum):
    """Why a job is hibernated; all but USER bring it back on their own once there is room."""

    PREEMPTED = "preempted"  # a job of higher priority needed the room
    RECLAIMED = "reclaimed"  # it ran on borrowed quota and the owner took its share back
    GUARD = "guard"  # the node (or its cgroup) was about to run out of memory
    USER = "user"  # someone asked (torpor hibernate): stays until someone resumes it


#: the causes the scheduler resumes by itself
AUTO_RESUME = frozenset({Cause.PREEMPTED, Cause.RECLAIMED, Cause.GUARD})


@dataclass(frozen=True)
class Job:
    """One job as the scheduler sees it."""

    name: str
    state: State
    #: the memory it asked for (``--memory``): what admission and quotas count
    request: int
    priority: int = 0
    project: str = "default"
    #: when it was submitted (its wait in the queue counts from here)
    submitted_at: float = 0.0
    #: its resident memory now (all its processes); for a hibernated job, what it held when it stopped
    usage: int = 0
    #: recorded for ``torpor queue``; not scheduled: memory is what these jobs run out of
    cpus: float = 1.0
    #: seconds it has run since its last checkpoint (what a crash would lose; what a hibernation costs)
    work_since_checkpoint_s: float = 0.0
    last_checkpoint_at: float | None = None
    hibernated_by: Cause | None = None
    hibernated_at: float | None = None
    #: seconds it waited in all before its current wait (queued, or hibernated by the scheduler): its
    #: aging credit, kept while it runs, so that a job bumped again and again does not start from zero
    waited_s: float = 0.0
    #: for a job hibernated to make room for another (``Hibernate.for_job``): that job, until it starts
    #: (the agent clears it then, or when this job resumes): the room stays promised to it meanwhile
    room_for: str | None = None
    #: its cgroup's memory limit and usage, when the machine has a memory controller for it
    limit: int | None = None
    cgroup_usage: int | None = None

    @property
    def charge(self) -> int:
        """What it takes from the budget while it holds memory: its request, or more if it grew past it."""
        return max(self.request, self.usage)

    @property
    def growth(self) -> int:
        """How far it grew past its request (0 within it)."""
        return max(0, self.usage - self.request)


@dataclass(frozen=True)
class Project:
    """A project's guaranteed share of the budget, and how much beyond it it may borrow (None: any)."""

    name: str
    share: int
    borrow_limit: int | None = None


@dataclass(frozen=True)
class Pressure:
    """The node's memory readings; None where the machine does not say (no PSI: the guard uses MemAvailable)."""

    mem_available: int | None = None
    psi_some_avg10: float | None = None
    psi_full_avg10: float | None = None


@dataclass(frozen=True)
class Rules:
    """The few numbers the rules use; defaults fit a node of a few tens of GiB."""

    #: aging: a waiting job's effective priority grows by one level per this many seconds of waiting
    aging_s: float = 600.0
    #: the guard acts when MemAvailable falls below this …
    guard_available: int = 512 * MiB
    #: … or when PSI "full" avg10 (percent of time all tasks stalled on memory) rises above this
    guard_psi_full: float = 10.0
    #: hysteresis: a job the guard hibernated comes back only if MemAvailable stays above this after it
    #: (its usage subtracted) and PSI full avg10 is below ``calm_psi_full``; the guard frees memory until
    #: MemAvailable reaches this
    calm_available: int = 2 * GiB
    calm_psi_full: float = 1.0
    #: a job whose cgroup usage reaches this share of its limit is near it: raise the limit (or hibernate)
    near_limit: float = 0.9
    #: a raise adds this share of the limit (at least ``raise_min``), if the budget has room for it
    raise_share: float = 0.25
    raise_min: int = 64 * MiB

    def problems(self, reserve: int | None = None) -> list[str]:
        """What makes these numbers unusable, one line each (empty: fine); ``reserve``, the memory the
        budget leaves to the machine, when known: the calm level must lie below it, or a full budget
        would read as a node short of memory and nothing would ever start."""
        found = []
        if self.aging_s <= 0:
            found.append("aging must take more than 0 s per priority level")
        if not 0 <= self.guard_available < self.calm_available:
            found.append("the guard's MemAvailable threshold must be at least 0 and below the calm level")
        if not 0 <= self.calm_psi_full <= self.guard_psi_full:
            found.append("PSI full thresholds: the calm one must be at least 0 and at most the guard's")
        if not 0 < self.near_limit <= 1:
            found.append("near a limit means a share of it above 0 and at most 1")
        if self.raise_share <= 0 or self.raise_min < 0:
            found.append("a limit raise must add more than 0")
        if reserve is not None and self.calm_available >= reserve:
            found.append(
                f"the calm MemAvailable level ({format_size(self.calm_available)}) must be below the reserve "
                f"({format_size(reserve)}): a full budget would leave the node never calm"
            )
        return found


@dataclass(frozen=True)
class Snapshot:
    """One node at ``now``: its budget (machine memory less the reserve), jobs, quotas and pressure.

    ``projects`` empty means no quotas: every job is in one pool whose share is the whole budget.
    """

    budget: int
    jobs: tuple[Job, ...]
    now: float
    projects: Mapping[str, Project] = field(default_factory=dict)
    pressure: Pressure = field(default_factory=Pressure)
