"""When to stop copying a running job's memory in rounds and freeze it (issue 31's pre-copy).

A pre-copied checkpoint copies the job's memory while it runs: a first round copies all of it, each
later one only what the job wrote since the round before, found by a scan that costs a few
milliseconds (:mod:`torpor.adapters.writetrack`); then the job is frozen and only what it wrote since
the last round is dumped. Each decision comes after a scan and before its copy, so it knows what the
next round would copy (``pending``). The rules, after P.Haul's (the pre-copy driver of CRIU's authors):

- freeze when ``pending`` is small: the freeze will be short anyway;
- freeze when ``pending`` did not shrink against the round before (more than ``shrink`` × what it
  copied): the job writes as fast as the rounds copy, and copying it would only be done again. A job
  that rewrites all of its memory between scans (a training step rewrites its weights and optimizer
  state) thus gets one round;
- freeze after ``most`` rounds, whatever is pending.

Pure: the rounds so far and what is pending in, the decision and its reason out
(:meth:`torpor.core.precopy.PreCopy.copy_rounds` acts on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torpor.policy.scheduler.sizes import format_size


@dataclass(frozen=True)
class Round:
    """One round: the bytes it copied and how long it took."""

    copied: int
    seconds: float


@dataclass(frozen=True)
class Limits:
    """Where the rounds stop (defaults: P.Haul's 64 pages and 8 rounds; a round must shrink by 10 %)."""

    small: int = 64 * 4096
    shrink: float = 0.9
    most: int = 8


@dataclass(frozen=True)
class Next:
    """Whether to copy another round (``again``) or freeze now, and why, in words for a progress line."""

    again: bool
    why: str


def next_step(rounds: Sequence[Round], pending: int, limits: Limits = Limits()) -> Next:
    """After ``rounds`` (none yet: ``pending`` is all of the memory), with ``pending`` bytes written
    since the last one, whether to copy them in another round or to freeze now."""
    if not rounds:
        return Next(True, f"round 1: all of its memory, {format_size(pending)}")
    if pending <= limits.small:
        return Next(False, f"{format_size(pending)} written since round {len(rounds)}: little is left")
    last = rounds[-1]
    if pending > limits.shrink * last.copied:
        return Next(
            False,
            f"{format_size(pending)} written since round {len(rounds)}, which copied "
            f"{format_size(last.copied)}: it writes as fast as the rounds copy",
        )
    if len(rounds) >= limits.most:
        return Next(False, f"{len(rounds)} rounds, the most")
    return Next(True, f"round {len(rounds) + 1}: {format_size(pending)} written since round {len(rounds)}")
