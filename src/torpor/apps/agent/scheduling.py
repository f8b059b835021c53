"""The memory-first scheduler at work (issue 15): the agent gathers a snapshot, asks the policy, acts.

Each round (and at once after a submit or the end of one of its actions) :meth:`Scheduling.round` reads
the submissions, jobs and quotas from the records, each running job's memory (its processes' resident
memory and, where it has one, its cgroup's usage and limit) and the node's (MemAvailable, PSI), and passes
that :class:`~torpor.policy.scheduler.Snapshot` to :func:`torpor.policy.scheduler.decide`. What comes
back is carried out by :class:`~torpor.apps.agent.executor.Executor`: hibernations, limit raises, starts
and resumes; the waits' reasons are kept here for ``torpor queue``. The decisions are the policy's alone;
nothing here chooses.

Everything the scheduler needs again after a restart is in the records: the submissions with their marks
(when started, the aging credit, the job a victim makes room for, its memory when hibernated, its
cgroup limit, the last reason), why each job is hibernated (the policies table's ``hibernated_by``:
preempted, reclaimed, guard) and the quotas. A hibernation is marked before it starts, so an agent
killed in the middle finds the job hibernated *by the scheduler* and brings it back; a start is marked
before the job exists, and one that never got its job is queued again (:meth:`Scheduling.adopt`).

Jobs started with ``torpor run`` (not submitted) hold memory too: they count with their resident memory,
at a priority no submitted job preempts; only the guard may hibernate them, as the last resort before the
kernel's OOM killer.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torpor.adapters import cgroups
from torpor.adapters.system import machine, procfs
from torpor.apps.agent.executor import Agent, Executor
from torpor.core.naming import check_name, free_name, name_from_command
from torpor.core.recordtypes import LIVE_STATES, Checkpoint, Job, JobName, JobState, Quota, Submission
from torpor.errors import TorporError, UsageError
from torpor.policy import scheduler
from torpor.policy.scheduler import (
    Cause,
    Hibernate,
    RaiseLimit,
    Resume,
    Rules,
    Snapshot,
    Start,
    State,
    Wait,
    format_size,
    parse_size,
)
from torpor.policy.scheduler.snapshot import AUTO_RESUME

log = logging.getLogger("torpor.agent")

#: the priority a job started with ``torpor run`` is seen with: no submitted job preempts it
UNSUBMITTED_PRIORITY = 1 << 30

#: what the scheduler's hibernations are marked with (the policies table's ``hibernated_by``)
CAUSES = {str(cause): cause for cause in Cause}

#: states of a job as the scheduler sees them
_STATES = {
    JobState.STARTING: State.STARTING,
    JobState.RESTORING: State.STARTING,
    JobState.RUNNING: State.RUNNING,
    JobState.CHECKPOINTING: State.RUNNING,
    JobState.HIBERNATING: State.HIBERNATING,
    JobState.HIBERNATED: State.HIBERNATED,
}


@dataclass(frozen=True)
class SchedulerOptions:
    """``torpor agent --memory-budget/--memory-reserve``: the node's budget, or what it leaves the machine."""

    budget: int | None = None
    reserve: int | None = None
    rules: Rules = field(default_factory=Rules)


@dataclass(frozen=True)
class SubmitRequest:
    """What ``torpor submit`` sends: the command, where and how to run it, and what it asks for."""

    command: list[str]
    cwd: str
    env: dict[str, str]
    umask: int
    #: as the user wrote it (``500M``, ``4G``) or bytes
    memory: str | int
    name: str | None = None
    cpus: float = 1.0
    priority: int = 0
    project: str = "default"


class Scheduling:
    """The scheduler of one agent: submit, queue, quotas, and the round that carries out the decisions."""

    def __init__(
        self,
        agent: Agent,
        options: SchedulerOptions = SchedulerOptions(),
        memory_total: int | None = None,
        controller: cgroups.MemoryController | None = None,
    ) -> None:
        self.agent = agent
        self.records = agent.records
        total = machine.memory_total() if memory_total is None else memory_total
        try:
            self.budget, self.reserve = scheduler.node_budget(total, options.budget, options.reserve)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.rules = options.rules
        problems = self.rules.problems(self.reserve)
        if problems:
            raise UsageError("; ".join(problems))
        self.executor = Executor(agent, controller)
        self._lock = threading.Lock()  # one round at a time: a submit nudges one while another may run
        self._snapshot: Snapshot | None = None

    # -- asked through the API ---------------------------------------------------------------------------

    def submit(self, request: SubmitRequest) -> Submission:
        """Queue a job; refused with every problem on one line (the policy's checks, the name, the command)."""
        self.agent.engine.refuse_if_draining("submit a job")
        quotas = self.projects()
        problems = scheduler.validate_submit(
            request.memory,
            priority=request.priority,
            project=request.project,
            budget=self.budget,
            projects=quotas,
        )
        if request.cpus <= 0:
            problems.append(f"--cpus {request.cpus:g}: a job needs more than 0 CPUs")
        if not request.command:
            problems.append("no command given: torpor submit --memory SIZE -- COMMAND [ARGS...]")
        else:
            search = request.env.get("PATH") if "/" not in request.command[0] else None
            if shutil.which(request.command[0], path=search) is None:
                problems.append(f"command not found: {request.command[0]}")
        if not os.path.isdir(request.cwd):
            problems.append(f"the working directory {request.cwd} does not exist")
        if problems:
            raise UsageError("; ".join(problems))
        memory = request.memory if isinstance(request.memory, int) else parse_size(request.memory)
        names = {job.name for job in self.records.jobs()} | set(self.records.submissions())
        name = request.name or free_name(name_from_command(request.command), names)
        submission = Submission(
            name=check_name(name),
            command=list(request.command),
            cwd=request.cwd,
            env=dict(request.env),
            umask=request.umask,
            memory=memory,
            cpus=request.cpus,
            priority=request.priority,
            project=request.project,
            submitted_at=time.time(),
        )
        self.records.add_submission(submission)
        self.agent.event(
            submission.name,
            "submit",
            f"{format_size(memory)}, priority {request.priority}, project {request.project}",
            request=memory,
        )
        self.agent.nudge()
        return submission

    def cancel(self, name: str) -> bool:
        """Drop a submission that never started (``torpor rm``); False when there is none queued."""
        removed = self.records.delete_submission(name)
        if removed:
            self.agent.event(name, "cancel", "removed from the queue")
        return removed

    def projects(self) -> dict[str, scheduler.Project]:
        return {
            name: scheduler.Project(name, quota.share, quota.borrow_limit)
            for name, quota in self.records.quotas().items()
        }

    def set_quota(self, project: str, share: str | int, borrow_limit: str | int | None) -> Quota:
        problems = []
        sizes: list[int | None] = []
        for flag, value in (("--share", share), ("--borrow-limit", borrow_limit)):
            try:
                sizes.append(
                    None if value is None else value if isinstance(value, int) else parse_size(value)
                )
            except ValueError as exc:
                problems.append(f"{flag}: {exc}")
        if not project or not project.strip():
            problems.append("a project needs a name")
        if problems:
            raise UsageError("; ".join(problems))
        share_bytes, borrow_bytes = sizes
        assert share_bytes is not None
        projects = self.projects()
        projects[project] = scheduler.Project(project, share_bytes, borrow_bytes)
        problems = scheduler.validate_quotas(projects, self.budget)
        if problems:
            raise UsageError("; ".join(problems))
        quota = Quota(project, share_bytes, borrow_bytes)
        self.records.set_quota(quota)
        borrow = "any" if borrow_bytes is None else format_size(borrow_bytes)
        self.agent.event(None, "quota", f"{project}: {format_size(share_bytes)} guaranteed, borrows {borrow}")
        self.agent.nudge()
        return quota

    def remove_quota(self, project: str) -> bool:
        removed = self.records.delete_quota(project)
        if removed:
            self.agent.event(None, "quota", f"{project}: quota removed")
            self.agent.nudge()
        return removed

    def queue(self) -> dict[str, Any]:
        """The queue as ``torpor queue`` shows it: the budget, and every submitted job not ended."""
        snapshot = self._snapshot or self.snapshot(time.time())
        submissions = self.records.submissions()
        rows = []
        for job in snapshot.jobs:
            submission = submissions.get(JobName(job.name))
            if submission is None:
                continue
            rows.append(
                {
                    "name": job.name,
                    "state": str(job.state),
                    "request": job.request,
                    "usage": job.usage,
                    "limit": job.limit,
                    "priority": job.priority,
                    "effective_priority": round(
                        scheduler.effective_priority(job, snapshot.now, self.rules), 3
                    ),
                    "project": job.project,
                    "submitted_at": job.submitted_at,
                    "waited_s": round(_waited(job, snapshot.now), 3),
                    "hibernated_by": None if job.hibernated_by is None else str(job.hibernated_by),
                    "why": submission.why,
                }
            )
        order = {str(State.QUEUED): 0, str(State.HIBERNATED): 1}
        rows.sort(key=lambda row: (order.get(str(row["state"]), 2), -_number(row["effective_priority"])))
        return {**self.memory(snapshot), "psi_full_avg10": snapshot.pressure.psi_full_avg10, "jobs": rows}

    def memory(self, snapshot: Snapshot | None = None) -> dict[str, int | None]:
        """The budget, the reserve, what the jobs hold of the budget and what is free, and MemAvailable."""
        snapshot = snapshot or self._snapshot or self.snapshot(time.time())
        held = sum(job.charge for job in snapshot.jobs if job.state in _HOLDING)
        return {
            "budget": self.budget,
            "reserve": self.reserve,
            "held": held,
            "free": max(0, self.budget - held),
            "mem_available": snapshot.pressure.mem_available,
        }

    def quotas(self) -> dict[str, Any]:
        snapshot = self._snapshot or self.snapshot(time.time())
        held: dict[str, int] = {}
        for job in snapshot.jobs:
            if job.state in _HOLDING and job.priority != UNSUBMITTED_PRIORITY:
                held[job.project] = held.get(job.project, 0) + job.request
        return {
            "budget": self.budget,
            "projects": [
                {
                    "project": quota.project,
                    "share": quota.share,
                    "borrow_limit": quota.borrow_limit,
                    "held": held.get(quota.project, 0),
                    "borrowed": max(0, held.get(quota.project, 0) - quota.share),
                }
                for quota in self.records.quotas().values()
            ],
        }

    # -- the round -----------------------------------------------------------------------------------------

    def adopt(self) -> None:
        """After a restart: a start marked but never carried out (its job never created) is queued again."""
        jobs = {job.name for job in self.records.jobs()}
        for name, submission in self.records.submissions().items():
            if submission.started_at is not None and name not in jobs:
                self.records.update_submission(
                    name, started_at=None, why="queued again: the agent stopped while starting it"
                )

    def snapshot(self, now: float, jobs: list[Job] | None = None) -> Snapshot:
        """The node as the policy sees it at ``now``."""
        submissions = self.records.submissions()
        by_name = {job.name: job for job in (self.records.jobs() if jobs is None else jobs)}
        cares = self.records.cares()
        seen = []
        for name, submission in submissions.items():
            job = by_name.get(name)
            if submission.queued:
                if self.executor.backing_off("start", name, now):
                    continue  # its start failed: not a candidate (holding no room) until its next try
                seen.append(
                    scheduler.Job(
                        name=name,
                        state=State.QUEUED,
                        request=submission.memory,
                        priority=submission.priority,
                        project=submission.project,
                        submitted_at=submission.submitted_at,
                        cpus=submission.cpus,
                        waited_s=submission.waited_s,
                    )
                )
                continue
            if job is None:  # marked started, its job not created yet: it holds its request already
                state: State | None = State.STARTING
            else:
                state = _STATES.get(job.state)
            if state is None:
                continue  # ended
            seen.append(self._seen(name, state, job, submission, cares.get(name), now))
        for job in by_name.values():
            if job.name in submissions or job.state not in LIVE_STATES or job.pid is None:
                continue
            usage = procfs.resident_bytes(procfs.namespace_members(job.pid))
            seen.append(
                scheduler.Job(
                    name=job.name,
                    state=_STATES.get(job.state, State.RUNNING),
                    request=0,
                    priority=UNSUBMITTED_PRIORITY,
                    project="",
                    submitted_at=job.created_at,
                    usage=usage,
                    work_since_checkpoint_s=now - (job.started_at or job.created_at),
                )
            )
        available = cgroups.mem_available()
        pressure = cgroups.memory_pressure()
        snapshot = Snapshot(
            budget=self.budget,
            jobs=tuple(seen),
            now=now,
            projects=self.projects(),
            pressure=scheduler.Pressure(
                mem_available=available,
                psi_some_avg10=None if pressure is None else pressure[0],
                psi_full_avg10=None if pressure is None else pressure[1],
            ),
        )
        self._snapshot = snapshot
        return snapshot

    def _seen(
        self, name: JobName, state: State, job: Job | None, submission: Submission, care: Any, now: float
    ) -> scheduler.Job:
        latest: Checkpoint | None = self.records.latest_checkpoint(name) if job is not None else None
        usage = 0
        limit = cgroup_usage = None
        if state == State.HIBERNATED:
            usage = submission.usage_at_hibernation or 0
            # the limit it had and what its cgroup held: the policy raises the limit it comes back with
            limit, cgroup_usage = submission.mem_limit, submission.cgroup_usage_at_hibernation
        elif job is not None and job.pid is not None and state != State.STARTING:
            usage = procfs.resident_bytes(procfs.namespace_members(job.pid))
        if self.executor.controller is not None and state in (State.RUNNING, State.HIBERNATING):
            try:
                group = self.executor.group(name)
                if group.exists():
                    limit, cgroup_usage = group.limit(), group.usage()
            except TorporError as exc:  # gone meanwhile (the job ended): nothing to read this round
                log.debug("%s: its cgroup: %s", name, exc.message)
        hibernated_by = None
        if state == State.HIBERNATED:
            marked = care.hibernated_by if care is not None else None
            hibernated_by = CAUSES.get(str(marked), Cause.USER) if marked else Cause.USER
            if self.executor.backing_off("resume", name, now):
                hibernated_by = Cause.USER  # its restore failed: not a candidate until its next try
        running_since = (job.started_at or job.created_at) if job is not None else now
        since = max(running_since, latest.created_at) if latest is not None else running_since
        return scheduler.Job(
            name=name,
            state=state,
            request=submission.memory,
            priority=submission.priority,
            project=submission.project,
            submitted_at=submission.submitted_at,
            usage=usage,
            cpus=submission.cpus,
            work_since_checkpoint_s=max(0.0, now - since) if state == State.RUNNING else 0.0,
            last_checkpoint_at=latest.created_at if latest is not None else None,
            hibernated_by=hibernated_by,
            hibernated_at=submission.hibernated_at if state == State.HIBERNATED else None,
            waited_s=submission.waited_s,
            room_for=submission.room_for,
            limit=limit,
            cgroup_usage=cgroup_usage,
        )

    def round(self, now: float, jobs: list[Job] | None = None) -> None:
        """Decide once and carry it out; actions run in the agent's background workers."""
        with self._lock:
            self.executor.expire_prepared(now)
            snapshot = self.snapshot(now, jobs)
            self.executor.tidy(snapshot)
            if not snapshot.jobs:
                return
            actions = scheduler.decide(snapshot, self.rules)
            seen = {job.name: job for job in snapshot.jobs}
            draining = self.agent.draining() is not None
            submissions = self.records.submissions()
            for action in actions:
                if isinstance(action, Hibernate):
                    self.executor.hibernate(action, seen[action.job])
                elif isinstance(action, RaiseLimit):
                    self.executor.raise_limit(action, seen[action.job])
                elif isinstance(action, Start) and not draining:
                    self.executor.start(JobName(action.job), seen[action.job], now)
                elif isinstance(action, Resume) and not draining:
                    self.executor.resume(JobName(action.job), seen[action.job], now)
                elif isinstance(action, Wait):
                    submission = submissions.get(JobName(action.job))
                    if submission is not None and submission.why != action.why:
                        self.records.update_submission(action.job, why=action.why)

    def restored(self, name: str) -> None:
        """``name`` was restored: :meth:`Executor.restored <torpor.apps.agent.executor.Executor.restored>`."""
        self.executor.restored(name)

    def close(self) -> None:
        """The agent stops: prepared launchers exit without starting anything."""
        self.executor.close()


_HOLDING = frozenset({State.STARTING, State.RUNNING, State.HIBERNATING})


def _number(value: object) -> float:
    assert isinstance(value, int | float)
    return float(value)


def _waited(job: scheduler.Job, now: float) -> float:
    """How long ``job`` has waited in all (its credit and its current wait)."""
    if job.state == State.QUEUED:
        return job.waited_s + max(0.0, now - job.submitted_at)
    if job.state == State.HIBERNATED and job.hibernated_at is not None and job.hibernated_by in AUTO_RESUME:
        return job.waited_s + max(0.0, now - job.hibernated_at)
    return job.waited_s
