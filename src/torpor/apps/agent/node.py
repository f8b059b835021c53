"""What an agent holds of its node while it runs: its state directory's lock (one agent per
directory), and the memory controller its jobs get cgroups of."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from torpor.adapters import cgroups
from torpor.adapters.system import private
from torpor.errors import EnvironmentProblem, TorporError

log = logging.getLogger("torpor.agent")


def take_lock(path: Path) -> int:
    """Hold ``path`` locked for as long as the agent runs; a second agent on the same home is refused."""
    fd = private.open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise EnvironmentProblem(
            f"an agent already runs for {path.parent}" + (f" (pid {holder})" if holder else "")
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def memory_controller(home: Path) -> cgroups.MemoryController | None:
    """The memory controller the scheduler gives each job of ``home`` a cgroup of; None (and why, in the
    log) without."""
    detected = cgroups.detect_memory_controller()
    if isinstance(detected, cgroups.NoMemoryController):
        log.warning(
            "no memory cgroups for the jobs (%s): their usage is read from /proc alone", detected.reason
        )
        return None
    found = detected.scoped(cgroups.scope_of(home))
    try:
        found.prepare()
    except TorporError as exc:
        log.warning("no memory cgroups for the jobs: %s", exc.message)
        return None
    return found
