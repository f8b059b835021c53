"""Hot tiers that deleted state directories left in RAM: found for ``torpor doctor``, removed by ``torpor cleanup``.

A hot tier is a folder ``torpor-<12 hex digits>`` in ``/dev/shm`` (or in ``TORPOR_HOT_DIR``), often a
tmpfs of torpor's own, and names its state directory in :data:`~torpor.core.store.hotfolder.HOME_MARKER`.
:func:`survey` looks at the caller's own ones (a folder, not a link, of the caller's user: the others'
are theirs to judge) and asks :func:`torpor.policy.leftovers.judge` about each; :func:`remove` takes one
away: its tmpfs is unmounted first, and not lazily, so that one a process still has a file open in stays
(``EBUSY``) instead of vanishing from under it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torpor.adapters.system import mounts
from torpor.core.store.hot import used_by_entry
from torpor.core.store.hotfolder import HOME_MARKER, read_home_marker
from torpor.policy.leftovers import HotTierSeen, Verdict, judge
from torpor.settings import DEFAULT_HOT_PARENT, Settings, hot_name

#: the folder names torpor gives hot tiers (:func:`torpor.settings.hot_name`)
NAME = re.compile(r"torpor-[0-9a-f]{12}")


@dataclass(frozen=True)
class HotTierFound:
    """One hot tier folder of the caller's: what was seen, how much RAM it holds, what to do with it."""

    seen: HotTierSeen
    #: a tmpfs is mounted on it
    mounted: bool
    #: bytes its files take
    used_bytes: int
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return (
            asdict(self.seen)
            | {"mounted": self.mounted, "used_bytes": self.used_bytes}
            | asdict(self.verdict)
        )


def survey(settings: Settings, force: bool = False) -> list[HotTierFound]:
    """The caller's hot tiers in the places they are made, judged (``force``: as ``cleanup --force``)."""
    parents = [DEFAULT_HOT_PARENT] + ([settings.hot_dir] if settings.hot_dir is not None else [])
    found = []
    for parent in dict.fromkeys(parents):
        try:
            names = sorted(entry.name for entry in os.scandir(parent) if NAME.fullmatch(entry.name))
        except OSError:
            continue
        for name in names:
            tier = look(parent / name, settings, force)
            if tier is not None:
                found.append(tier)
    return found


def look(path: Path, settings: Settings, force: bool = False) -> HotTierFound | None:
    """The hot tier at ``path``, judged; ``None`` if it is not a folder of the caller's (or is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            return None
        home = read_home_marker(fd)
        entries = sum(1 for name in os.listdir(fd) if name != HOME_MARKER)
    finally:
        os.close(fd)
    seen = HotTierSeen(
        path=str(path),
        home=home,
        home_exists=home is not None and os.path.lexists(home),
        named_for_home=home is not None and hot_name(Path(home)) == path.name,
        current=path == settings.hot_path,
        entries=entries,
        age_s=time.time() - info.st_mtime,
    )
    return HotTierFound(seen, os.path.ismount(path), sum(used_by_entry(path).values()), judge(seen, force))


def remove(tier: HotTierFound) -> str | None:
    """Unmount and delete ``tier``; what went wrong, for a person, or ``None``."""
    path = Path(tier.seen.path)
    try:
        mounts.unmount(path, lazy=False)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            return "a process still has a file open in it: left mounted (see fuser -vm on it)"
        return f"cannot unmount it: {exc.strerror}"
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"cannot remove it: {exc.strerror}"
    # the lock file an older torpor made beside its hot tier (unlink follows no link)
    with contextlib.suppress(OSError):
        (path.parent / f".{path.name}.mount-lock").unlink(missing_ok=True)
    return None
