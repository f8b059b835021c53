"""The agent's work: rounds that apply each job's policy, evacuations, and what it found when it started.

Everything it knows is in the records (jobs, checkpoints, policies, why it hibernated a job, the events,
whether the node is draining), so an agent killed with -9 and started again loses nothing: it reads them
and goes on. The jobs themselves never depend on it: each runs under its own launcher, which finishes a
checkpoint it was asked for even if the agent that asked is gone (a job is never left frozen).

The decisions are :mod:`torpor.policy`'s (:mod:`~torpor.policy.periodic`, :mod:`~torpor.policy.idle`,
:mod:`~torpor.policy.evacuation`); this module samples what they need and carries out what they say.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from torpor.adapters.system import procfs, sockets
from torpor.apps.agent import abroad
from torpor.apps.agent.gpuwatch import GpuWatch
from torpor.apps.agent.history import SAMPLE_EVERY_S, MemoryHistory
from torpor.apps.agent.node import memory_controller, take_lock
from torpor.apps.agent.scheduling import SchedulerOptions, Scheduling
from torpor.apps.agent.wire import checkpoint_costs
from torpor.core.engine import Engine
from torpor.core.moves import Moves
from torpor.core.recordtypes import Care, Checkpoint, Job, JobName, JobState
from torpor.core.store import DURABLE
from torpor.errors import TorporError, UsageError
from torpor.policy import evacuation, idle, periodic
from torpor.policy.jobpolicy import JobPolicy, format_duration
from torpor.policy.notices import Notice
from torpor.settings import Settings

log = logging.getLogger("torpor.agent")

#: who set the node draining, in the ``draining`` node flag: a person (``torpor drain``), a notice of the
#: cloud provider, or the agent's own shutdown (SIGTERM)
BY_DRAIN, BY_NOTICE, BY_SHUTDOWN = "drain", "notice", "shutdown"


@dataclass(frozen=True)
class AgentOptions:
    """How the agent runs (``torpor agent --help`` gives each its flag)."""

    #: seconds between two rounds (sampling CPU, deciding checkpoints and idle hibernations)
    round_s: float = 1.0
    #: how many jobs an evacuation checkpoints at once
    parallel: int = 4
    #: seconds an evacuation at the agent's own SIGTERM may take (systemd's TimeoutStopSec must be longer)
    stop_deadline_s: float = 90.0
    #: seconds a ``torpor drain`` evacuation may take
    drain_deadline_s: float = 600.0
    #: what SIGTERM does: ``hibernate`` every job (resumed at the next start), ``leave`` them running, or
    #: ``auto``: hibernate when the machine shuts down (systemd says so, or no systemd runs it), leave them
    #: when only the agent is stopped or restarted (``systemctl restart``)
    on_sigterm: str = "auto"
    #: where to poll for a spot or maintenance notice (None: nowhere), in which format, how often
    notice_url: str | None = None
    notice_format: str = "auto"
    notice_interval_s: float = 5.0
    #: whether a notice's evacuation moves jobs to peers that have room first (``--evacuate-to-peers``)
    evacuate_to_peers: bool = False
    #: the scheduler's budget, reserve and rules (``--memory-budget``, ``--memory-reserve``)
    scheduling: SchedulerOptions = field(default_factory=SchedulerOptions)


@dataclass
class EvacuationReport:
    """What an evacuation saved, what it could not in time, and what failed (with why)."""

    why: str
    by: str
    started_at: float
    deadline_at: float
    order: list[str] = field(default_factory=list)
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    #: an evacuation to peers: the jobs that were to move and why each did not (hibernated here instead)
    stayed: dict[str, str] = field(default_factory=dict)
    finished_at: float | None = None
    summary: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "why": self.why,
            "by": self.by,
            "started_at": self.started_at,
            "deadline_at": self.deadline_at,
            "finished_at": self.finished_at,
            "order": self.order,
            "saved": self.saved,
            "failed": self.failed,
            "pending": self.pending,
            "stayed": dict(self.stayed),  # moves still under way may add to it
            "summary": self.summary,
        }


class Agent:
    """One node's agent, on one state directory (a second one on the same directory is refused)."""

    def __init__(self, settings: Settings, options: AgentOptions = AgentOptions()) -> None:
        self.settings = settings
        self.options = options
        self.engine = Engine(settings)
        self.records = self.engine.records
        self._lock_fd = take_lock(settings.home / "agent.lock")
        self.started_at = time.time()
        self.stopping = threading.Event()
        self._guard = threading.Lock()
        self._busy: dict[JobName, str] = {}
        self._samples: dict[tuple[JobName, int | None], list[idle.Sample]] = {}
        self._actions = ThreadPoolExecutor(max_workers=2, thread_name_prefix="torpor-agent-action")
        self._evacuating = threading.Lock()
        #: jobs an evacuation of this agent tried and could not save: not tried again each round
        self._evacuation_tried: set[JobName] = set()
        #: when the agent last tried to checkpoint each job (a failed try waits an interval, as a success)
        self._tried_at: dict[JobName, float] = {}
        self.last_evacuation: EvacuationReport | None = None
        #: called each round with the jobs as read (the wake-on-connect keeper hooks in here)
        self.round_hooks: list[Callable[[list[Job], dict[JobName, Care]], None]] = []
        self.round_hooks.append(abroad.CutOffMoves(self.engine, self.event))
        #: reads the GPUs (through NVML, where there is a driver) and hibernates the jobs of a failing one
        self.gpu_watch = GpuWatch(self)
        self.round_hooks.append(self.gpu_watch)
        #: called with a job's name before anyone restores it through the agent (the keeper lets go of
        #: the ports it holds for it: the restored job's listening sockets need them)
        self.before_restore: list[Callable[[JobName], None]] = []
        #: set to have the next round now (a submit, or the end of an action that freed or took memory)
        self._nudged = threading.Event()
        self.controller = memory_controller(settings.home)
        self.scheduling = Scheduling(self, options.scheduling, controller=self.controller)
        #: each job's memory over the last hour, for the page's charts (in memory only)
        self.history = MemoryHistory(every_s=max(SAMPLE_EVERY_S, options.round_s))
        #: rounds done since the agent started (GET /v1/health): what "nothing happened for N rounds" counts
        self.rounds = 0

    # -- starting and stopping -------------------------------------------------------------------------

    def adopt(self) -> None:
        """Take over what already runs or waits: say so, resume what the last shutdown hibernated."""
        self.scheduling.adopt()
        jobs = [self.engine.reconcile(job) for job in self.records.jobs()]
        counts: dict[str, int] = {}
        for job in jobs:
            counts[str(job.state)] = counts.get(str(job.state), 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
        self.event(None, "adopt", f"agent started (pid {os.getpid()}): {summary}")
        draining = self.draining()
        if draining is None or draining["by"] == BY_DRAIN:
            return  # a person's drain lasts until 'torpor drain --cancel'
        if draining["by"] == BY_NOTICE and draining.get("boot") == procfs.boot_id():
            return  # the notice's machine has not gone down yet: go on saving (the next round)
        # the node went down as announced and is back (or only the agent was stopped): it takes jobs again
        self.records.set_node_flag("draining", None)
        self.event(None, "undrain", f"back after the {draining['by']} ({draining['why']})")
        if not draining.get("resume_at_boot"):
            return  # e.g. a spot termination: its jobs are someone else's to resume, here or elsewhere
        for job in jobs:
            care = self.records.care(job.name)
            if job.state == JobState.HIBERNATED and care.hibernated_by == draining["by"]:
                self.submit(job.name, "resume", f"hibernated at the {draining['by']}: back", self._resume)

    def close(self, finish: bool = False) -> None:
        """Stop acting: the action under way ends first; with ``finish``, those queued too (else dropped)."""
        if not finish:
            self.stopping.set()
            self._nudged.set()
        self._actions.shutdown(wait=True, cancel_futures=not finish)
        self.stopping.set()
        self.scheduling.close()
        os.close(self._lock_fd)

    # -- the round -------------------------------------------------------------------------------------

    def loop(self) -> None:
        """Rounds until :attr:`stopping`; an error in one is logged and the next round goes on."""
        while not self.stopping.is_set():
            self._nudged.wait(self.options.round_s)
            self._nudged.clear()
            if self.stopping.is_set():
                break
            try:
                self.round(time.time())
            except Exception:
                log.exception("a round of the agent failed; the next one goes on")

    def nudge(self) -> None:
        """Have the next round at once rather than at its time."""
        self._nudged.set()

    def round(self, now: float) -> None:
        jobs = [self.engine.reconcile(job) for job in self.records.jobs()]
        cares = self.records.cares()
        seen = set()
        for job in jobs:
            care = cares.get(job.name)
            if job.state != JobState.RUNNING or care is None or job.pid is None:
                continue
            seen.add((job.name, job.pid))
            if self.is_busy(job.name):
                continue
            self._care_for_running(job, care.policy, now)
        for key in set(self._samples) - seen:
            del self._samples[key]  # ended, hibernated or restored: a restored job starts watching anew
        self.history.sample(now, jobs)
        for hook in self.round_hooks:
            hook(jobs, cares)
        self.scheduling.round(now, jobs)
        self.rounds += 1
        draining = self.draining()
        left = [j for j in jobs if j.state == JobState.RUNNING and j.name not in self._evacuation_tried]
        if draining and left and not self._evacuating.locked():
            # an agent killed mid-evacuation, or a job that became running since: the node is draining
            threading.Thread(
                target=self.evacuate, args=(draining["why"], draining["by"]), daemon=True
            ).start()

    def _care_for_running(self, job: Job, policy: JobPolicy, now: float) -> None:
        assert job.pid is not None
        if policy.idle_after_s is not None:
            pids = procfs.namespace_members(job.pid)
            samples = self._samples.setdefault((job.name, job.pid), [])
            samples.append(idle.Sample(now, procfs.cpu_seconds(pids)))
            samples[:] = idle.trim(samples, policy.idle_after_s, now)
            if idle.is_idle(samples, policy.idle_after_s, now):
                reason = f"idle: no CPU used for {format_duration(policy.idle_after_s)}"
                samples.clear()  # a hibernation that fails is tried again after a whole window, not at once
                self.submit(job.name, "hibernate", reason, self._hibernate_idle)
                return
        if policy.checkpoint_every_s is not None:
            checkpoints = self.records.checkpoints(job.name)
            freezes = [c.freeze_s for c in checkpoints]
            latest = checkpoints[-1] if checkpoints else None
            running_since = job.started_at or job.created_at
            tried = [t for t in (latest.created_at if latest else None, self._tried_at.get(job.name)) if t]
            due = periodic.next_due(
                policy.checkpoint_every_s, policy.budget, freezes, max(tried, default=None), running_since
            )
            if now >= due:
                self._tried_at[job.name] = now
                interval = periodic.interval(policy.checkpoint_every_s, policy.budget, freezes)
                stretched = (
                    f" (stretched to {format_duration(round(interval))} for the {policy.budget:.0%} budget)"
                    if interval > policy.checkpoint_every_s
                    else ""
                )
                reason = f"every {format_duration(policy.checkpoint_every_s)}{stretched}"
                self.submit(job.name, "checkpoint", reason, self._checkpoint)

    # -- actions ---------------------------------------------------------------------------------------

    def is_busy(self, name: JobName) -> bool:
        with self._guard:
            return name in self._busy

    @contextlib.contextmanager
    def acting(self, name: JobName, action: str) -> Iterator[None]:
        """``name`` is busy with ``action`` in this thread for the block: no action of the rounds starts."""
        with self._guard:
            mine = name not in self._busy
            self._busy.setdefault(name, action)
        try:
            yield
        finally:
            if mine:
                with self._guard:
                    self._busy.pop(name, None)

    def submit(
        self, name: JobName, action: str, reason: str, work: Callable[[JobName], dict[str, Any]]
    ) -> Future[None] | None:
        """Run ``work(name)`` in the background unless the agent already works on ``name``; record it."""
        with self._guard:
            if name in self._busy or self.stopping.is_set():
                return None
            self._busy[name] = action
        return self._actions.submit(self._act, name, action, reason, work)

    def act_now(
        self, name: JobName, action: str, reason: str, work: Callable[[JobName], dict[str, Any]]
    ) -> bool:
        """Run ``work(name)`` in this thread unless the agent already works on ``name`` (then False)."""
        with self._guard:
            if name in self._busy or self.stopping.is_set():
                return False
            self._busy[name] = action
        self._act(name, action, reason, work)
        return True

    def _act(
        self, name: JobName, action: str, reason: str, work: Callable[[JobName], dict[str, Any]]
    ) -> None:
        try:
            detail = work(name)
            self.event(name, action, reason, **detail)
        except TorporError as exc:
            self.event(name, action, reason, error=exc.message)
        except Exception as exc:  # an agent that stops acting on one error would be worse
            log.exception("%s of %s failed", action, name)
            self.event(name, action, reason, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._guard:
                self._busy.pop(name, None)

    def _checkpoint(self, name: JobName) -> dict[str, Any]:
        checkpoint = self.engine.checkpoint(name, warn=lambda text: log.warning("%s: %s", name, text))
        self._watch_durable(checkpoint)
        job = self.records.job(name)
        running_s = time.time() - (job.started_at or job.created_at)
        freezes = [
            c.freeze_s for c in self.records.checkpoints(name) if c.created_at >= (job.started_at or 0)
        ]
        return {**checkpoint_costs(checkpoint), "overhead": periodic.overhead(freezes, running_s)}

    def _watch_durable(self, checkpoint: Checkpoint) -> None:
        """Record when ``checkpoint`` is durable (a ``durable`` event with its time from the dump), aside."""

        def watch() -> None:
            try:
                image = self.engine.wait_durable(checkpoint.id)
            except TorporError as exc:
                self.event(checkpoint.job, "durable", f"checkpoint {checkpoint.id}", error=exc.message)
                return
            took = time.time() - checkpoint.created_at
            self.event(
                checkpoint.job,
                "durable",
                f"checkpoint {checkpoint.id}",
                checkpoint=checkpoint.id,
                durable_s=took,
                stored_bytes=image.stored_bytes,
            )

        threading.Thread(target=watch, name="torpor-agent-durable", daemon=True).start()

    def hibernate(self, name: JobName, by: str, listened: tuple[tuple[str, int], ...] = ()) -> Checkpoint:
        """Hibernate ``name`` and note why (``by``), so that the agent knows what to bring back when."""
        checkpoint = self.engine.checkpoint(
            name, hibernate=True, warn=lambda text: log.warning("%s: %s", name, text)
        )
        self.records.mark_hibernated(name, by, listened)
        return checkpoint

    def _hibernate_idle(self, name: JobName) -> dict[str, Any]:
        job = self.records.job(name)
        policy = self.records.care(name).policy
        pids = procfs.namespace_members(job.pid) if job.pid else []
        freed = procfs.resident_bytes(pids)
        listened = wake_addresses(pids, policy.wake_on)
        checkpoint = self.hibernate(name, "idle", listened)
        self._watch_durable(checkpoint)
        return {**checkpoint_costs(checkpoint), "freed_bytes": freed}

    def _resume(self, name: JobName) -> dict[str, Any]:
        job, checkpoint, seconds = self.engine.restore(name, warn=lambda t: log.warning("%s: %s", name, t))
        self.scheduling.restored(name)
        return {"checkpoint": checkpoint.id, "restore_s": seconds, "pid": job.pid}

    # -- evacuation --------------------------------------------------------------------------------------

    def draining(self) -> dict[str, Any] | None:
        """Why the node takes no new job (``why``, ``by``, ``at``, ``boot``), or None."""
        value = self.records.node_flag("draining")
        return None if value is None else dict(json.loads(value))

    def evacuate(
        self,
        why: str,
        by: str,
        deadline_s: float | None = None,
        resume_at_boot: bool | None = None,
        to_peers: bool = False,
    ) -> EvacuationReport:
        """Hibernate every running job into the durable tier, most valuable first; refuse new jobs. With
        ``to_peers``, move each to a peer that has room instead (:mod:`~torpor.apps.agent.abroad`), and
        hibernate the rest.

        The order and what to do with each job are :func:`torpor.policy.evacuation.plan`'s. Runs
        ``parallel`` checkpoints at once and returns by the deadline with what was saved by then; the
        checkpoints still under way go on (their launchers finish them) and the next round sees them.
        One that fails does not stop the others. Only one evacuation runs at a time: a second call waits
        for it and then saves what is left. ``resume_at_boot``: whether the agent's next start on a new
        boot resumes what this one hibernated (default: only for its own shutdown).
        """
        if deadline_s is None:
            deadline_s = self.options.stop_deadline_s if by == BY_SHUTDOWN else self.options.drain_deadline_s
        with self._evacuating:
            started = time.time()
            if self.draining() is None:
                flag = {
                    "why": why,
                    "by": by,
                    "at": started,
                    "boot": procfs.boot_id(),
                    "resume_at_boot": by == BY_SHUTDOWN if resume_at_boot is None else resume_at_boot,
                }
                self.records.set_node_flag("draining", json.dumps(flag))
            report = EvacuationReport(why, by, started, started + deadline_s)
            self.last_evacuation = report
            self.event(None, "evacuate", f"{by}: {why}", deadline_s=deadline_s)
            self._wait_idle_actions(started + min(deadline_s, 30.0))
            the_plan = evacuation.plan(
                self._candidates(), time.time(), report.deadline_at, self.options.parallel
            )
            report.order = [step.name for step in the_plan.steps]
            live = [step.name for step in the_plan.steps if step.action == evacuation.HIBERNATE]
            where = abroad.destinations(self.engine, live) if to_peers and live else None
            report.stayed = {stay.job: stay.reason for stay in where.stays} if where else {}
            outcomes: list[evacuation.Outcome] = []
            # not a with-block: that would wait for every checkpoint, and the report is due by the deadline
            pool = ThreadPoolExecutor(max(1, self.options.parallel), "torpor-evacuate")
            futures = {
                pool.submit(
                    self._evacuate_one,
                    JobName(step.name),
                    by,
                    where.peer_of(step.name) if where else None,
                    report,
                ): step.name
                for step in the_plan.steps
            }
            pool.shutdown(wait=False)  # what is under way at the deadline goes on; the next round sees it
            done, _ = wait_futures(futures, timeout=max(0.0, report.deadline_at - time.time()))
            for future in done:
                name = futures[future]
                try:
                    saved = report.saved[name] = future.result()
                    outcomes.append(
                        evacuation.Outcome(name, True, saved["at"], moved_to=saved.get("moved_to"))
                    )
                except TorporError as exc:
                    self._evacuation_tried.add(JobName(name))
                    report.failed[name] = exc.message
                    outcomes.append(evacuation.Outcome(name, False, time.time(), exc.message))
                except Exception as exc:
                    log.exception("evacuating %s failed", name)
                    self._evacuation_tried.add(JobName(name))
                    report.failed[name] = f"{type(exc).__name__}: {exc}"
                    outcomes.append(evacuation.Outcome(name, False, time.time(), report.failed[name]))
            report.finished_at = time.time()
            outcome = evacuation.report(the_plan, outcomes, report.finished_at)
            report.pending = list(outcome.unfinished)
            report.summary = outcome.summary
            self.event(None, "evacuated", f"{by}: {why}: {outcome.summary}", **report.to_dict())
            return report

    def _candidates(self) -> list[evacuation.Job]:
        """Every job as :func:`torpor.policy.evacuation.plan` sees it."""
        jobs = [self.engine.reconcile(job) for job in self.records.jobs()]
        cares = self.records.cares()
        latest = {job.name: self.records.latest_checkpoint(job.name) for job in jobs}
        images = self.engine.image_states([c for c in latest.values() if c is not None])
        moved = Moves(self.records).moved()
        candidates = []
        for job in jobs:
            last = latest[job.name]
            image = images.get(last.id) if last else None
            candidates.append(
                evacuation.Job(
                    name=job.name,
                    state=evacuation.MOVED if job.name in moved else str(job.state),
                    priority=cares[job.name].policy.priority if job.name in cares else 0,
                    last_checkpoint_at=last.created_at if last else None,
                    started_at=job.started_at or job.created_at,
                    durable_s=evacuation.durable_estimate(last.size_bytes if last else 0),
                    image_durable=image is not None and image.state == DURABLE,
                )
            )
        return candidates

    def _wait_idle_actions(self, until: float) -> None:
        """Let the agent's own checkpoint under way end first (a job cannot be hibernated meanwhile)."""
        while time.time() < until:
            with self._guard:
                if not self._busy:
                    return
            time.sleep(0.05)

    def _evacuate_one(
        self, name: JobName, by: str, peer: str | None, report: EvacuationReport
    ) -> dict[str, Any]:
        started = time.monotonic()
        job = self.records.job(name)
        deadline = time.monotonic() + 60
        while job.state in _PASSING and time.monotonic() < deadline:  # a checkpoint or restore under way
            time.sleep(0.1)
            job = self.records.job(name)
        if job.state == JobState.RUNNING and peer is not None:
            moved = abroad.evacuate_one(self, name, by, peer, report.stayed)
            if moved is not None:
                return moved
            job = self.records.job(name)  # running here again, or hibernated if its resume failed
        if job.state == JobState.RUNNING:
            checkpoint = self.hibernate(name, by)
            self.event(name, "hibernate", f"evacuation ({by})", **checkpoint_costs(checkpoint))
        else:  # hibernated already: only its image may still be on its way to the durable tier
            latest = self.records.latest_checkpoint(name)
            if latest is None or job.state != JobState.HIBERNATED:
                raise UsageError(f"job '{name}' is {job.state}, with nothing the evacuation can save")
            checkpoint = latest
        image = self.engine.wait_durable(checkpoint.id)
        return {
            "checkpoint": checkpoint.id,
            "durable_s": time.monotonic() - started,
            "stored_bytes": image.stored_bytes,
            "freeze_s": checkpoint.freeze_s,
            "at": time.time(),
        }

    def on_notice(self, notice: Notice) -> None:
        """A notice of the cloud provider: evacuate (in the background: the watcher goes on polling)."""
        left = None if notice.deadline is None else max(1.0, notice.deadline - time.time())
        self.event(None, "notice", notice.text, source=notice.source, becomes=notice.action, deadline_s=left)
        if notice.evacuate:
            args = (
                notice.text,
                BY_NOTICE,
                left,
                evacuation.resumes_at_boot(notice),
                self.options.evacuate_to_peers,
            )
            threading.Thread(target=self.evacuate, args=args, name="torpor-evacuate", daemon=True).start()

    def on_notice_problem(self, problem: str | None) -> None:
        if problem is None:
            log.info("the notice URL answers again")
        else:
            log.warning("cannot read notices: %s", problem)

    def undrain(self) -> list[JobName]:
        """Take new jobs again, and resume the jobs an evacuation hibernated; their names."""
        draining = self.draining()
        if draining is None:
            raise UsageError("this node is not draining")
        self.records.set_node_flag("draining", None)
        self.event(None, "undrain", f"drain cancelled ({draining['by']}: {draining['why']})")
        resumed = []
        for name, care in self.records.cares().items():
            if care.hibernated_by in (BY_DRAIN, BY_NOTICE, BY_SHUTDOWN) and (
                self.records.job(name).state == JobState.HIBERNATED
            ):
                self.submit(name, "resume", "the node takes jobs again", self._resume)
                resumed.append(name)
        return resumed

    # -- events ------------------------------------------------------------------------------------------

    def event(self, job: str | None, action: str, reason: str, **detail: object) -> None:
        self.records.add_event(job, action, reason, **detail)
        cost = ", ".join(f"{k}={_short(v)}" for k, v in detail.items() if k in _SHOWN)
        log.info("%s%s: %s%s", f"{job}: " if job else "", action, reason, f" ({cost})" if cost else "")


#: states a job passes through (a checkpoint, a restore under way): an evacuation waits for them to end
_PASSING = frozenset({JobState.STARTING, JobState.CHECKPOINTING, JobState.RESTORING})

_SHOWN = (
    "durable_s",
    "freeze_s",
    "precopied_bytes",
    "size_bytes",
    "total_s",
    "freed_bytes",
    "restore_s",
    "overhead",
    "error",
    "deadline_s",
)


def _short(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def wake_addresses(pids: list[int], ports: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    """The addresses the job listens on among ``ports``: the agent holds exactly those while it sleeps."""
    if not ports:
        return ()
    found = [(host, port) for host, port in sockets.listening_sockets(pids) if port in ports]
    missing = [port for port in ports if port not in {p for _, p in found}]
    # a port the job did not listen on at that moment is held on loopback only: never wider than the job
    return (*found, *(("127.0.0.1", port) for port in missing))
