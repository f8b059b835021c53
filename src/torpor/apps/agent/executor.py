"""The scheduler's decisions carried out (issue 15): hibernations, limit raises, starts and resumes.

:class:`~torpor.apps.agent.scheduling.Scheduling` gathers the snapshot and asks the policy each round;
each action that comes back is carried out here, in the agent's background workers, and marked in the
records first where an agent killed mid-way must find it (a hibernation marked before it starts, a
start before its job exists). Also what the actions share: the launchers prepared ahead for the job that
victims make room for, the back-off of failed starts and resumes, and each job's memory cgroup (made,
raised, removed when its job is gone).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from torpor.adapters import cgroups
from torpor.core.engine import Engine
from torpor.core.records import Records
from torpor.core.recordtypes import Checkpoint, JobName, JobState, Submission
from torpor.core.starting import PreparedRun
from torpor.errors import TorporError
from torpor.policy import retry, scheduler
from torpor.policy.jobpolicy import format_duration
from torpor.policy.scheduler import Hibernate, RaiseLimit, Snapshot, State, format_size


class Agent(Protocol):
    """What the scheduler uses of the agent (:class:`torpor.apps.agent.service.Agent`)."""

    records: Records
    engine: Engine

    def event(self, job: str | None, action: str, reason: str, **detail: object) -> None: ...
    def nudge(self) -> None: ...
    def is_busy(self, name: JobName) -> bool: ...
    def draining(self) -> dict[str, Any] | None: ...
    def hibernate(self, name: JobName, by: str, listened: tuple[tuple[str, int], ...] = ()) -> Checkpoint: ...
    def submit(
        self, name: JobName, action: str, reason: str, work: Callable[[JobName], dict[str, Any]]
    ) -> Future[None] | None: ...


log = logging.getLogger("torpor.agent")

#: room a restore gets beyond what the job's cgroup held when it was dumped (CRIU's restorer needs some)
RESTORE_MARGIN = 16 << 20

#: seconds a launcher prepared for a job waits for its room before it is called off
PREPARED_FOR_S = 120.0


class Executor:
    """Carries out the scheduler's actions for one agent, and keeps what they share between rounds."""

    def __init__(self, agent: Agent, controller: cgroups.MemoryController | None = None) -> None:
        self.agent = agent
        self.records = agent.records
        self.controller = controller
        #: launchers started ahead for the jobs that victims make room for (:meth:`_prepare`), and when
        self._prepared: dict[JobName, tuple[PreparedRun, float]] = {}
        self._preparing = threading.Lock()
        #: jobs whose start or restore failed: how many times in a row, and when last (a new agent tries
        #: at once)
        self._failures: dict[tuple[str, str], tuple[int, float]] = {}

    def hibernate(self, action: Hibernate, seen: scheduler.Job) -> None:
        name = JobName(action.job)
        if self.agent.is_busy(name):
            return

        def work(name: JobName) -> dict[str, Any]:
            if self.records.job(name).state != JobState.RUNNING:
                return {"skipped": "it was no longer running (it ended, or someone acted on it first)"}
            submission = self.records.submission(name)
            # marked first: an agent killed mid-way finds the job hibernated by the scheduler, and resumes it
            self.records.mark_hibernated(name, str(action.cause))
            try:
                stopped = self._unstall(name)
                held = self._cgroup_usage(name)
                checkpoint = self.agent.hibernate(name, str(action.cause))
            except BaseException:
                if self.records.job(name).state != JobState.HIBERNATED:
                    self.records.mark_hibernated(name, None)
                raise
            if stopped:  # whoever restores it, embedded or through an agent, continues it
                self.records.mark_stopped_dump(name, checkpoint.id)
            if submission is not None:
                self.records.update_submission(
                    name,
                    hibernated_at=time.time(),
                    usage_at_hibernation=seen.usage,
                    cgroup_usage_at_hibernation=held,
                    room_for=action.for_job,
                    why=action.reason,
                )
            return {
                "checkpoint": checkpoint.id,
                "freeze_s": checkpoint.freeze_s,
                "total_s": checkpoint.total_s,
                "size_bytes": checkpoint.size_bytes,
                "freed_bytes": seen.usage,
                "cause": str(action.cause),
                "for_job": action.for_job,
            }

        self.agent.submit(name, "hibernate", action.reason, self._nudging(work))
        if action.for_job is not None:
            self._prepare(JobName(action.for_job), time.time())

    def _unstall(self, name: JobName) -> bool:
        """A job stalled at its cgroup limit cannot be dumped (CRIU cannot seize a task asleep in the
        cgroup's OOM wait), nor one that reaches it while CRIU works: stop it (SIGSTOP) and give it room
        for CRIU's parasite first. It is dumped stopped, and continued by its restore
        (``Records.mark_stopped_dump``); a failed dump continues it at once (as every failed checkpoint
        does).
        Whether it was stopped."""
        if self.controller is None:
            return False
        group = self.group(name)
        if not group.exists() or group.limit() is None:
            return False
        # stopped whatever its usage now: a job allocates faster than the dump begins (a step of 50 MiB
        # takes it from well below its limit to it), and then CRIU's seize or its parasite stalls there
        if not group.unstall_for_dump():
            log.warning("%s: still stalled at its cgroup limit after stopping it; its dump may fail", name)
        return True

    def raise_limit(self, action: RaiseLimit, seen: scheduler.Job) -> None:
        self.records.update_submission(action.job, mem_limit=action.limit)
        if seen.state != State.RUNNING or self.controller is None:
            return  # a hibernated job gets it when it is restored
        group = self.group(action.job)
        if not group.exists():
            return
        old = group.limit()
        try:
            group.set_limit(action.limit)
        except OSError as exc:
            self.agent.event(
                action.job, "limit", f"raising the limit to {format_size(action.limit)}", error=str(exc)
            )
            return
        before = "none" if old is None else format_size(old)
        self.agent.event(
            action.job,
            "limit",
            f"raised from {before} to {format_size(action.limit)}: its usage neared the limit",
            limit=action.limit,
            usage=seen.cgroup_usage,
        )

    def _group_for(self, name: str, limit: int) -> Path | None:
        """The job's cgroup with ``limit``, made if missing (None where the machine has no memory controller)."""
        if self.controller is None:
            return None
        group = self.group(name)
        group.create(limit)
        return group.path

    def start(self, name: JobName, seen: scheduler.Job, now: float) -> None:
        submission = self.records.submission(name)
        if submission is None or not submission.queued or self.agent.is_busy(name):
            return
        waited = submission.waited_s + max(0.0, now - submission.submitted_at)
        # marked before the job exists: the next round counts its memory as held already
        self.records.update_submission(name, started_at=now, waited_s=waited, why=None)

        def work(name: JobName) -> dict[str, Any]:
            limit = submission.mem_limit or submission.memory
            try:
                prepared = self._take_prepared(name) or self._prepare_run(name, submission)
                job = prepared.go()
                cgroup = self._group_path(name)
            except TorporError as exc:
                if self.records.submission(name) is not None and name not in {
                    j.name for j in self.records.jobs()
                }:
                    # not even a failed job on record: it waits again, with the reason, and a while
                    wait = self._failed("start", name)
                    self.records.update_submission(
                        name,
                        started_at=None,
                        why=f"could not start ({exc.message}); tried again in {format_duration(wait)}",
                    )
                raise
            finally:
                self._promised_to(name)
            self.records.update_submission(name, mem_limit=limit if cgroup is not None else None)
            return {"pid": job.pid, "waited_s": waited, "request": submission.memory}

        self.agent.submit(name, "start", f"{format_size(submission.memory)} fits", self._nudging(work))

    def _prepare_run(self, name: JobName, submission: Submission) -> PreparedRun:
        cgroup = self._group_for(name, submission.mem_limit or submission.memory)
        return self.agent.engine.prepare_run(
            name,
            submission.command,
            submission.cwd,
            env=submission.env,
            umask=submission.umask,
            cgroup=cgroup,
        )

    def group(self, name: str) -> cgroups.JobCgroup:
        assert self.controller is not None
        return self.controller.job(_folder(name))

    def _group_path(self, name: str) -> Path | None:
        if self.controller is None:
            return None
        group = self.group(name)
        return group.path if group.exists() else None

    def _prepare(self, name: JobName, now: float) -> None:
        """Have the launcher of the job that victims make room for start up while they are hibernated
        (a new interpreter takes ~0.3 s): it starts the moment the room is there."""
        with self._preparing:
            if name in self._prepared or self.agent.is_busy(name):
                return
        submission = self.records.submission(name)
        if submission is None or not submission.queued:
            return
        try:
            prepared = self._prepare_run(name, submission)
        except TorporError as exc:
            log.warning("%s: cannot prepare its start: %s", name, exc.message)
            return
        with self._preparing:
            self._prepared[name] = (prepared, now)

    def _queued(self, name: str) -> bool:
        submission = self.records.submission(name)
        return submission is not None and submission.queued

    def _take_prepared(self, name: JobName) -> PreparedRun | None:
        with self._preparing:
            entry = self._prepared.pop(name, None)
        return None if entry is None else entry[0]

    def expire_prepared(self, now: float) -> None:
        """Call off prepared starts that did not happen in time (the room never came, or it was cancelled)."""
        with self._preparing:
            stale = [
                name
                for name, (_, at) in self._prepared.items()
                if now - at > PREPARED_FOR_S or not self._queued(name)
            ]
            entries = [self._prepared.pop(name)[0] for name in stale]
        for prepared in entries:
            prepared.cancel()

    def close(self) -> None:
        """The agent stops: prepared launchers exit without starting anything."""
        with self._preparing:
            entries = [prepared for prepared, _ in self._prepared.values()]
            self._prepared.clear()
        for prepared in entries:
            prepared.cancel()

    def _promised_to(self, name: str) -> None:
        """``name`` started (or gave up): the victims that made room for it may come back."""
        for other, submission in self.records.submissions().items():
            if submission.room_for == name:
                self.records.update_submission(other, room_for=None)

    def resume(self, name: JobName, seen: scheduler.Job, now: float) -> None:
        submission = self.records.submission(name)
        if submission is None or self.agent.is_busy(name):
            return

        def work(name: JobName) -> dict[str, Any]:
            current = self.records.submission(name) or submission
            # what its cgroup held, and some room for the restore: a limit below fails it
            held = (current.cgroup_usage_at_hibernation or current.usage_at_hibernation or 0) + RESTORE_MARGIN
            limit = max(current.mem_limit or current.memory, held)
            try:
                self._group_for(name, limit)  # CRIU puts the tree back into the cgroup it was dumped from
                job, checkpoint, seconds = self.agent.engine.restore(
                    name, warn=lambda t: log.warning("%s: %s", name, t)
                )
            except TorporError as exc:
                wait = self._failed("resume", name)
                self.records.update_submission(
                    name, why=f"its restore failed ({exc.message}); tried again in {format_duration(wait)}"
                )
                raise
            self._failures.pop(("resume", name), None)
            self.restored(name)
            if self.controller is not None:
                self.records.update_submission(name, mem_limit=limit)
            return {"checkpoint": checkpoint.id, "restore_s": seconds, "pid": job.pid}

        self.agent.submit(name, "resume", f"room again for {format_size(seen.charge)}", self._nudging(work))

    def restored(self, name: str) -> None:
        """``name`` was restored (by the scheduler, or by someone through the agent): end what the
        scheduler kept of its hibernation. (A job dumped stopped, :meth:`_unstall`, was continued by the
        restore itself: ``Records.mark_stopped_dump``.)"""
        self.records.mark_hibernated(JobName(name), None)
        submission = self.records.submission(name)
        if submission is None or submission.hibernated_at is None:
            return
        self.records.update_submission(
            name,
            hibernated_at=None,
            usage_at_hibernation=None,
            cgroup_usage_at_hibernation=None,
            room_for=None,
            waited_s=submission.waited_s + max(0.0, time.time() - submission.hibernated_at),
            why=None,
        )

    def _failed(self, what: str, name: str) -> float:
        """Count a failed start or resume of ``name``; the seconds until it is tried again (policy.retry)."""
        with self._preparing:
            failures = self._failures.get((what, name), (0, 0.0))[0] + 1
            self._failures[(what, name)] = (failures, time.time())
        return retry.after_failed_resume(failures)

    def backing_off(self, what: str, name: str, now: float) -> bool:
        """Whether ``name``'s last starts or resumes (``what``) failed and its next try is not due yet."""
        failures, at = self._failures.get((what, name), (0, 0.0))
        return failures > 0 and now < at + retry.after_failed_resume(failures)

    def _cgroup_usage(self, name: str) -> int | None:
        if self.controller is None:
            return None
        group = self.group(name)
        return group.usage() if group.exists() else None

    def _nudging(self, work: Any) -> Any:
        """``work``, followed by a round at once: what it freed or took changes what fits."""

        def then_nudge(name: JobName) -> dict[str, Any]:
            try:
                result: dict[str, Any] = work(name)
                return result
            finally:
                self.agent.nudge()

        return then_nudge

    def tidy(self, snapshot: Snapshot) -> None:
        """Remove the cgroups of jobs that ended or were removed (those that hold no process any more)."""
        if self.controller is None:
            return
        known = {_folder(job.name) for job in snapshot.jobs}
        for folder in self.controller.job_names():
            if folder in known:
                continue
            group = self.controller.job(folder)
            if group.pids():
                continue
            try:
                group.remove()
            except TorporError as exc:
                log.warning("%s: %s", folder, exc.message)


def _folder(name: str) -> str:
    """The cgroup folder of job ``name``: the name itself, or for one beyond ASCII (job names may hold any
    letter), a digest of it."""
    if name.isascii():
        return name
    return "u-" + hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
