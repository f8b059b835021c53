"""What the scheduler tells the agent to do. There is no action that kills: the worst is Hibernate.

The agent executes a decision's actions in their order (hibernations first, then limit raises, then
starts and resumes — a Resume may be followed by a RaiseLimit of the same job: restore it with that
limit) and shows each :class:`Wait`'s ``why`` in ``torpor queue``. A start never depends on a
hibernation of the same round: memory that is still being freed is only promised (the job waits).
"""

from __future__ import annotations

from dataclasses import dataclass

from torpor.policy.scheduler.snapshot import Cause


@dataclass(frozen=True)
class Start:
    """Start a queued job: its request fits the budget and its project's quota."""

    job: str


@dataclass(frozen=True)
class Resume:
    """Restore a job hibernated by the scheduler (preempted, reclaimed, guard): there is room again."""

    job: str


@dataclass(frozen=True)
class Hibernate:
    """Checkpoint a running job and stop it; ``for_job`` is the job it makes room for (None: the guard)."""

    job: str
    cause: Cause
    reason: str
    for_job: str | None = None


@dataclass(frozen=True)
class RaiseLimit:
    """Raise a job's cgroup memory limit to ``limit`` bytes: it nears the old one and the node has room."""

    job: str
    limit: int


@dataclass(frozen=True)
class Wait:
    """A queued or hibernated job stays where it is, and why (one line, for ``torpor queue``)."""

    job: str
    why: str


Action = Start | Resume | Hibernate | RaiseLimit | Wait
