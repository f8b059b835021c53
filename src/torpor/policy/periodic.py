"""When a job's next periodic checkpoint is due, within its overhead budget.

The user asks for a checkpoint every ``every_s``; each one freezes the job for some time, measured and kept
with the checkpoint. If freezes take longer than ``budget`` of the time between them, the interval is
stretched until they do not: a job whose checkpoint freezes it 2 s, on a 2 % budget, is checkpointed at most
every 100 s whatever was asked. The estimate is the mean of the recent freezes, so one slow checkpoint
stretches the next interval and a run of fast ones brings it back.
"""

from __future__ import annotations

from collections.abc import Sequence

#: how many of the latest freezes the estimate averages
RECENT = 5


def interval(every_s: float, budget: float, freezes_s: Sequence[float]) -> float:
    """Seconds between two checkpoints: ``every_s``, or longer where the freezes would exceed the budget."""
    recent = list(freezes_s)[-RECENT:]
    if not recent:
        return every_s
    freeze = sum(recent) / len(recent)
    return max(every_s, freeze / budget)


def next_due(
    every_s: float, budget: float, freezes_s: Sequence[float], last_at: float | None, running_since: float
) -> float:
    """The time the next checkpoint is due: one interval after the last checkpoint, or after the job started
    (or was restored) when it has none since."""
    since = running_since if last_at is None else max(last_at, running_since)
    return since + interval(every_s, budget, freezes_s)


def overhead(freezes_s: Sequence[float], elapsed_s: float) -> float:
    """The share of ``elapsed_s`` the job spent frozen by these checkpoints (what the budget bounds)."""
    return sum(freezes_s) / elapsed_s if elapsed_s > 0 else 0.0
