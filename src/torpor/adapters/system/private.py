"""The one way torpor creates its own files and folders (:func:`open_private`, :func:`write_private`,
:func:`make_private_dirs`): private to their owner, and never through a symbolic link someone planted
where torpor writes; and whether a folder is one that others could swap under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

#: the umask of torpor's own processes (CLI, launcher, destager) and so of CRIU, their child: what they
#: create (images, logs, the database) is their owner's alone; a job runs with its caller's umask instead
PRIVATE_UMASK = 0o077


def open_private(path: Path, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` the way torpor opens every file it writes: never through a symbolic link.

    A link planted where torpor writes fails the open with ELOOP instead of redirecting the write to a
    file of someone else's choosing; a file it creates gets ``mode`` (its owner's alone).
    """
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` as the whole of file ``path`` (created 0600, or truncated; no link followed)."""
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the lock file ``path`` (created private if missing; kept after: a lock file unlinked while
    another waits on it would let a third take a new one) exclusively, one holder at a time."""
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def install_script(path: Path, text: str) -> Path:
    """Write the shell script ``text`` to ``path`` (0700: CRIU runs it as torpor's user), unless it is
    there already; atomically, so that a CRIU starting meanwhile runs the old one or the new one."""
    if not path.is_file() or path.is_symlink() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write_private(tmp, text.encode())
        tmp.chmod(0o700)
        os.replace(tmp, path)
    return path


def replaceable_by_others(path: Path) -> str | None:
    """Why a user other than torpor's (or root) could replace ``path`` or a folder above it; else None.

    Such a user could rename what torpor keeps there and put their own in its place, or swap a folder
    for a link. So each folder on the way, as given and as links resolve it, must be owned by root or
    torpor's user, and writable by nobody else unless sticky (as /tmp and /dev/shm are: there, others
    cannot rename what is not theirs); a link on the way must be owned by one of them too.
    """
    trusted = (0, os.geteuid())
    given = Path(os.path.abspath(path))
    for start in dict.fromkeys((given, Path(os.path.realpath(given)))):
        for folder in (start, *start.parents):
            try:
                found = os.lstat(folder)
            except FileNotFoundError:
                continue  # made later, by torpor
            except OSError as exc:
                return f"{folder} cannot be looked at ({exc.strerror})"
            if found.st_uid not in trusted:
                return f"{folder} is owned by uid {found.st_uid}, who could replace what it holds"
            if stat.S_ISDIR(found.st_mode) and found.st_mode & 0o022 and not found.st_mode & stat.S_ISVTX:
                return (
                    f"{folder} has mode {stat.S_IMODE(found.st_mode):04o}: other users could rename what "
                    "it holds (a shared folder needs the sticky bit, as /tmp has)"
                )
    return None


def make_private_dirs(path: Path) -> None:
    """Create folder ``path`` and any missing parents, each 0700 (``mkdir -p`` gives the parents the
    umask's mode); an existing folder is left as it is."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        if path.parent == path:
            raise
        make_private_dirs(path.parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
