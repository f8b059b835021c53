"""The running system as torpor sees it: processes in /proc, PID namespaces, kernel features.

Also the raw system calls Python 3.11 lacks: ``unshare(CLONE_NEWPID | CLONE_NEWIPC)`` and
``prctl(PR_SET_CHILD_SUBREAPER)`` for the launcher, ``sync_file_range`` and ``syncfs`` for the store's folder backend; and the one way torpor
creates its own files and folders (:func:`open_private`, :func:`write_private`, :func:`make_private_dirs`):
private to their owner, and never through a symbolic link someone planted where torpor writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import mmap
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

CLONE_NEWPID = 0x20000000
CLONE_NEWIPC = 0x08000000
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NAME = 15
SYNC_FILE_RANGE_WRITE = 2
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
#: the umask of torpor's own processes (CLI, launcher, destager) and so of CRIU, their child: what they
#: create (images, logs, the database) is their owner's alone; a job runs with its caller's umask instead
PRIVATE_UMASK = 0o077
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare_job_namespaces() -> None:
    """The caller's next child becomes PID 1 of a new PID namespace, and the caller enters a new IPC one.

    Both are what CRIU needs of a job (docs/architecture.md): its own PIDs, free again at restore, and
    its own SysV shared memory, semaphores and message queues, which CRIU dumps only with their namespace.
    """
    _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWIPC), "unshare(CLONE_NEWPID | CLONE_NEWIPC)")


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


def mount_tmpfs(path: Path, options: str) -> None:
    """Mount a new tmpfs on ``path`` (e.g. ``huge=never,size=…``); raises OSError."""
    result = _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", 0, options.encode())
    _check(result, f"mount tmpfs on {path}")


def unmount(path: Path, lazy: bool = True) -> None:
    """Unmount ``path`` if something is mounted there (nothing happens otherwise).

    ``lazy``: detach it now and let the kernel free it once nothing uses it; else fail with EBUSY while
    a process has a file open in it. A symbolic link at ``path`` is not followed: it could lead to a
    mount that is not torpor's.
    """
    if not os.path.islink(path) and os.path.ismount(path):
        flags = (MNT_DETACH if lazy else 0) | UMOUNT_NOFOLLOW
        _check(_libc.umount2(os.fsencode(path), flags), f"umount {path}")


# -- torpor's own files --------------------------------------------------------------------------------


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


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Start writing ``fd``'s dirty pages to its disk now, without waiting (``sync_file_range``).

    ``length`` bytes from ``offset`` (0: to the end of the file). A later :func:`syncfs` then finds most
    of the data already written. Best effort: does nothing where the call is missing or refused (e.g. on
    tmpfs it has nothing to do).
    """
    _libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), SYNC_FILE_RANGE_WRITE)


_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached_pages(fd: int, offset: int = 0, length: int = -1) -> tuple[int, int]:
    """(pages in the page cache, pages) of ``length`` bytes of the file ``fd`` from ``offset`` (-1: to
    its end), clipped to the file: ``mincore`` of a mapping that is never touched, so nothing is read."""
    size = os.fstat(fd).st_size
    start = offset // _PAGE * _PAGE
    end = size if length < 0 else min(size, offset + length)
    if end <= start:
        return 0, 0
    address = _libc.mmap(None, end - start, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    try:
        vector = (ctypes.c_ubyte * (-(-(end - start) // _PAGE)))()
        _check(_libc.mincore(address, end - start, vector), "mincore")
        return sum(byte & 1 for byte in vector), len(vector)
    finally:
        _libc.munmap(address, end - start)


def syncfs(path: Path) -> None:
    """Make everything written to the file system holding ``path`` durable (one journal commit)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check(_libc.syncfs(fd), f"syncfs {path}")
    finally:
        os.close(fd)


def set_process_name(name: str) -> None:
    """The name ``ps -o comm`` and ``top`` show for this process (at most 15 bytes are kept)."""
    _check(_libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0), "prctl(PR_SET_NAME)")


def become_subreaper() -> None:
    """Orphaned descendants (e.g. a tree restored by ``criu restore -d``) are re-parented to us."""
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


# -- processes ----------------------------------------------------------------------------------------


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


def namespace_pid(pid: int) -> int | None:
    """``pid`` as its own PID namespace numbers it (the last of ``NSpid``), as CRIU names its images."""
    pids = _status(pid, "NSpid")
    return int(pids[-1]) if pids else None


_ZEROS = bytes(1 << 20)


def fill_with_zeros(fd: int, length: int) -> None:
    """Write ``length`` zero bytes at the start of the file ``fd``: on tmpfs, pages allocated and touched
    now, so that what is written there later is a plain copy. (``fallocate`` allocates tmpfs pages without
    touching them: on a virtual machine whose host took free memory back, the first write to each still
    waits for the host.)"""
    for offset in range(0, length, len(_ZEROS)):
        os.pwrite(fd, _ZEROS[: min(len(_ZEROS), length - offset)], offset)


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
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                        return True
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as maps:
                if any(prefix in line for line in maps):
                    return True
        except OSError:
            continue
    return False


def _socket_inodes(pid: int) -> list[int]:
    """Inodes of the sockets process ``pid`` has open (``/proc/PID/fd`` links ``socket:[N]``)."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.append(int(link[8:-1]))
    return found


def unix_socket_inodes(pids: list[int]) -> list[int]:
    """Inodes of the unix sockets ``pids`` hold (those ``/proc/PID/net/unix`` lists), sorted, once each."""
    held = {inode for pid in pids for inode in _socket_inodes(pid)}
    unix: set[int] = set()
    for pid in pids[:1]:
        try:
            with open(f"/proc/{pid}/net/unix") as table:
                next(table, None)  # the header
                unix = {int(line.split()[6]) for line in table if len(line.split()) > 6}
        except OSError:
            pass
    return sorted(held & unix)


def socket_holders(inode: int) -> list[tuple[int, str]]:
    """The processes that have socket ``inode`` open: (pid, command name), lowest pid first."""
    holders = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and inode in _socket_inodes(int(entry)):
            try:
                name = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            holders.append((int(entry), name))
    return sorted(holders)


class TcpAddress(NamedTuple):
    """A TCP address a socket is bound to; a tuple ``(host, port)``, so it is what ``socket.bind`` takes.

    ``host`` is as the kernel holds it: ``127.0.0.1``, ``0.0.0.0`` (every IPv4 address), ``::1``, ``::``.
    """

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Listener(NamedTuple):
    """A process listening on a TCP address: who holds a port."""

    pid: int
    name: str
    address: TcpAddress


_TCP_LISTEN = "0A"


def _tcp_listening(pid: int) -> dict[int, TcpAddress]:
    """The listening TCP sockets (v4 and v6) of ``pid``'s network namespace, by inode.

    ``/proc/PID/net/tcp{,6}`` print each address as the kernel's 32-bit words in host byte order and
    the port as a number; state ``0A`` is LISTEN.
    """
    found: dict[int, TcpAddress] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                next(lines, None)  # the header
                rows = [line.split() for line in lines]
        except OSError:
            continue
        for row in rows:
            if len(row) < 10 or row[3] != _TCP_LISTEN:
                continue
            hex_host, hex_port = row[1].split(":")
            raw = b"".join(
                int(hex_host[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_host), 8)
            )
            found[int(row[9])] = TcpAddress(str(ipaddress.ip_address(raw)), int(hex_port, 16))
    return found


def _net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def listening_sockets(pids: list[int]) -> list[TcpAddress]:
    """The TCP addresses (v4 and v6) on which ``pids`` listen, sorted, once each.

    Exactly as bound: a job that listens on 127.0.0.1:8000 is reported so, not as port 8000, so that
    whoever holds the port for it while it is away (adapters/wake.py) never listens wider than it did.
    A process gone meanwhile is left out.
    """
    found: set[TcpAddress] = set()
    for inodes, table in _with_tcp_table(pids, _tcp_listening):
        found.update(table[inode] for inode in inodes if inode in table)
    return sorted(found)


_Table = TypeVar("_Table", bound=Container[int])


def has_tcp_sockets(pids: list[int]) -> bool:
    """Whether any of ``pids`` holds a TCP socket (v4 or v6) that is bound, listening or connected: one
    the kernel lists in ``/proc/PID/net/tcp{,6}`` (a socket just created, never bound, is not there).

    A process gone meanwhile is left out.
    """
    return any(inode in table for inodes, table in _with_tcp_table(pids, _tcp_inodes) for inode in inodes)


def _with_tcp_table(pids: list[int], read: Callable[[int], _Table]) -> Iterator[tuple[list[int], _Table]]:
    """Each of ``pids``' socket inodes with its network namespace's TCP table as ``read(pid)`` gives it
    (read once per namespace); processes without sockets, or gone, are left out."""
    tables: dict[str | None, _Table] = {}
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        namespace = _net_namespace(pid)
        if namespace not in tables:
            tables[namespace] = read(pid)
        yield inodes, tables[namespace]


def _tcp_inodes(pid: int) -> set[int]:
    """The inodes of every TCP socket (any state) of ``pid``'s network namespace."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                next(lines, None)  # the header
                found.update(int(row[9]) for row in (line.split() for line in lines) if len(row) >= 10)
        except (OSError, ValueError):
            continue
    found.discard(0)  # sockets in TIME_WAIT and the like, which no process holds
    return found


def is_listening(address: TcpAddress) -> bool:
    """Whether a socket of this network namespace listens on exactly ``address`` now (no connection made:
    a server that is asked whether it is up, by connecting, sees a connection that says nothing)."""
    return address in _tcp_listening(os.getpid()).values()


def port_listeners(port: int) -> list[Listener]:
    """Every process of this network namespace listening on TCP ``port``, on any address, lowest pid first.

    What a refusal names ("port 8000 is in use by process 123 (nginx)"). Processes torpor may not look
    into are missed: an empty list means no one found, not that a bind will succeed.
    """
    on_port = {
        inode: address for inode, address in _tcp_listening(os.getpid()).items() if address.port == port
    }
    if not on_port:
        return []
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        for inode in _socket_inodes(pid):
            if inode in on_port:
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                found.add(Listener(pid, name, on_port[inode]))
    return sorted(found)


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


# -- kernel features (for `torpor doctor`) -------------------------------------------------------------


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


def join_cgroup(folder: Path) -> None:
    """Move the calling process into the cgroup ``folder`` (v1 or v2: both take a pid in ``cgroup.procs``)."""
    with open(folder / "cgroup.procs", "w") as procs:
        procs.write(str(os.getpid()))


def disk_free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


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
