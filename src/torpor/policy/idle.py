"""Whether a job is idle: its processes used (almost) no CPU over the whole of the last ``idle_after_s``.

The agent samples each job's CPU time (user + system, of every process of the tree, in seconds) at each
round and gives the samples here. A job is idle only when the samples cover the full window — an agent
that just started, or a job just resumed, has not watched long enough to say — and the CPU used across
the window is below ``threshold`` of one core (1 %: a server's timers and a heartbeat thread, not work).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

#: the share of one core below which a job counts as idle
THRESHOLD = 0.01


@dataclass(frozen=True)
class Sample:
    """The tree's CPU time used so far (seconds), read at ``at``."""

    at: float
    cpu_s: float


def is_idle(samples: Sequence[Sample], idle_after_s: float, now: float, threshold: float = THRESHOLD) -> bool:
    """True when the samples cover ``[now - idle_after_s, now]`` and the CPU used over it is below threshold.

    CPU time that went down between samples (a process of the tree ended, taking its time with it) is not
    counted as negative use: each step counts as at least zero.
    """
    start = now - idle_after_s
    window = [s for s in samples if s.at >= start]
    before = [s for s in samples if s.at < start]
    if not before or not window:
        return False  # not watched since the start of the window
    points = [before[-1], *window]
    used = sum(max(0.0, b.cpu_s - a.cpu_s) for a, b in pairwise(points))
    return used < threshold * (points[-1].at - points[0].at)


def trim(samples: Sequence[Sample], idle_after_s: float, now: float) -> list[Sample]:
    """The samples :func:`is_idle` still needs: those in the window and the last one before it."""
    start = now - idle_after_s
    before = [s for s in samples if s.at < start]
    return [*before[-1:], *(s for s in samples if s.at >= start)]
