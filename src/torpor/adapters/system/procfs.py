"""Processes as /proc shows them: their state, start time, PID namespace and its members, user, CPU time,
memory, command line, the devices and io_uring instances they hold; waking the stopped ones and waiting
for one to go; and the interpreter a script's ``#!`` line names.

Their sockets are :mod:`~torpor.adapters.system.sockets`'s.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    return raw[raw.rindex(")") + 2 :].split()


def process_state(pid: int) -> str | None:
    """One-letter state (R, S, D, T, t, Z, …) or None if there is no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def start_ticks(pid: int) -> int | None:
    """Start time in clock ticks since boot: with the pid, identifies one process across pid reuse."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def is_alive(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and state not in ("Z", "X")


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def own_pid_namespace() -> str:
    """The PID namespace of the calling process (``/proc/self``: its pid in a namespace of its own is not
    its pid in this /proc)."""
    return os.readlink("/proc/self/ns/pid")


def net_namespace_inode(pid: int | str) -> int | None:
    """The inode of ``pid``'s network namespace (``net:[INODE]``; ``"self"``: the caller's); None if there
    is no such process."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def in_own_pid_namespace() -> bool:
    """Whether the calling process runs in a PID namespace below the one ``/proc`` shows (a job's): its
    pid there is not its pid here."""
    return int(os.readlink("/proc/self")) != os.getpid()


def namespace_members(root_pid: int) -> list[int]:
    """All processes in the PID namespace whose init is ``root_pid`` (the whole job)."""
    namespace = pid_namespace(root_pid)
    if namespace is None:
        return []
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_namespace(int(entry)) == namespace:
            members.append(int(entry))
    return sorted(members)


def _status(pid: int, field: str) -> list[str] | None:
    """The words of one field of ``/proc/PID/status``; None if there is no such process or field."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:(.*)$", status, re.MULTILINE)
    return None if match is None else match.group(1).split()


def process_uid(pid: int) -> int | None:
    """The real uid of a process; None if there is no such process."""
    uids = _status(pid, "Uid")
    return int(uids[0]) if uids else None


def process_user(pid: int) -> str | None:
    """The user a process runs as (its real uid's name, or the number); None if there is no such process."""
    uid = process_uid(pid)
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system, seconds) the live processes among ``pids`` have used so far.

    From ``/proc/PID/stat`` (utime and stime, in clock ticks): cheap enough to read every second. A
    process that ended meanwhile counts nothing (its time goes with it).
    """
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
        ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_seconds_with_children(pids: list[int]) -> float:
    """Like :func:`cpu_seconds`, plus the CPU time of the children each of ``pids`` has waited for.

    ``cutime`` and ``cstime`` (fields 16 and 17 of proc(5)): whoever reaps a process takes its time, so over
    a whole PID namespace (whose init reaps the orphans) the sum does not lose a short-lived child that came
    and went between two readings. Children reaped by the kernel (their parent ignores SIGCHLD) are lost.
    """
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += sum(int(field) for field in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class MemoryUse:
    """What one process holds in memory (``/proc/PID/smaps_rollup``), in bytes."""

    pid: int
    #: its proportional share (PSS): a page mapped by n processes counts 1/n here
    proportional: int
    #: its private pages that no file holds (``Anonymous``, each counted in full): what CRIU writes
    #: into the process's pages file
    anonymous: int


def memory_use(pids: list[int]) -> list[MemoryUse]:
    """:class:`MemoryUse` of each process of ``pids`` that is still there.

    Reading it walks the page tables: 8-70 ms for 5 processes that each map 300 MiB, 30-65 ms per GiB
    mapped, on this busy 2-core machine (``statm``: 0.07 ms). A process whose smaps_rollup cannot be read
    counts its RSS (``statm``) as both.
    """
    found = []
    for pid in pids:
        values: dict[str, int] = {}
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    key, _, rest = line.partition(":")
                    if key in ("Pss", "Anonymous"):
                        values[key] = int(rest.split()[0]) << 10
        except (OSError, IndexError, ValueError):
            values = {}
        if "Pss" in values:
            found.append(MemoryUse(pid, values["Pss"], values.get("Anonymous", values["Pss"])))
            continue
        try:
            resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
        found.append(MemoryUse(pid, resident, resident))
    return found


def resident_bytes(pids: list[int]) -> int:
    """Memory ``pids`` have resident, each page counted once however many of them map it.

    The sum of their PSS (:func:`memory_use`), so memory shared between the job's processes (forked
    children, DataLoader workers, a shared mmap) counts once, as in the job's image, where summing their
    RSS counts it once per process. Pages shared with processes outside the job count for the job's share
    only.
    """
    return sum(use.proportional for use in memory_use(pids))


def swap_in_use() -> bool:
    """Whether this machine has a swap area on (``/proc/swaps`` lists one)."""
    try:
        with open("/proc/swaps") as swaps:
            return len(swaps.read().splitlines()) > 1
    except OSError:
        return True  # cannot tell: count swapped pages as pages


def namespace_pid(pid: int) -> int | None:
    """``pid`` as its own PID namespace numbers it (the last of ``NSpid``), as CRIU names its images."""
    pids = _status(pid, "NSpid")
    return int(pids[-1]) if pids else None


def resume_stopped(pids: list[int]) -> list[int]:
    """Send SIGCONT to any of ``pids`` left stopped; returns those it woke (the safety net of invariant 1)."""
    woken = []
    for pid in pids:
        if process_state(pid) in ("T", "t"):
            try:
                os.kill(pid, signal.SIGCONT)
                woken.append(pid)
            except ProcessLookupError:
                pass
    return woken


def wait_gone(pid: int, ticks: int | None, timeout: float) -> bool:
    """Wait until process ``pid`` (started at ``ticks``, if known) no longer exists."""
    deadline = time.monotonic() + timeout
    while True:
        current = start_ticks(pid)
        state = process_state(pid)
        if current is None or state in ("Z", "X") or (ticks is not None and current != ticks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def uses_device(pids: list[int], prefix: str) -> bool:
    """Whether any of ``pids`` has a file under ``prefix`` open or mapped (e.g. ``/dev/nvidia``)."""
    return any(_uses_device(pid, prefix) for pid in pids)


def device_users(pids: list[int], prefix: str) -> list[int]:
    """Those of ``pids`` that have a file under ``prefix`` open or mapped."""
    return [pid for pid in pids if _uses_device(pid, prefix)]


def device_files(pids: list[int], prefix: str) -> set[str]:
    """The paths under ``prefix`` that any of ``pids`` has open or mapped."""
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        found.add(target)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(prefix):
                        found.add(fields[5].rstrip("\n"))
    return found


def _uses_device(pid: int, prefix: str) -> bool:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    return True
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as maps:
            return any(prefix in line for line in maps)
    except OSError:
        return False


IO_URING = "anon_inode:[io_uring]"


def io_uring_users(pids: list[int]) -> list[int]:
    """Those of ``pids`` that hold an io_uring instance: a descriptor of one, or its rings mapped.

    A ring stays mapped after its descriptor is closed (or registered and closed, as liburing allows), so
    both the descriptors and the mappings are looked at; CRIU can dump neither.
    """
    users = []
    for pid in pids:
        try:
            found = False
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == IO_URING:
                        found = True
                        break
            if not found:
                with open(f"/proc/{pid}/maps") as maps:
                    found = any(line.rstrip().endswith(IO_URING) for line in maps)
        except OSError:  # gone meanwhile
            continue
        if found:
            users.append(pid)
    return users


def command_line(pid: int, limit: int = 120) -> str:
    """``pid``'s command line as one line (at most ``limit`` characters), or its name when it has none.

    A line too long has its absolute paths shortened to their last part first (``/long/venv/bin/python3``
    to ``python3``), so that the program and its script stay readable wherever they are installed.
    """
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        text = " ".join(w.decode(errors="replace") for w in words if w)
        if not text:
            text = "[" + Path(f"/proc/{pid}/comm").read_text().strip() + "]"
    except OSError:
        return "?"
    text = " ".join(text.split())  # one line, whatever newlines an argument (python -c) holds
    if len(text) > limit:
        text = " ".join(word.rsplit("/", 1)[-1] if word.startswith("/") else word for word in text.split(" "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def script_interpreter(path: str) -> list[str] | None:
    """The command line that runs the script at ``path``, from its ``#!`` line; None if it has none.

    pip writes scripts whose interpreter path is too long for ``#!`` as a ``/bin/sh`` script that execs
    ``'''exec' "PYTHON" "$0" "$@"``: that PYTHON is returned for those.
    """
    try:
        with open(path, "rb") as script:
            head = script.read(4096)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    lines = head.decode(errors="replace").splitlines()
    # Linux passes what follows the interpreter as one argument
    interpreter = lines[0][2:].strip().split(None, 1)
    if len(lines) > 1 and interpreter and interpreter[0] == "/bin/sh" and lines[1].startswith("'''exec' "):
        quoted = lines[1].split('"')
        return [quoted[1]] if len(quoted) > 2 else None
    return interpreter or None


def program_files(pids: list[int]) -> list[str]:
    """The regular files ``pids`` have mapped (the executable, shared libraries, mapped model files) or
    open read-only (what they read on from): the files that make the running program what it is.

    Files open for writing or mapped shared and writable are left out (the job's own output and data:
    it changes them, :func:`written_files`), and so are deleted ones and the ``/proc``, ``/sys`` and
    ``/dev`` entries. Sorted, once each; a process gone meanwhile is left out.
    """
    return _files(pids, written=False)


def written_files(pids: list[int]) -> list[str]:
    """The files ``pids`` have open for writing or mapped shared and writable (the job's own output and
    data), with the same exclusions as :func:`program_files`; those that are regular files are its."""
    return _files(pids, written=True)


def _files(pids: list[int], written: bool) -> list[str]:
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(None, 5)
                    writes_it = parts[1][1] == "w" and parts[1][3] == "s"  # shared and writable: its data
                    if len(parts) == 6 and parts[5].startswith("/") and writes_it == written:
                        found.add(parts[5].rstrip("\n"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if not target.startswith("/"):
                        continue
                    flags = Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:", 1)[1].split()[0]
                    if (int(flags, 8) & os.O_ACCMODE != os.O_RDONLY) == written:
                        found.add(target)
    return sorted(
        path
        for path in found
        if not path.endswith(" (deleted)") and not path.startswith(("/proc/", "/sys/", "/dev/"))
    )


def catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler of its own for signal ``sig`` (``SigCgt`` in its status)."""
    mask = _status(pid, "SigCgt")
    return mask is not None and bool(mask) and bool(int(mask[0], 16) >> (sig - 1) & 1)


def boot_id() -> str:
    """This boot's id: it changes when the machine restarts, and differs between machines."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
