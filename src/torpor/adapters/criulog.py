"""Why a CRIU run failed, in torpor's words: the lines of its log that explain it, and the error a failed
dump raises (a full disk, the job gone, a refusal because of whom a process runs as, a unix socket
connected outside the job).

Running CRIU is :mod:`torpor.adapters.criu`'s; only it and the core's checkpoint read these.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torpor.adapters.system import disk, procfs, sockets
from torpor.errors import CheckpointFailed, JobExited, StorageFull, TorporError

#: lines CRIU prints on every run here that explain nothing (no CAP_SYS_RESOURCE for RLIMIT_NOFILE)
NOISE = re.compile(r"RLIMIT_NOFILE")
_ERROR_LINE = re.compile(r"\b(Error|Warn)\s*\(")
# CRIU's -v4 lines about each unix socket it collected, and about the outside one that failed the dump
_UNIX_LINE = re.compile(
    r"unix:\s+(Collected|Dumping|Runaway socket): ino (\d+) peer_ino (\d+) family\s+\d+ type\s+(\d+) .* name (.*)$"
)
_SOCK_DGRAM = 2
#: the torpor option that lets a dump through a unix socket connected outside the job
EXT_UNIX_SK_OPTION = "--ext-unix-sk"

# What CRIU logs when it may not read another user's limits, and when the tree's first process (not root)
# could not mount a /proc of its own: CRIU needs one to dump a tree in a PID namespace /proc is not of
_RLIMIT_REFUSED = re.compile(r"Can't get rlimit \d+: Operation not permitted")
_NO_PROC = "Can't get proc fd"  # the tree's first process could not mount a /proc of its PID namespace
_TASK = re.compile(r"\(pid: (\d+)\)")
#: the parasite found the folder it mounts a /proc on there already (torpor.policy.retry.BUSY_CWD_ERRORS)
_BUSY_CWD = "Can't create a directory (-17)"


def _dump_refusal(details: list[str]) -> str | None:
    """torpor's words for a dump CRIU refused because of whom a process of the tree runs as."""
    pid = next((int(m.group(1)) for line in details if (m := _TASK.search(line))), None)
    who = f"pid {pid}, user {procfs.process_user(pid) or '?'}" if pid else "pid ?"
    if any(_RLIMIT_REFUSED.search(line) for line in details):
        return (
            f"criu may not read the resource limits of a process of another user ({who}): root here lacks"
            " CAP_SYS_RESOURCE; run 'make setup' (it builds torpor's rlimit shim for criu with gcc;"
            " 'torpor doctor' says whether it works) or give root CAP_SYS_RESOURCE"
        )
    if pid and any(_NO_PROC in line for line in details) and procfs.process_uid(pid) not in (0, None):
        return (
            f"the job's first process ({who}) does not run as root, and CRIU cannot dump such a job in its"
            " own PID namespace; start the command through a parent that stays root, e.g."
            " 'torpor run -- runuser -u USER -- COMMAND' (setpriv, su-exec and gosu replace themselves by it)"
        )
    if pid and any(_BUSY_CWD in line for line in details):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = "?"
        return (
            f"CRIU could not create its folder proc.crtools in the working directory of the job's first"
            f" process ({cwd}): one is there, and stayed through every attempt; remove it (a CRIU killed"
            " while dumping a job of that folder leaves one: torpor removes one of root's a few"
            " seconds old)"
        )
    return None


def log_excerpt(log_path: Path, limit: int = 12) -> list[str]:
    """The CRIU log lines that explain a failure: its errors, or failing that, its last lines."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    lines = [line for line in lines if not NOISE.search(line)]
    errors = [line.strip() for line in lines if _ERROR_LINE.search(line)]
    chosen = errors if errors else [line.strip() for line in lines[-limit:]]
    # the same complaint repeated for every image file says nothing new: keep its first occurrence
    seen: set[str] = set()
    unique = []
    for line in chosen:
        key = line.split(")", 1)[-1]
        if key not in seen:
            seen.add(key)
            unique.append(line)
    return unique[-limit:]


FULL_BELOW = 1 << 20
"""A file system with less free space than this (1 MiB) is taken for the reason a dump writing there failed."""


def _full(*paths: Path) -> bool:
    for path in paths:
        try:
            if disk.disk_free(path) < FULL_BELOW:
                return True
        except OSError:
            continue
    return False


def dump_failure(pid: int, images_dir: Path, log_path: Path, status: int, output: str) -> TorporError:
    """The error a dump of ``pid`` that exited with ``status`` failed with, from its log and the disk."""
    details = log_excerpt(log_path) or [output.strip()]
    text = "\n".join(details)
    # on a full file system CRIU's own log, written there too, may be cut before it says why
    if "No space left on device" in text or "ENOSPC" in text or _full(images_dir, log_path.parent):
        return StorageFull(
            f"no space left on the device of {images_dir.parent} while dumping: free space there"
            " or move TORPOR_HOME",
            details=details,
        )
    if not Path(f"/proc/{pid}").exists():
        return JobExited("the job exited while it was being checkpointed", details=details)
    if refusal := _dump_refusal(details):
        return CheckpointFailed(f"{refusal}; the job was left running", details=details)
    external = external_socket_problem(log_path)
    if external is not None:
        return CheckpointFailed(external, details=details)
    return CheckpointFailed(
        f"criu dump failed (exit status {status}); the job was left running", details=details
    )


def external_socket_problem(log_path: Path) -> str | None:
    """What a dump CRIU refused with "External socket is used" met, in torpor's words; None otherwise.

    CRIU names the outside socket (its ``Runaway socket`` line) and the job's sockets it dumped (its
    ``Dumping`` lines), among which the one connected to it; the outside process is found by the socket
    it holds.
    """
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    names: dict[int, str] = {}
    types: dict[int, int] = {}
    peers: dict[int, int] = {}  # the job's sockets: ino → the ino of its peer
    outside: int | None = None
    for line in lines:
        match = _UNIX_LINE.search(line)
        if match is None:
            continue
        kind, ino, peer, name = match.group(1), int(match.group(2)), int(match.group(3)), match.group(5)
        names.setdefault(ino, "" if name == "null" else name.strip())
        types.setdefault(ino, int(match.group(4)))
        if kind == "Dumping":
            peers[ino] = peer
        elif kind == "Runaway socket":
            outside = ino
    if outside is None:
        return None
    # a stream peer names the job's end as its own peer; a datagram receiver is connected to nobody
    inside = next((ino for ino, peer in peers.items() if peer == outside), 0)
    holders = sockets.socket_holders(outside)
    who = ", ".join(f"pid {pid} ({name})" for pid, name in holders) or "a process torpor cannot see"
    if names.get(inside):
        what = f"{who}, outside the job, is connected to the job's unix socket {names[inside]}"
    elif names.get(outside):
        what = f"the job is connected to the unix socket {names[outside]} of {who}, outside the job"
    else:
        what = f"the job shares a unix socket pair with {who}, outside the job"
    if types.get(inside) == _SOCK_DGRAM and names.get(outside):
        after = "sends to that address again"  # CRIU connects a datagram socket to its peer's name again
    else:
        after = "sees that connection closed"
    return (
        f"{what}: CRIU cannot save the outside end; close that connection, or checkpoint or hibernate with"
        f" {EXT_UNIX_SK_OPTION} (a job restored from that checkpoint then {after})"
    )
