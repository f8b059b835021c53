"""Whether a failed dump is tried again, and after what delay; when the scheduler tries a failed resume again.

A dump that met a process of the tree in the middle of exiting (a DataLoader worker at the end of an
epoch) fails with one of :data:`PASSING_DUMP_ERRORS`; a moment later the process is gone and the dump
works. So does one that met another dump of a job in the same working directory (:data:`BUSY_CWD_ERRORS`).
Any other failure is final. Running CRIU, emptying the folder and sleeping are the core's
(:func:`torpor.core.checkpoint.dump`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: CRIU log lines that say a process of the tree was exiting: the failure passes, try again
PASSING_DUMP_ERRORS: tuple[str, ...] = ("Zombies with threads are not supported",)
#: CRIU's parasite, in a job that is PID 1 of its own PID namespace (every torpor job), mounts a /proc of
#: that namespace for a moment on a folder it creates in the job's working directory, ``proc.crtools``.
#: A dump of another job of the same working directory, at that same moment, finds the folder there
#: (EEXIST) and fails: the other one is gone a millisecond later. (One left by a CRIU killed meanwhile is
#: removed: :func:`stale_cwd_folder`; one put there fails every attempt, and
#: :func:`torpor.adapters.criulog.dump_failure` says so.)
BUSY_CWD_ERRORS: tuple[str, ...] = ("Can't create a directory (-17)",)
#: the folder of :data:`BUSY_CWD_ERRORS`
CWD_FOLDER = "proc.crtools"
#: a ``proc.crtools`` older than this, and root's (CRIU's), is one a CRIU killed mid-dump left: a live
#: one is there for milliseconds
STALE_CWD_FOLDER_S = 5.0
#: attempts in all, the first one included
DUMP_ATTEMPTS = 3
#: the delay before attempt n+1 is n times this
BACKOFF_S = 0.1


#: CRIU log lines that say a dump made without ``--tcp-established`` met a TCP connection: one appeared
#: after torpor looked (a tree with no TCP socket is dumped without it, and without the network lock)
TCP_DUMP_ERRORS: tuple[str, ...] = ("consider using --tcp-established",)


@dataclass(frozen=True)
class Retry:
    """The decision after a failed dump: try ``again`` after ``delay_s`` seconds (``tcp``: with the TCP
    connections' options and the network lock), or give up."""

    again: bool
    delay_s: float = 0.0
    tcp: bool = True


GIVE_UP = Retry(again=False)


def after_failed_dump(
    attempt: int, error_lines: Sequence[str], tcp: bool = True, jitter: float = 0.0
) -> Retry:
    """After failed attempt number ``attempt`` (1-based) whose CRIU log said ``error_lines``; ``tcp``:
    whether it was made with the TCP connections' options; ``jitter``: a random number in [0, 1) from
    the caller.

    1. No attempts are left (``attempt`` >= :data:`DUMP_ATTEMPTS`): give up.
    2. Made without them, and a line says a TCP connection needs them: try again at once, with them.
    3. A line says another dump in the same working directory was in the way: try again after
       ``attempt`` × :data:`BACKOFF_S` × (1 + ``jitter``), as it was; the jitter keeps two dumps that
       met once from meeting again.
    4. No line names a passing error: give up (trying again would fail the same way).
    5. Otherwise try again after ``attempt`` × :data:`BACKOFF_S` (0.1 s, then 0.2 s), as it was.
    """
    if attempt >= DUMP_ATTEMPTS:
        return GIVE_UP
    if not tcp and _says(error_lines, TCP_DUMP_ERRORS):
        return Retry(again=True, tcp=True)
    if met_busy_cwd(error_lines):
        return Retry(again=True, delay_s=BACKOFF_S * attempt * (1.0 + jitter), tcp=tcp)
    if not _says(error_lines, PASSING_DUMP_ERRORS):
        return GIVE_UP
    return Retry(again=True, delay_s=BACKOFF_S * attempt, tcp=tcp)


def met_busy_cwd(error_lines: Sequence[str]) -> bool:
    """Whether a failed dump's CRIU errors say it found a ``proc.crtools`` in the job's working
    directory (:data:`BUSY_CWD_ERRORS`)."""
    return _says(error_lines, BUSY_CWD_ERRORS)


def stale_cwd_folder(age_s: float, owner_uid: int) -> bool:
    """Whether the ``proc.crtools`` a dump met in the job's working directory (:data:`BUSY_CWD_ERRORS`),
    ``age_s`` seconds old and owned by ``owner_uid``, is removed before the next attempt: a folder of
    root's (CRIU runs as root) older than :data:`STALE_CWD_FOLDER_S` was left by a CRIU killed while it
    dumped a job of that folder, and would fail every dump there until removed. Anyone else's stays
    (``torpor checkpoint`` says what is in the way): it was put there, and is not torpor's to remove."""
    return owner_uid == 0 and age_s > STALE_CWD_FOLDER_S


def cwd_folder_wait(age_s: float, owner_uid: int) -> float:
    """Seconds to wait, after a dump met a ``proc.crtools`` ``age_s`` seconds old and owned by
    ``owner_uid`` in the job's working directory, before looking at it again: none for one that
    :func:`stale_cwd_folder` removes now, or that is not root's (it stays, and the error says so); for a
    young one of root's, until it would be stale. A live dump's is gone within milliseconds, so one still
    there then is a dead CRIU's: removed, rather than failing every attempt left within those seconds."""
    if owner_uid != 0 or stale_cwd_folder(age_s, owner_uid):
        return 0.0
    return STALE_CWD_FOLDER_S - max(age_s, 0.0) + BACKOFF_S


def _says(lines: Sequence[str], markers: Sequence[str]) -> bool:
    return any(marker in line for line in lines for marker in markers)


#: the scheduler's wait before it tries again to resume a job whose restore failed: doubled after each
#: failure in a row, from the first to the last
RESUME_BACKOFF_S = (5.0, 300.0)


def after_failed_resume(failures: int) -> float:
    """Seconds before the scheduler tries again to resume (or start) a job whose restore (or start) failed
    ``failures`` times in a row (its image is kept and it stays hibernated, or queued: trying every round
    would only repeat it): 5 s, 10 s, 20 s … at most 5 min."""
    first, last = RESUME_BACKOFF_S
    return float(min(last, first * 2 ** max(0, failures - 1)))
