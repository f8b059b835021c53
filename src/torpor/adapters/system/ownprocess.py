"""What a torpor process asks of the kernel for itself: the job's namespaces (``unshare``), its name and
the subreaper role (``prctl``), its cgroup, and CPUs kept awake while CRIU works (a PM QoS request).

The launcher calls most of it; other processes are :mod:`~torpor.adapters.system.procfs`'s.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from torpor.adapters.system.libc import check, libc

CLONE_NEWPID = 0x20000000
CLONE_NEWIPC = 0x08000000
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NAME = 15


def unshare_job_namespaces() -> None:
    """The caller's next child becomes PID 1 of a new PID namespace, and the caller enters a new IPC one.

    Both are what CRIU needs of a job (docs/architecture.md): its own PIDs, free again at restore, and
    its own SysV shared memory, semaphores and message queues, which CRIU dumps only with their namespace.
    """
    check(libc.unshare(CLONE_NEWPID | CLONE_NEWIPC), "unshare(CLONE_NEWPID | CLONE_NEWIPC)")


#: the kernel's PM QoS request for CPU wake-up latency: while a process holds it open with a value written
#: (an int32, microseconds), no CPU enters an idle state slower than that to wake up from
CPU_LATENCY_DEVICE = Path("/dev/cpu_dma_latency")


@contextlib.contextmanager
def cpu_wakeups_held(hold: bool = True, device: Path = CPU_LATENCY_DEVICE) -> Iterator[bool]:
    """Inside, keep every CPU out of idle states that are slow to leave (a PM QoS request of 0 µs: an
    idle CPU polls instead of halting); yields whether the request was made (``hold`` False: it is not).

    CRIU's dump and restore wake the other CPUs many times (page and TLB work); on a virtual machine
    whose idle CPUs halt, each wake-up goes through the host. Held for a 1 GiB dump here, CRIU froze the
    job 0.26-0.30 s instead of 0.42-0.50 s. Nothing changes where the device is missing, refused, or not
    the kernel's character device; the request ends when the file is closed (or this process dies).
    """
    if not hold:
        yield False
        return
    try:
        fd = os.open(device, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        made = stat.S_ISCHR(os.fstat(fd).st_mode)
        if made:
            try:
                os.write(fd, (0).to_bytes(4, sys.byteorder, signed=True))
            except OSError:
                made = False
        yield made
    finally:
        os.close(fd)


def set_process_name(name: str) -> None:
    """The name ``ps -o comm`` and ``top`` show for this process (at most 15 bytes are kept)."""
    check(libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0), "prctl(PR_SET_NAME)")


def become_subreaper() -> None:
    """Orphaned descendants (e.g. a tree restored by ``criu restore -d``) are re-parented to us."""
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def join_cgroup(folder: Path) -> None:
    """Move the calling process into the cgroup ``folder`` (v1 or v2: both take a pid in ``cgroup.procs``)."""
    with open(folder / "cgroup.procs", "w") as procs:
        procs.write(str(os.getpid()))
