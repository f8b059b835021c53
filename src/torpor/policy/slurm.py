"""What the Slurm supervisor decides: what a run of a Slurm job restores, and what becomes of the job
once its torpor job is hibernated.

* Starting: only a restart (``SLURM_RESTART_COUNT`` > 0) restores (:func:`restores`); it tries this Slurm
  job's checkpoints newest first, over all its torpor jobs (:func:`owns`, :func:`restore_order`), each
  failure falling back to the one before, and with none left to a cold start (:func:`fallback`), which runs
  under a name of its own (:func:`cold_start_name`).
* Stopping: the signal says what the supervisor means to do (:func:`intent`): SIGUSR2 (``torpor slurm
  hibernate``) holds the job, SIGUSR1 (Slurm's preemption) and SIGTERM requeue it; after SIGTERM Slurm
  may be requeueing the job itself or ending it for good, which its state tells (:func:`after_stop`).

Pure functions of plain data: :mod:`torpor.apps.slurm` reads the environment, the records and Slurm,
calls these, and does what they say (restores, ``scontrol requeue``, what it writes to Slurm's files).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

#: the signal Slurm sends at preemption (``--signal=B:USR1@N``): hibernate, then requeue
PREEMPT = "SIGUSR1"
#: the signal ``torpor slurm hibernate`` sends: hibernate, then hold
HOLD = "SIGUSR2"
#: ``scontrol requeue``, ``scancel``, the end of a grace time: hibernate, then requeue unless Slurm does
TERM = "SIGTERM"
#: the signals the supervisor answers
SIGNALS = (PREEMPT, HOLD, TERM)


# -- starting -------------------------------------------------------------------------------------------


class Saved(Protocol):
    """A checkpoint as the restore order sees it (:class:`torpor.core.recordtypes.Checkpoint` is one)."""

    @property
    def id(self) -> str: ...

    @property
    def job(self) -> str: ...

    @property
    def created_at(self) -> float: ...


SavedT = TypeVar("SavedT", bound=Saved)


def base_name(job_id: str) -> str:
    """The torpor job of the Slurm job's first run; a cold restart runs as ``<base>-r<restart>``."""
    return f"slurm-{job_id}"


def owns(job_id: str, torpor_job: str) -> bool:
    """Whether the torpor job ``torpor_job`` is one of Slurm job ``job_id``'s runs."""
    base = base_name(job_id)
    return torpor_job == base or torpor_job.startswith(base + "-r")


def restores(restart_count: int) -> bool:
    """Whether a run restores a checkpoint: only a restart does. A first run whose id already has torpor
    jobs belongs to a new Slurm job with a reused number (Slurm numbers jobs anew when its state is wiped)."""
    return restart_count > 0


def restore_order(job_id: str, checkpoints: Iterable[SavedT]) -> list[SavedT]:
    """The checkpoints of Slurm job ``job_id`` (over all its torpor jobs) in the order a restart tries
    them: newest first (equally old ones in the order given)."""
    found = [c for c in checkpoints if owns(job_id, c.job)]
    return sorted(found, key=lambda c: c.created_at, reverse=True)


def fallback(candidates: Sequence[SavedT], failed: int) -> SavedT | None:
    """What a restart tries after ``candidates[failed]`` failed to restore: the checkpoint before it, or
    ``None`` for a cold start."""
    return candidates[failed + 1] if failed + 1 < len(candidates) else None


def cold_start_name(job_id: str, restart_count: int, taken: Collection[str]) -> str:
    """The torpor job a cold start runs as: the base name on a first run, ``-r<restart>`` after it, with
    ``-2``, ``-3``… added while the name is ``taken``."""
    name = base_name(job_id) if restart_count == 0 else f"{base_name(job_id)}-r{restart_count}"
    unique, n = name, 2
    while unique in taken:
        unique, n = f"{name}-{n}", n + 1
    return unique


# -- stopping -------------------------------------------------------------------------------------------


class After(enum.Enum):
    """What becomes of the Slurm job once its torpor job is hibernated (or failed to be)."""

    #: ``scontrol requeue``: the next run restores it
    REQUEUE = "requeue"
    #: ``scontrol requeuehold``: it runs again when released (``torpor slurm resume``)
    HOLD = "hold"
    #: nothing to do: Slurm is requeueing it itself (its restart count went up)
    SLURM_REQUEUES = "slurm requeues"
    #: nothing to do: Slurm is ending it for good (cancelled, out of time); it stays hibernated
    SLURM_ENDS = "slurm ends"


@dataclass(frozen=True)
class SlurmState:
    """What Slurm says of the job (``scontrol show job``)."""

    #: ``RUNNING``, ``COMPLETING``, ``PENDING``…
    state: str
    #: how many times Slurm requeued it so far
    restarts: int


def intent(signal: str) -> After:
    """What the supervisor means to do after hibernating for ``signal``: hold it, or requeue it."""
    return After.HOLD if signal == HOLD else After.REQUEUE


def asks_slurm(signal: str) -> bool:
    """Whether :func:`after_stop` needs Slurm's view of the job: after SIGTERM Slurm may be acting itself."""
    return signal == TERM


def after_stop(signal: str, restart_count: int, slurm: SlurmState | None = None) -> After:
    """What to do with the Slurm job (``restart_count``: this run's) once it is hibernated for ``signal``.

    ``slurm`` is needed when :func:`asks_slurm` says so (raises ValueError without it).
    """
    if asks_slurm(signal):
        if slurm is None:
            raise ValueError(f"after {signal} the decision needs Slurm's view of the job")
        if slurm.restarts > restart_count:
            return After.SLURM_REQUEUES
        if slurm.state != "RUNNING":
            return After.SLURM_ENDS
    return intent(signal)
