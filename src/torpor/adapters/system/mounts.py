"""Mounting a tmpfs and unmounting it (the hot tier's RAM folder); what is mounted where (mountinfo)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from torpor.adapters.system.libc import check, libc

MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8


def mount_tmpfs(path: Path, options: str) -> None:
    """Mount a new tmpfs on ``path`` (e.g. ``huge=never,size=…``); raises OSError."""
    result = libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, options.encode())
    check(result, f"mount tmpfs on {path}")


def unmount(path: Path, lazy: bool = True) -> None:
    """Unmount ``path`` if something is mounted there (nothing happens otherwise).

    ``lazy``: detach it now and let the kernel free it once nothing uses it; else fail with EBUSY while
    a process has a file open in it. A symbolic link at ``path`` is not followed: it could lead to a
    mount that is not torpor's.
    """
    if not os.path.islink(path) and os.path.ismount(path):
        flags = (MNT_DETACH if lazy else 0) | UMOUNT_NOFOLLOW
        check(libc.umount2(os.fsencode(path), flags), f"umount {path}")


class Mount(NamedTuple):
    """One mount as mountinfo has it: the folder of its file system it shows (``root``), where
    (``point``), its type and options."""

    root: str
    point: Path
    fstype: str
    options: frozenset[str]


def parse(line: str) -> Mount:
    """One line of mountinfo: ``id parent dev root point opts [optional…] - fstype source superopts``."""
    fields = line.split()
    dash = fields.index("-")
    options = frozenset(fields[5].split(",")) | frozenset(fields[dash + 3].split(","))
    return Mount(_unescape(fields[3]), Path(_unescape(fields[4])), fields[dash + 1], options)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str, mountinfo: Path = Path("/proc/self/mountinfo")) -> Mount | None:
    """The mount ``path`` (absolute, links resolved) is on: the last mounted of the deepest points
    above it; None if mountinfo cannot be read."""
    try:
        table = [parse(line) for line in mountinfo.read_text().splitlines()]
    except (OSError, ValueError):
        return None
    best: Mount | None = None
    for mount in table:  # in mount order: a later mount on the same point hides an earlier one
        point = str(mount.point)
        above = path == point or path.startswith(point.rstrip("/") + "/")
        if above and (best is None or len(point) >= len(str(best.point))):
            best = mount
    return best
