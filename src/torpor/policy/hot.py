"""Which images leave the hot tier, and when: RAM is for the job, the next dump and a fast restore.

Four decisions about copies of images in RAM; the first three about copies that are no longer the only
one (their manifest is in the cold tier, state ``durable``):

* :func:`after_durable` — once an image became durable, which hot copies go: a hibernation's own
  (hibernating is for freeing memory), else the older durable copies of the same job (a restore wants a
  job's newest checkpoint; older copies only hold RAM that the job, the next dump and the page cache need:
  dumps slowed down as such copies piled up).
* :func:`make_room` — which durable copies go so that ``need`` more bytes fit: oldest first, until the
  tier stays within its capacity *and* its file system has the room.
* :func:`to_take_over` — which copy gives its memory to a new checkpoint or hibernation of its job: its
  pages are written over that copy's, memory that is already there, instead of memory allocated (and,
  on a virtual machine whose host took free memory back, faulted in) for the new one.
* :func:`read_back_soon` — whether the cold tier's copy of an image will be read soon, so that storing
  it should leave its bytes in the page cache: only where the RAM copy goes once durable.

All four are pure: they work on the sizes, states and kinds they are given and return ids (or, for
:func:`read_back_soon`, a yes or no). Measuring the tier, removing folders and logging are
:class:`torpor.core.store.hot.HotTier`'s and the destager's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the state of a hot copy whose manifest is in the cold tier (as :mod:`torpor.core.store.base` names it)
DURABLE = "durable"

#: the kind of checkpoint whose RAM copy goes as soon as it is durable
HIBERNATE = "hibernate"


@dataclass(frozen=True)
class HotCopy:
    """One image in the hot tier, as the decisions see it."""

    id: str
    job: str
    #: ``staged``, ``destaging`` or ``durable``: only a durable copy may be dropped
    state: str
    created_at: float
    #: the checkpoint's kind (``hibernate``, …); ``None`` when its record does not say
    kind: str | None = None
    #: bytes it takes in the tier: what dropping it gives back
    size: int = 0


@dataclass(frozen=True)
class Tier:
    """The hot tier as measured once: its copies, and the bytes it and its file system have."""

    copies: Sequence[HotCopy]
    #: bytes the whole tier takes now (its copies, and dumps or restores in progress)
    used: int
    #: the most bytes the tier may take
    capacity: int
    #: bytes free on the tier's file system (others may use it too, e.g. all of /dev/shm)
    free: int


@dataclass(frozen=True)
class Room:
    """What :func:`make_room` decided: the copies to drop, oldest first, and whether ``need`` then fits."""

    drop: tuple[str, ...]
    fits: bool


def after_durable(copy: HotCopy, others: Sequence[HotCopy]) -> tuple[str, ...]:
    """The ids of the hot copies to drop now that ``copy`` is durable (``others``: the tier's copies).

    A hibernation's own copy goes, and nothing else; any other checkpoint makes the older durable
    copies of its job go, in the order given.
    """
    if copy.kind == HIBERNATE:
        return (copy.id,)
    return tuple(
        other.id
        for other in others
        if other.job == copy.job and other.state == DURABLE and other.created_at < copy.created_at
    )


def to_take_over(job: str, copies: Sequence[HotCopy]) -> str | None:
    """The copy whose memory a new checkpoint of ``job`` takes over: the job's newest durable copy (the
    cold tier holds it too, so a restore of it reads from there), or None when it has none. A new
    checkpoint would make it go once durable anyway (:func:`after_durable`); a hibernation is there to
    free the job's memory, which that copy only holds more of."""
    durable = [copy for copy in copies if copy.job == job and copy.state == DURABLE]
    return max(durable, key=lambda copy: copy.created_at).id if durable else None


def read_back_soon(kind: str | None) -> bool:
    """Whether the cold tier's copy of an image of ``kind`` (``None``: unknown) is read soon after it
    is stored.

    A hibernation's will: its RAM copy goes once durable (:func:`after_durable`), and its resume reads
    the cold tier, at the speed of memory while the page cache still holds what was written. Any
    other checkpoint stays in RAM as its job's newest copy, which a restore reads; written through the
    page cache, its bytes would be there twice, pushing out pages others use, in memory allocated for
    them (on a virtual machine whose host took free memory back, faulted in page by page).
    """
    return kind == HIBERNATE


def make_room(tier: Tier, need: int) -> Room:
    """Durable copies to drop, oldest first, until ``need`` more bytes fit; and whether they then do.

    They fit when the tier stays within its capacity and its file system has the room. A dropped copy
    gives back its ``size`` to both; copies that are not durable are kept, however old.
    """
    used, free = tier.used, tier.free
    drop: list[str] = []

    def fits() -> bool:
        return used + need <= tier.capacity and need <= free

    for copy in sorted(tier.copies, key=lambda c: c.created_at):
        if fits():
            return Room(tuple(drop), True)
        if copy.state == DURABLE:
            drop.append(copy.id)
            used, free = used - copy.size, free + copy.size
    return Room(tuple(drop), fits())
