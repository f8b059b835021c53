"""Whether a failed dump is tried again, and after what delay; when the scheduler tries a failed resume again.

A dump that met a process of the tree in the middle of exiting (a DataLoader worker at the end of an
epoch) fails with one of :data:`PASSING_DUMP_ERRORS`; a moment later the process is gone and the dump
works. Any other failure is final. Running CRIU, emptying the folder and sleeping are the core's
(:func:`torpor.core.checkpoint.dump`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: CRIU log lines that say a process of the tree was exiting: the failure passes, try again
PASSING_DUMP_ERRORS: tuple[str, ...] = ("Zombies with threads are not supported",)
#: attempts in all, the first one included
DUMP_ATTEMPTS = 3
#: the delay before attempt n+1 is n times this
BACKOFF_S = 0.1


@dataclass(frozen=True)
class Retry:
    """The decision after a failed dump: try ``again`` after ``delay_s`` seconds, or give up."""

    again: bool
    delay_s: float = 0.0


GIVE_UP = Retry(again=False)


def after_failed_dump(attempt: int, error_lines: Sequence[str]) -> Retry:
    """After failed attempt number ``attempt`` (1-based) whose CRIU log said ``error_lines``.

    1. No attempts are left (``attempt`` >= :data:`DUMP_ATTEMPTS`): give up.
    2. No line names a passing error: give up (trying again would fail the same way).
    3. Otherwise try again after ``attempt`` × :data:`BACKOFF_S` (0.1 s, then 0.2 s).
    """
    if attempt >= DUMP_ATTEMPTS:
        return GIVE_UP
    if not any(marker in line for line in error_lines for marker in PASSING_DUMP_ERRORS):
        return GIVE_UP
    return Retry(again=True, delay_s=BACKOFF_S * attempt)


#: the scheduler's wait before it tries again to resume a job whose restore failed: doubled after each
#: failure in a row, from the first to the last
RESUME_BACKOFF_S = (5.0, 300.0)


def after_failed_resume(failures: int) -> float:
    """Seconds before the scheduler tries again to resume (or start) a job whose restore (or start) failed
    ``failures`` times in a row (its image is kept and it stays hibernated, or queued: trying every round
    would only repeat it): 5 s, 10 s, 20 s … at most 5 min."""
    first, last = RESUME_BACKOFF_S
    return float(min(last, first * 2 ** max(0, failures - 1)))
