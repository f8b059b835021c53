"""What the records hold, as values: a job and its states, a checkpoint and its kinds, and the agent's and
the scheduler's entries (a job's care, a submission, a project's quota, an event).

Storing them is :class:`torpor.core.records.Records`' (SQLite); these are what its reads return and its
writes take, and what the rest of torpor passes around.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

from torpor.policy.jobpolicy import JobPolicy
from torpor.policy.warmstart import FileStamp

JobName = NewType("JobName", str)
CheckpointId = NewType("CheckpointId", str)


class JobState(StrEnum):
    """Where a job is in its life; every change is a :meth:`~torpor.core.records.Records.transition` from
    the expected one."""

    STARTING = "starting"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    HIBERNATING = "hibernating"
    HIBERNATED = "hibernated"
    RESTORING = "restoring"
    EXITED = "exited"
    FAILED = "failed"


class CheckpointKind(StrEnum):
    """Why a checkpoint was taken: the job ran on (``checkpoint``) or was stopped by it (``hibernate``)."""

    CHECKPOINT = "checkpoint"
    HIBERNATE = "hibernate"


#: states in which the job has live processes (or is about to)
LIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING, JobState.CHECKPOINTING, JobState.HIBERNATING})
#: states in which a launcher works on the job: it has live processes, or is being restored
SUPERVISED_STATES = LIVE_STATES | {JobState.RESTORING}
#: states from which a job can be restored
RESTORABLE_STATES = frozenset({JobState.HIBERNATED, JobState.EXITED, JobState.FAILED})


@dataclass(frozen=True)
class Job:
    """A job's record: what it runs, where it is in its life, and its processes while it has any."""

    name: JobName
    command: list[str]
    cwd: str
    state: JobState
    pid: int | None
    pid_ticks: int | None
    launcher_pid: int | None
    log_path: str
    created_at: float
    started_at: float | None
    ended_at: float | None
    exit_code: int | None
    message: str | None
    restored_from: CheckpointId | None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's record: its job, kind, timings and size (its image is the store's)."""

    id: CheckpointId
    job: JobName
    kind: CheckpointKind
    created_at: float
    freeze_s: float
    total_s: float
    size_bytes: int
    criu_version: str
    parent: CheckpointId | None
    #: a pre-copied checkpoint's rounds, copied while the job ran: (bytes, seconds) each; () for a
    #: checkpoint that was not pre-copied (its whole memory was dumped while it was frozen)
    rounds: tuple[tuple[int, float], ...] = ()

    @property
    def precopied_bytes(self) -> int:
        """What the rounds copied in all."""
        return sum(copied for copied, _ in self.rounds)


def rounds_from(value: object) -> tuple[tuple[int, float], ...]:
    """:attr:`Checkpoint.rounds` from JSON (lists of two numbers); ValueError for anything else."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ValueError(f"rounds: a list expected, not {type(value).__name__}")
    found = []
    for each in value:
        if not isinstance(each, list | tuple) or len(each) != 2:
            raise ValueError(f"rounds: a [bytes, seconds] pair expected, not {each!r}")
        found.append((int(each[0]), float(each[1])))
    return tuple(found)


@dataclass(frozen=True)
class Care:
    """What the agent keeps for a job: its policy, and why and where from it hibernated the job."""

    policy: JobPolicy
    #: ``idle``, ``evacuation``, ``shutdown``: the agent hibernated the job for that reason (None: it did not)
    hibernated_by: str | None = None
    #: the TCP addresses the job listened on when it was hibernated, ``[host, port]`` each
    listened: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Submission:
    """A job given to the scheduler with ``torpor submit``: what it asked for, and the scheduler's marks.

    It exists before the job does (while it is queued: no jobs row yet) and goes with the job (``rm``).
    """

    name: JobName
    command: list[str]
    cwd: str
    #: the submitter's environment and umask: the agent starts the job in them, not in its own
    env: dict[str, str]
    umask: int
    #: bytes it asked for (``--memory``): what admission and quotas count
    memory: int
    cpus: float
    priority: int
    project: str
    submitted_at: float
    #: when the agent first started it (None: still queued)
    started_at: float | None = None
    #: seconds it waited before its current wait (its aging credit: policy.scheduler.Job.waited_s)
    waited_s: float = 0.0
    #: the job this one was hibernated to make room for, until that one starts
    room_for: str | None = None
    #: when the scheduler hibernated it, and its memory then (what it will need back)
    hibernated_at: float | None = None
    usage_at_hibernation: int | None = None
    #: what its cgroup held then (page cache and kernel memory included): a restore needs that much room
    cgroup_usage_at_hibernation: int | None = None
    #: the memory limit of its cgroup, in bytes (None: none set)
    mem_limit: int | None = None
    #: the scheduler's last word on it: why it waits, or why it was hibernated
    why: str | None = None

    @property
    def queued(self) -> bool:
        return self.started_at is None


#: the fields of a submission the scheduler changes as it goes
#: (:meth:`~torpor.core.records.Records.update_submission`)
SUBMISSION_MARKS = frozenset(
    {
        "started_at",
        "waited_s",
        "room_for",
        "hibernated_at",
        "usage_at_hibernation",
        "cgroup_usage_at_hibernation",
        "mem_limit",
        "why",
    }
)


@dataclass(frozen=True)
class Quota:
    """A project's guaranteed share of the node's memory budget, and how much more it may borrow (None: any)."""

    project: str
    share: int
    borrow_limit: int | None = None


@dataclass(frozen=True)
class Peer:
    """Another machine's agent this one may speak to (``torpor peers add``): its API's base URL, the bearer
    token it takes, and the PEM certificates that its TLS certificate must chain to (None: the system's).

    ``pin``: the SHA-256 fingerprint (``sha256:HEX``) the peer was added by; ``ca`` is then the very
    certificate that has it, and only that certificate (or one it signed) is trusted, whatever host it names.
    """

    name: str
    url: str
    token: str = field(repr=False)
    ca: str | None = field(default=None, repr=False)
    added_at: float = 0.0
    pin: str | None = None


@dataclass(frozen=True)
class Event:
    """Something torpor did by itself (or was asked to, through the agent): what, to whom, why, at what cost."""

    id: int
    at: float
    job: JobName | None
    action: str
    reason: str
    #: the cost and outcome: freeze_s, size_bytes, total_s, freed_bytes, durable_s, error…
    detail: dict[str, object]


@dataclass(frozen=True)
class Template:
    """A checkpoint kept as a start point: any number of new jobs start where its source job was.

    Its image is the store's, under ``checkpoint``; no job owns it (retention and ``rm`` leave it).
    """

    name: str
    checkpoint: CheckpointId
    source_job: JobName
    created_at: float
    size_bytes: int
    freeze_s: float
    criu_version: str
    command: list[str]
    cwd: str
    #: the log its source job wrote to (as its image names it): a job started from it gets its own
    log_path: str
    #: the files its processes had mapped or open read-only, as they were: a start after one changed
    #: would not be the same program (policy.warmstart.stale_reasons)
    files: tuple[FileStamp, ...]
    #: the TCP addresses it listened on, ``(host, port)`` each: a second copy on the same network needs them
    listens: tuple[tuple[str, int], ...]
    #: saved by ``--warm-start`` once ready by this rule (None: by hand)
    ready_when: str | None = None
    #: its job had a network of its own, which its image names as external (core/jobnetworks.py)
    own_network: bool = False

    def as_checkpoint(self, job: JobName) -> Checkpoint:
        """The template's checkpoint as a restore of ``job`` from it names it (it is in no job's list)."""
        return Checkpoint(
            self.checkpoint, job, CheckpointKind.CHECKPOINT, self.created_at, self.freeze_s, 0.0,
            self.size_bytes, self.criu_version, None,
        )  # fmt: skip


@dataclass(frozen=True)
class Origin:
    """Where a job comes from when it is not a plain ``torpor run``: a template, a warm start, a network."""

    job: JobName
    #: the template it was started from (None: it started cold)
    template: str | None = None
    #: ``--warm-start``: the template its starts come from, saved once it is ready by ``ready_when``
    warm: str | None = None
    ready_when: str | None = None
    #: ``--own-network``: its address on torpor's bridge
    address: str | None = None
