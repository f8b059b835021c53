"""Looking at a starting job for :mod:`torpor.policy.ready`: whether its port accepts a connection, and the
lines it appended to its log. (How much CPU its processes used is
:func:`torpor.adapters.system.procfs.cpu_seconds_with_children`.)

Each probe answers what it saw and does not judge it — the policy does, and
:func:`torpor.core.readiness.watch` loops over both — and none raises for what a job that is still
starting shows: a port refused, a log not created yet or half a line in it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

#: the most a :class:`LogFollower` reads in one call: what was written beyond is read by the next ones
MAX_READ = 1 << 20

#: a line longer than this without an end of line is cut into lines of this length
MAX_LINE = 64 << 10


def port_accepts(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host``:``port`` is accepted within ``timeout`` seconds.

    The connection is closed at once, without sending a byte (the job sees a client that connects and
    goes). Any failure to connect (refused, timed out, unreachable, a name that does not resolve) is
    False, never an exception. A listening socket accepts as soon as it listens: the kernel completes the
    handshake before the job calls accept(). It connects from the caller's network namespace.

    Until the job accepts it, the connection waits in the job's listening socket, which CRIU will not dump
    (``In-flight connection``, unless ``--skip-in-flight``); a job at its accept loop takes it and, seeing
    it closed, closes its end at once.
    """
    try:
        connection = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return False
    connection.close()
    return True


class LogFollower:
    """The complete lines appended to a log file from a given offset on, a few at each call.

    The file is opened by its path at each call, so a log not created yet only has no lines, and one
    replaced is followed in its new version. A file that became shorter than what was read (truncated, or
    replaced) is read again from its start.
    """

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        #: how far the file was read (a partial last line included)
        self.offset = offset
        self._partial = b""

    def new_lines(self) -> list[str]:
        """The lines completed since the last call (at most :data:`MAX_READ` bytes more are read), each
        without its end of line (``\\n`` or ``\\r\\n``), decoded as UTF-8 with undecodable bytes replaced
        (U+FFFD). A last line without its end of line waits for it, unless it grows past :data:`MAX_LINE`
        (it is cut into lines that long).
        """
        try:
            with open(self.path, "rb") as log:
                if os.fstat(log.fileno()).st_size < self.offset:
                    self.offset, self._partial = 0, b""
                log.seek(self.offset)
                data = log.read(MAX_READ)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        while len(self._partial) > MAX_LINE:
            complete.append(self._partial[:MAX_LINE])
            self._partial = self._partial[MAX_LINE:]
        return [line.removesuffix(b"\r").decode(errors="replace") for line in complete]
