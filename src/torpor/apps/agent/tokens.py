"""The files that hold an agent's secrets: its bearer token (``--token-file``), its TLS key (``--tls-key``)
and a peer's token (``torpor peers add --token-file``).

Each must be a regular file of the caller's that nobody else can read. A link (a shell's ``<(...)`` is a
link to a pipe) or a fifo is refused in one line that says what to give instead, and never waited on.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from torpor.errors import UnsafePath, UsageError

#: the shortest bearer token accepted
MIN_TOKEN_CHARS = 16


def read_private(path: Path, what: str) -> bytes:
    """The content of ``path`` (``what`` names it in errors: "the token file"), which must be a regular
    file of the caller's, mode 0600 or stricter."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a fifo must not block us
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link, or a shell's <(...), which is a link to a pipe
            raise UsageError(
                f"{what} {path} is a symbolic link: give a regular file of yours (chmod 600), "
                "not a link or a process substitution like <(...)"
            ) from None
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(
                f"{what} {path} is not a regular file (a pipe, a device or a folder): "
                "write it to a file of yours (chmod 600) and give its path"
            )
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise UnsafePath(
                f"{what} {path} must be a regular file of yours that only you can read (chmod 600 {path})"
            )
        return handle.read()


def read_token(path: Path) -> str:
    """The bearer token in ``path`` (:func:`read_private`), stripped, of at least 16 characters."""
    token = read_private(path, "the token file").decode(errors="replace").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise UsageError(
            f"the token in {path} is too short: use at least {MIN_TOKEN_CHARS} characters "
            "(e.g. openssl rand -hex 32)"
        )
    return token
