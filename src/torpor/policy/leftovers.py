"""Which hot tiers in RAM no state directory uses any more, and which of them ``torpor cleanup`` removes.

A state directory's hot tier lives outside it (``/dev/shm/torpor-<hash of home>``, a tmpfs of torpor's own
when run as root), so deleting the state directory leaves it behind, mounted and holding RAM, for good.
torpor writes the home it belongs to into the tier (``.home``), which tells such a leftover from a tier in
use: its home is gone. The decision is kept careful because a wrong one deletes checkpoints:

* the caller's own hot tier, and a tier whose home is there, are in use;
* a tier whose ``.home`` names a home whose tier has another name was not made so by torpor (copied,
  edited): left alone;
* a tier whose home is gone is a leftover; an empty one is removed, one that still holds images only with
  ``force`` (the home may be on a file system that is not mounted just now);
* a tier with no ``.home`` (made by a torpor older than the marker) tells nothing of its home: empty, it
  holds nothing to lose and is removed, unless it was made a moment ago (torpor writes the marker right
  after making the folder); holding images, it is left alone.

Pure: :func:`judge` works on what :mod:`torpor.core.store.leftovers` saw.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a folder without a marker younger than this may be one torpor is making now (the marker comes next)
UNMARKED_GRACE_S = 60.0


@dataclass(frozen=True)
class HotTierSeen:
    """One hot tier folder of the caller's, as the decision sees it."""

    path: str
    #: the state directory its ``.home`` names; ``None``: it has none
    home: str | None
    #: whether that state directory is there now
    home_exists: bool
    #: whether the folder's name is the one torpor gives the hot tier of ``home``
    named_for_home: bool
    #: whether it is the hot tier of the caller's own state directory
    current: bool
    #: entries in it besides ``.home`` (images, dumps in progress)
    entries: int
    #: seconds since the folder last changed
    age_s: float


@dataclass(frozen=True)
class Verdict:
    #: no state directory uses it
    stale: bool
    #: what ``torpor cleanup`` does with it (``force`` included)
    remove: bool
    #: why, for a person
    reason: str


def judge(seen: HotTierSeen, force: bool = False) -> Verdict:
    """Whether ``seen`` is a leftover, and whether it goes (``force``: even holding images)."""
    holds = f"{seen.entries} entr{'ies' if seen.entries != 1 else 'y'}"
    if seen.current:
        return Verdict(False, False, "the hot tier of this state directory")
    if seen.home is None:
        if seen.entries == 0 and seen.age_s >= UNMARKED_GRACE_S:
            return Verdict(True, True, "empty, and names no state directory (made by an older torpor)")
        if seen.entries == 0:
            return Verdict(False, False, "made a moment ago, and names no state directory yet")
        return Verdict(
            False,
            False,
            f"holds {holds} and names no state directory (made by an older torpor): left alone; "
            "if no state directory uses it, remove it by hand (umount, then rm -r)",
        )
    if not seen.named_for_home:
        return Verdict(False, False, f"names {seen.home}, whose hot tier has another name: left alone")
    if seen.home_exists:
        return Verdict(False, False, f"in use by {seen.home}")
    if seen.entries == 0:
        return Verdict(True, True, f"its state directory {seen.home} is gone, and it is empty")
    return Verdict(
        True,
        force,
        f"its state directory {seen.home} is gone, and it holds {holds}"
        + (
            ""
            if force
            else f": if {seen.home} is on a file system not mounted now, mount it; else remove it with --force"
        ),
    )
