"""The machine itself, for ``torpor doctor`` and the agent: kernel features, torpor's capabilities, the
machine's memory, whether systemd is shutting it down.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelFeatures:
    kernel: str
    cgroups: str
    psi: bool
    userfaultfd: bool


def kernel_features() -> KernelFeatures:
    cgroup2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    has_v1 = Path("/sys/fs/cgroup/memory").is_dir()
    unified = Path("/sys/fs/cgroup/unified").is_dir()
    if cgroup2:
        cgroups = "v2"
    elif has_v1 and unified:
        cgroups = "v1 hybrid (memory controller on v1)"
    elif has_v1:
        cgroups = "v1"
    else:
        cgroups = "none found"
    return KernelFeatures(
        kernel=os.uname().release,
        cgroups=cgroups,
        psi=Path("/proc/pressure/memory").exists(),
        userfaultfd=Path("/proc/sys/vm/unprivileged_userfaultfd").exists()
        or Path("/dev/userfaultfd").exists(),
    )


#: the capability that lets a process read and raise the resource limits of another user's processes
CAP_SYS_RESOURCE = 24


def has_capability(cap: int) -> bool | None:
    """Whether torpor's own process has capability ``cap`` in effect (CapEff); None if /proc says nothing."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"^CapEff:\s+([0-9a-fA-F]+)$", status, re.MULTILINE)
    return None if match is None else bool(int(match.group(1), 16) >> cap & 1)


def memory_total() -> int:
    """The machine's memory (MemTotal), in bytes."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemTotal in /proc/meminfo")


def system_stopping() -> bool | None:
    """True while systemd shuts the machine down, False while it runs; None where systemd does not run it.

    ``systemctl is-system-running`` says ``stopping`` from the moment a shutdown or reboot begins.
    """
    if not Path("/run/systemd/system").is_dir():
        return None
    try:
        state = subprocess.run(
            ["systemctl", "is-system-running"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return state == "stopping"
