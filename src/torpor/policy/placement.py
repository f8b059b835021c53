"""Placement: which peer takes which job when this machine's jobs move to others.

An evacuation to peers (issue 30: ``torpor drain --to-peers``, a spot or maintenance notice) sends each
job to a peer that has room for it, most valuable first (the order :func:`torpor.policy.evacuation.rank`
gives), and hibernates into the durable tier the jobs no peer can take. This module decides where, from
plain data, and does nothing itself:

- a peer takes a job only if it is reachable, not draining, and has the job's memory free of its budget
  (its own accounting, ``free`` of ``GET /v1/node``), less what this plan already sent it;
- of the peers that can, the *best fit*: the one that is left with the least free memory, so that the
  large free spaces stay whole for the large jobs that come later;
- ties (peers with the same free memory, as a fleet of identical idle nodes has) are spread: the peer
  given the fewest jobs by this plan first, then the name.

:func:`place` is O(jobs × log peers) but for the list insertions (a memmove of at most one entry per
peer), which is milliseconds for 1,000 jobs over 1,000 peers.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torpor.policy.scheduler.sizes import format_size


@dataclass(frozen=True)
class Peer:
    """What placement needs to know of one peer: bytes free of its memory budget, and whether it may
    take jobs at all."""

    name: str
    free: int
    reachable: bool = True
    draining: bool = False


@dataclass(frozen=True)
class Job:
    """A job to place and the bytes of memory it needs on the peer (its charge on this machine)."""

    name: str
    memory: int


@dataclass(frozen=True)
class Move:
    job: str
    peer: str


@dataclass(frozen=True)
class Stay:
    """A job no peer takes, and why (one line): it is hibernated into the durable tier instead."""

    job: str
    reason: str


@dataclass(frozen=True)
class Placement:
    """Every job given, exactly once: in ``moves`` (in the order given) or in ``stays``."""

    moves: tuple[Move, ...]
    stays: tuple[Stay, ...]

    def peer_of(self, job: str) -> str | None:
        """The peer ``job`` goes to, or None if it stays."""
        return next((move.peer for move in self.moves if move.job == job), None)


def place(jobs: Sequence[Job], peers: Iterable[Peer]) -> Placement:
    """Where each of ``jobs`` goes, taken in the order given (most valuable first): the best-fitting
    peer that has room (see the module's text), or nowhere, with why."""
    takers = [peer for peer in peers if peer.reachable and not peer.draining]
    # (free, jobs given so far, name), kept sorted: the first entry whose free fits is the best fit,
    # and among equal free memory the least given, then the first name
    slots = sorted((peer.free, 0, peer.name) for peer in takers)
    moves: list[Move] = []
    stays: list[Stay] = []
    for job in jobs:
        at = bisect.bisect_left(slots, (job.memory, -1, ""))
        if at == len(slots):
            stays.append(Stay(job.name, _why_not(job, takers, slots)))
            continue
        free, given, name = slots.pop(at)
        bisect.insort(slots, (free - job.memory, given + 1, name))
        moves.append(Move(job.name, name))
    return Placement(tuple(moves), tuple(stays))


def _why_not(job: Job, takers: list[Peer], slots: list[tuple[int, int, str]]) -> str:
    if not takers:
        return "no peer can take jobs: none is reachable and not draining"
    free, _, name = slots[-1]
    return f"no peer has {format_size(job.memory)} free (the most: {name}, {format_size(free)})"
