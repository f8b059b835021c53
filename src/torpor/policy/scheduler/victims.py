"""Whom to hibernate when room is needed: one order, written once, used by preemption, reclaim and the guard.

Candidates are ranked by one key, its criteria in this order (the first that differs decides):

1. the *tier*: work that is on borrowed room comes first — for a preemption or reclaim, jobs of another
   project beyond that project's share (when the preemptor is within its own share); for the memory guard,
   jobs that grew past their request. Work within what it was promised comes after.
2. lower priority first (base priority: aging orders the queue, it never makes a job a victim of another);
3. least work since its last checkpoint first (what a hibernation costs is the freeze, and a job that just
   checkpointed has the least to write and nothing at risk);
4. larger first, so that fewer victims free the room;
5. the name, so that the choice is deterministic.

:func:`choose` then takes candidates in that order until they free ``need`` bytes, and gives back those it
can spare (the reprieve: the latest taken of the last tier taken first, never a borrower to keep a job of
a later tier hibernated). If all of them together do not free ``need``, nobody is chosen: hibernating some
jobs without making room would lose their time for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from torpor.policy.scheduler.snapshot import Job

#: a candidate victim: its tier (0 first) and the job
Candidate = tuple[int, Job]


def rank(tier: int, job: Job, size: int) -> tuple[int, int, float, int, str]:
    """The sort key of a victim (see the module's docstring); ``size`` is what hibernating it frees."""
    return (tier, job.priority, job.work_since_checkpoint_s, -size, job.name)


def ordered(candidates: Iterable[Candidate], size: Callable[[Job], int]) -> list[Candidate]:
    """``candidates`` in the victim order."""
    return sorted(candidates, key=lambda c: rank(c[0], c[1], size(c[1])))


def choose(ranked: Sequence[Candidate], need: int, size: Callable[[Job], int]) -> list[Candidate] | None:
    """The fewest victims, in ``ranked``'s order, that free at least ``need`` bytes; None if all do not."""
    taken: list[Candidate] = []
    freed = 0
    for candidate in ranked:
        if freed >= need:
            break
        taken.append(candidate)
        freed += size(candidate[1])
    if freed < need or not taken:
        return None
    last_tier = taken[-1][0]
    for candidate in reversed(taken[:-1]):
        tier, job = candidate
        if tier != last_tier:
            break
        if freed - size(job) >= need:
            taken.remove(candidate)
            freed -= size(job)
    return taken
