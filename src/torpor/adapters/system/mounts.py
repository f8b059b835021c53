"""Mounting a tmpfs and unmounting it: the hot tier's RAM folder."""

from __future__ import annotations

import os
from pathlib import Path

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
