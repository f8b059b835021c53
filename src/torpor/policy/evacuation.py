"""Evacuation: which jobs to save before this machine goes away, in which order, and what was saved.

On a notice (a spot interruption, host maintenance, ``torpor drain``, the agent's own SIGTERM) the agent
hibernates every job to the durable tier — the machine's RAM and local disks may not come back — and
says what it saved by the deadline. This module decides, from plain data, and does nothing itself:

- :func:`plan`: the jobs to act on and their order, most valuable first (:func:`rank`), with when each is
  expected to be durable given the agent's parallelism, and which are expected to miss the deadline
  (they are still tried: a deadline is a notice's promise, and the machine may well last longer);
- :func:`report`: after the fact, from what happened to each job: saved by the deadline, saved late,
  failed (with why), not finished — nothing is left out;
- :func:`resumes_at_boot` and :func:`to_resume`: which of the jobs it hibernated the agent resumes when
  it starts again ("reboot without losing work").

Running the checkpoints (and their parallelism), refusing new jobs, waiting for images to be durable and
keeping the resume list on disk are the agent's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torpor.policy import notices
from torpor.policy.notices import Notice

# what the agent does with a job
HIBERNATE = "hibernate"  # checkpoint to the durable tier and stop it: its processes would die anyway
WAIT = "wait"  # already (being) hibernated, its image not durable yet: wait for the durable copy

#: job states (torpor.core.recordtypes.JobState) with processes, now or in a moment: hibernate them. A job
#: that is starting, being checkpointed or restored is hibernated once that is over (the agent waits).
LIVE_STATES = frozenset({"running", "starting", "checkpointing", "restoring"})
#: a hibernation already under way: wait for it and its durable copy
HIBERNATING = "hibernating"
HIBERNATED = "hibernated"
#: a job handed to a peer (``torpor migrate``, an evacuation to peers): nothing of it is left to save here
MOVED = "moved"

#: a guess of the durable tier's speed, for a job that has no checkpoint to measure it by (bytes/s)
DEFAULT_DURABLE_BYTES_PER_S = 256 * 1024 * 1024


@dataclass(frozen=True)
class Job:
    """What the plan needs to know of one job (times are epoch seconds).

    ``durable_s``: how long bringing it to the durable tier is expected to take — a checkpoint and its
    upload for a live job, what is left of the upload for a hibernated one (:func:`durable_estimate`).
    ``image_durable``: for a hibernated job, whether its newest image is in the durable tier already.
    """

    name: str
    state: str
    priority: int = 0
    last_checkpoint_at: float | None = None
    started_at: float = 0.0
    durable_s: float = 0.0
    image_durable: bool = True


@dataclass(frozen=True)
class Step:
    """Act on ``name`` (``HIBERNATE`` or ``WAIT``), expected to start at ``start_at`` and be durable at
    ``done_at``; ``fits``: by the deadline."""

    name: str
    action: str
    start_at: float
    done_at: float
    fits: bool


@dataclass(frozen=True)
class Skip:
    """A job the evacuation leaves alone, and why; ``safe``: it is hibernated with a durable image."""

    name: str
    reason: str
    safe: bool = False


@dataclass(frozen=True)
class Plan:
    """The steps in the order to start them (at most ``parallelism`` checkpoints at a time), and the
    jobs left alone. Every job given appears exactly once, in ``steps`` or in ``skipped``."""

    steps: tuple[Step, ...]
    skipped: tuple[Skip, ...]
    now: float
    deadline: float | None
    parallelism: int

    @property
    def done_at(self) -> float:
        """When everything is expected to be durable."""
        return max((step.done_at for step in self.steps), default=self.now)

    @property
    def late(self) -> tuple[str, ...]:
        """The jobs expected to be durable only after the deadline."""
        return tuple(step.name for step in self.steps if not step.fits)

    @property
    def fits(self) -> bool:
        return not self.late


def rank(jobs: Iterable[Job]) -> list[Job]:
    """The jobs, most valuable first:

    1. higher ``priority`` first;
    2. the longest since its last checkpoint first — one never checkpointed before any other (it has
       all its work at risk), then the oldest ``last_checkpoint_at``;
    3. of those never checkpointed, the one running longest (earliest ``started_at``) first;
    4. by name, so that the order is the same for the same jobs.
    """

    def key(job: Job) -> tuple[int, int, float, str]:
        if job.last_checkpoint_at is None:
            return (-job.priority, 0, job.started_at, job.name)
        return (-job.priority, 1, job.last_checkpoint_at, job.name)

    return sorted(jobs, key=key)


def plan(jobs: Iterable[Job], now: float, deadline: float | None, parallelism: int = 1) -> Plan:
    """What to do with each job, in :func:`rank` order, and when each is expected to be durable.

    1. A job with processes (:data:`LIVE_STATES`) is hibernated (``HIBERNATE``).
    2. A job being hibernated, or hibernated with an image that is not durable yet, is waited for (``WAIT``);
       its upload already runs, so it takes no checkpoint slot.
    3. Every other job is skipped, saying why: hibernated with a durable image (already safe), moved to a
       peer, exited, failed, or a state this plan does not know.
    4. Checkpoints are given, in order, to the first of ``parallelism`` slots to be free (at least one);
       a step ``fits`` when it is expected to be durable by ``deadline`` (always, without one).
    """
    slots = [now] * max(1, parallelism)
    steps: list[Step] = []
    skipped: list[Skip] = []
    for job in rank(jobs):
        cost = max(0.0, job.durable_s)
        if job.state in LIVE_STATES:
            slot = min(range(len(slots)), key=lambda index: slots[index])
            start = slots[slot]
            slots[slot] = start + cost
            steps.append(Step(job.name, HIBERNATE, start, start + cost, _fits(start + cost, deadline)))
        elif job.state == HIBERNATING or (job.state == HIBERNATED and not job.image_durable):
            steps.append(Step(job.name, WAIT, now, now + cost, _fits(now + cost, deadline)))
        elif job.state == HIBERNATED:
            skipped.append(Skip(job.name, "hibernated, its image durable already", safe=True))
        elif job.state == MOVED:
            skipped.append(Skip(job.name, "moved to a peer: it is that machine's"))
        elif job.state in ("exited", "failed"):
            skipped.append(Skip(job.name, f"{job.state}: no processes to save"))
        else:
            skipped.append(Skip(job.name, f"state '{job.state}' is not one an evacuation knows"))
    return Plan(tuple(steps), tuple(skipped), now, deadline, max(1, parallelism))


def _fits(done_at: float, deadline: float | None) -> bool:
    return deadline is None or done_at <= deadline


def durable_estimate(
    memory_bytes: int,
    last_size_bytes: int | None = None,
    last_durable_s: float | None = None,
    fallback_bytes_per_s: float = DEFAULT_DURABLE_BYTES_PER_S,
) -> float:
    """Seconds to bring a job of ``memory_bytes`` (its resident memory) to the durable tier: at the rate
    its last checkpoint went (``last_size_bytes`` in ``last_durable_s``, from dump to durable), or at
    ``fallback_bytes_per_s`` for a job that has none."""
    rate = fallback_bytes_per_s
    if last_size_bytes and last_durable_s and last_durable_s > 0:
        rate = last_size_bytes / last_durable_s
    return max(0, memory_bytes) / rate if rate > 0 else 0.0


# -- after the fact ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What became of one step: ``ok`` once the job's image is in the durable tier, or once the peer
    ``moved_to`` resumed it (at ``at``, epoch seconds), else ``error`` says why not (the checkpoint
    failed, the upload failed)."""

    name: str
    ok: bool
    at: float
    error: str | None = None
    checkpoint: str | None = None
    moved_to: str | None = None


@dataclass(frozen=True)
class Failure:
    name: str
    reason: str


@dataclass(frozen=True)
class Report:
    """What an evacuation saved, as of ``at``. Every job of the plan is in exactly one list.

    ``saved``: durable by the deadline; ``late``: durable, but after it (it may not have made it);
    ``failed``: with why; ``unfinished``: still under way, or never started, at ``at``;
    ``already_safe``: hibernated with a durable image before the evacuation began; ``skipped``: the rest
    (exited, failed, unknown states). ``hibernated`` is the jobs this evacuation hibernated and brought to
    the durable tier (saved or late), in plan order: the candidates to resume at the next start.
    ``moved``: the saved (or late) jobs that a peer took instead, each with the peer, in plan order.
    """

    at: float
    deadline: float | None
    saved: tuple[str, ...]
    late: tuple[str, ...]
    failed: tuple[Failure, ...]
    unfinished: tuple[str, ...]
    already_safe: tuple[str, ...]
    skipped: tuple[Skip, ...]
    hibernated: tuple[str, ...]
    moved: tuple[tuple[str, str], ...] = ()

    @property
    def not_in_time(self) -> tuple[str, ...]:
        """Jobs not durable by the deadline, though not failed: late or unfinished."""
        return self.late + self.unfinished

    @property
    def complete(self) -> bool:
        """Every job that needed saving was saved by the deadline."""
        return not (self.late or self.failed or self.unfinished)

    @property
    def summary(self) -> str:
        """One line for the agent's log and events."""
        acted = len(self.saved) + len(self.late) + len(self.failed) + len(self.unfinished)
        parts = [f"{len(self.saved)} of {acted} jobs saved by the deadline"]
        if self.moved:
            parts.append(
                f"{len(self.moved)} moved to peers ("
                + ", ".join(f"{job} to {p}" for job, p in self.moved)
                + ")"
            )
        if self.late:
            parts.append(f"{len(self.late)} late ({', '.join(self.late)})")
        if self.unfinished:
            parts.append(f"{len(self.unfinished)} not finished ({', '.join(self.unfinished)})")
        if self.failed:
            parts.append(
                f"{len(self.failed)} failed (" + "; ".join(f"{f.name}: {f.reason}" for f in self.failed) + ")"
            )
        if self.already_safe:
            parts.append(f"{len(self.already_safe)} already safe")
        return ", ".join(parts)


def report(evacuation: Plan, outcomes: Iterable[Outcome], at: float) -> Report:
    """Sort each step of ``evacuation`` by its outcome as of ``at``.

    1. No outcome (or one after ``at``): unfinished.
    2. Not ``ok``: failed, with its error ("failed" when it gave none).
    3. ``ok`` at or before the plan's deadline (or with no deadline): saved; after it: late.
    An outcome for a job that is not in the plan is no part of this evacuation and is left out; of two for
    one job, the last counts.
    """
    known = {step.name for step in evacuation.steps}
    final: dict[str, Outcome] = {}
    for given in outcomes:
        if given.name in known and given.at <= at:
            final[given.name] = given
    saved: list[str] = []
    late: list[str] = []
    failed: list[Failure] = []
    unfinished: list[str] = []
    hibernated: list[str] = []
    moved: list[tuple[str, str]] = []
    for step in evacuation.steps:
        outcome = final.get(step.name)
        if outcome is None:
            unfinished.append(step.name)
        elif not outcome.ok:
            failed.append(Failure(step.name, outcome.error or "failed"))
        else:
            (saved if _fits(outcome.at, evacuation.deadline) else late).append(step.name)
            if outcome.moved_to is not None:
                moved.append((step.name, outcome.moved_to))
            elif step.action == HIBERNATE:
                hibernated.append(step.name)
    already_safe = tuple(skip.name for skip in evacuation.skipped if skip.safe)
    others = tuple(skip for skip in evacuation.skipped if not skip.safe)
    return Report(
        at,
        evacuation.deadline,
        tuple(saved),
        tuple(late),
        tuple(failed),
        tuple(unfinished),
        already_safe,
        others,
        tuple(hibernated),
        tuple(moved),
    )


# -- at the next start -------------------------------------------------------------------------------


def resumes_at_boot(notice: Notice) -> bool:
    """Whether the jobs an evacuation for ``notice`` hibernated are resumed when the agent starts again.

    Yes when this machine comes back with its disks and the work is meant to go on here: the agent's own
    shutdown (a reboot), an AWS spot stop or hibernation, a scheduled reboot or stop. No when the machine
    is gone for good (a termination, a preemption) or the work was sent away on purpose (``torpor drain``):
    then the jobs stay hibernated until someone resumes them, here or elsewhere.
    """
    if notice.kind == notices.SHUTDOWN:
        return True
    return notice.kind != notices.DRAIN and notice.action in (notices.REBOOT, notices.STOP, notices.HIBERNATE)


def to_resume(hibernated: Sequence[str], states: Mapping[str, str]) -> tuple[str, ...]:
    """Of the jobs an evacuation hibernated (:attr:`Report.hibernated`, most valuable first), those to
    resume now: the ones still hibernated (``states``: each job's state now; one resumed, deleted or
    changed since is left alone), in the same order, each once."""
    seen: set[str] = set()
    chosen: list[str] = []
    for name in hibernated:
        if states.get(name) == HIBERNATED and name not in seen:
            seen.add(name)
            chosen.append(name)
    return tuple(chosen)
