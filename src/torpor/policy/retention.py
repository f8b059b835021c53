"""Retention: which of a job's checkpoints to delete so that only the newest ``keep_last`` remain.

A pure decision: it is given the job's checkpoints (id and creation time) and the pinned ids, and says
which ids to delete. Deleting them from the store and the records is the core's
(:func:`torpor.core.checkpoint.apply_retention`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Kept:
    """One checkpoint of the job, as retention sees it."""

    id: str
    created_at: float


def to_delete(checkpoints: Sequence[Kept], pinned: Collection[str], keep_last: int) -> list[str]:
    """The ids to delete, newest first: all but the newest ``keep_last``, except the pinned ones.

    1. ``keep_last`` <= 0 keeps everything (retention is off).
    2. The newest ``keep_last`` checkpoints are kept, pinned or not (a pinned one among them counts).
    3. Older ones are deleted unless pinned.
    Checkpoints created at the same moment keep the order they were given in (newest first after a
    stable sort), so the answer is deterministic.
    """
    if keep_last <= 0 or len(checkpoints) <= keep_last:
        return []
    newest_first = sorted(checkpoints, key=lambda c: c.created_at, reverse=True)
    return [c.id for c in newest_first[keep_last:] if c.id not in pinned]
