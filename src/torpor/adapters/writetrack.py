"""Which pages a running process wrote since a moment chosen from outside it (issue 31's building block):
userfaultfd write-protection in asynchronous mode, read with the ``PAGEMAP_SCAN`` ioctl (Linux ≥ 6.7).

CRIU's own incremental dumps read soft-dirty bits, which kernels built without ``CONFIG_MEM_SOFT_DIRTY``
(this project's machines) lack. The kernel's designed replacement: a userfaultfd created with
``UFFD_FEATURE_WP_ASYNC`` write-protects pages whose faults the kernel resolves by itself (the process
never waits on anyone), and ``PAGEMAP_SCAN`` on ``/proc/PID/pagemap`` lists the pages written since they
were protected, protecting them again in the same call.

A userfaultfd belongs to the address space of the process that creates it, so :func:`track` makes one
*inside* the process: it stops one thread with ptrace (``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT``), makes it
run the ``userfaultfd`` system call at a ``syscall`` instruction of its vDSO (nothing of the process is
written), takes the descriptor with ``pidfd_getfd``, makes the thread close its own copy (CRIU cannot
dump a process holding one), restores the thread's registers — an interrupted system call restarted
as the kernel would have — and detaches. Everything after that happens from outside: the ranges are
registered and scanned through torpor's own descriptors. The process runs on all along except for
those few system calls, and its writes cost it nothing measurable (the kernel resolves each first
write to a protected page in place).

What is tracked: the private writable mappings that exist when :meth:`Tracker.protect` runs. A mapping
made later is not (:meth:`Tracker.protect` again registers it, and its pages count as written), and a
child forked later is another address space (its own :func:`track`). x86-64 only. Nothing here decides
when to scan or what to copy: that is the caller's (issue 31).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torpor.adapters.system import procfs
from torpor.errors import NotTrackable

PAGE_SIZE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

# x86-64 system call numbers
_NR_CLOSE = 3
_NR_USERFAULTFD = 323
_NR_PIDFD_OPEN = 434
_NR_PIDFD_GETFD = 438

# ptrace requests and options
_PTRACE_GETREGS = 12
_PTRACE_SETREGS = 13
_PTRACE_SYSCALL = 24
_PTRACE_DETACH = 17
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PTRACE_O_TRACESYSGOOD = 1

# <linux/userfaultfd.h> (Debian 12's headers are older than WP_ASYNC)
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_REGISTER_MODE_WP = 1 << 1

# <linux/fs.h>: PAGEMAP_SCAN
_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_PM_SCAN_WP_MATCHING = 1 << 0
_PAGE_IS_WPALLOWED = 1 << 0
_PAGE_IS_WRITTEN = 1 << 1
_PAGE_IS_FILE = 1 << 2
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_SWAPPED = 1 << 4
_PAGE_IS_PFNZERO = 1 << 5

# an interrupted system call's return values the kernel restarts it on (include/linux/errno.h)
_ERESTARTSYS, _ERESTARTNOINTR, _ERESTARTNOHAND, _ERESTART_RESTARTBLOCK = 512, 513, 514, 516
_NR_RESTART_SYSCALL = 219

#: the end of x86-64's user address space (TASK_SIZE_MAX): a scan may not reach past it
_USER_END = (1 << 47) - PAGE_SIZE

#: the signals that stop a process (a group stop)
_STOP_SIGNALS = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})

#: waitpid() for any thread, a child or not (__WALL)
_WALL = 0x40000000

#: how long a helper may take to make a process run one system call
_INJECT_TIMEOUT_S = 20

#: page regions one scan returns at most (a run of written pages is one region)
_REGIONS = 4096


class _Regs(ctypes.Structure):
    """``struct user_regs_struct`` of x86-64."""

    _fields_ = [
        (name, ctypes.c_ulonglong)
        for name in [
            "r15",
            "r14",
            "r13",
            "r12",
            "rbp",
            "rbx",
            "r11",
            "r10",
            "r9",
            "r8",
            "rax",
            "rcx",
            "rdx",
            "rsi",
            "rdi",
            "orig_rax",
            "rip",
            "cs",
            "eflags",
            "rsp",
            "ss",
            "fs_base",
            "gs_base",
            "ds",
            "es",
            "fs",
            "gs",
        ]
    ]


class _ScanArg(ctypes.Structure):
    """``struct pm_scan_arg``."""

    _fields_ = [
        (name, ctypes.c_ulonglong)
        for name in [
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        ]
    ]


class _Region(ctypes.Structure):
    """``struct page_region``."""

    _fields_ = [
        ("start", ctypes.c_ulonglong),
        ("end", ctypes.c_ulonglong),
        ("categories", ctypes.c_ulonglong),
    ]


@dataclass(frozen=True)
class Range:
    """``length`` bytes of a process's memory from ``start``."""

    start: int
    length: int


class Tracker:
    """The pages one process writes, from outside it: :meth:`protect` starts a period, :meth:`written`
    ends it (and starts the next). Close it (or leave the ``with``) to stop tracking."""

    def __init__(self, pid: int, uffd: int) -> None:
        self.pid = pid
        self._uffd = uffd
        self._pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        self._registered: set[tuple[int, int]] = set()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop tracking: the process's protections go with torpor's descriptor (no fault waits on it)."""
        for fd in (self._pagemap, self._uffd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pagemap = self._uffd = -1

    def protect(self) -> list[Range]:
        """Register the process's private writable mappings not registered yet, and write-protect every
        page: what it writes from now on is what :meth:`written` returns. The mappings newly registered
        (the first call: all of them)."""
        new = [
            each for each in _writable_mappings(self.pid) if (each.start, each.length) not in self._registered
        ]
        for each in new:
            register = struct.pack("QQQQ", each.start, each.length, _UFFDIO_REGISTER_MODE_WP, 0)
            buffer = ctypes.create_string_buffer(register, len(register))
            if _libc.ioctl(self._uffd, _UFFDIO_REGISTER, buffer) != 0:
                code = ctypes.get_errno()
                if code in (errno.EINVAL, errno.ENOMEM):  # unmapped meanwhile, or not one uffd takes
                    continue
                raise NotTrackable(f"cannot register memory of process {self.pid}: {os.strerror(code)}")
            self._registered.add((each.start, each.length))
        self._scan(_PAGE_IS_WPALLOWED, collect=False)
        return new

    def ranges(self) -> list[Range]:
        """The memory registered for tracking, in address order (what :meth:`protect` has registered)."""
        return [Range(start, length) for start, length in sorted(self._registered)]

    def present(self, swapped: bool) -> list[Range]:
        """The pages of the registered memory that hold something, as CRIU would dump them: not the
        shared zero page, not a private file page never written; in RAM, and with ``swapped`` in swap
        too. A protected page never touched looks swapped to the kernel's scan (its marker), so a
        machine without swap asks without ``swapped``; reading such a page gives zeros either way."""
        anyof = _PAGE_IS_PRESENT | (_PAGE_IS_SWAPPED if swapped else 0)
        return self._scan(
            anyof, collect=True, wp=False, inverted=_PAGE_IS_PFNZERO | _PAGE_IS_FILE, anyof=anyof
        )

    def written(self, protect: bool = True) -> list[Range]:
        """The pages written since :meth:`protect` or the last call, in address order, merged into runs;
        they are protected again in the same scan, so a write during it lands in this answer or the
        next, never in neither. ``protect=False``: only look (the period goes on)."""
        return self._scan(_PAGE_IS_WRITTEN, collect=True, wp=protect)

    def _scan(
        self, category: int, collect: bool, wp: bool = True, inverted: int = 0, anyof: int = 0
    ) -> list[Range]:
        found: list[Range] = []
        regions = (_Region * _REGIONS)()
        spans = [(each.start, each.start + each.length) for each in self.spans()] if not wp else []
        for start, end in spans or ([(0, _USER_END)] if wp else []):
            self._scan_span(start, end, regions, category, collect, wp, inverted, anyof, found)
        return found

    def spans(self) -> list[Range]:
        """:meth:`ranges` merged where they meet or overlap (a mapping registered again once it grew)."""
        return merged(self.ranges())

    def _scan_span(
        self,
        start: int,
        end: int,
        regions: ctypes.Array[_Region],
        category: int,
        collect: bool,
        wp: bool,
        inverted: int,
        anyof: int,
        found: list[Range],
    ) -> None:
        while start < end:
            arg = _ScanArg(
                size=ctypes.sizeof(_ScanArg),
                flags=_PM_SCAN_WP_MATCHING if wp else 0,  # with it, mappings not registered are skipped
                start=start,
                end=end,
                vec=ctypes.addressof(regions),
                vec_len=_REGIONS,
                category_inverted=inverted,
                # with an anyof mask (present()): only the zero page and file pages are excluded
                category_mask=inverted if anyof else category,
                category_anyof_mask=anyof,
                return_mask=category,
            )
            count = _libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
            if count < 0:
                code = ctypes.get_errno()
                raise NotTrackable(f"cannot scan the memory of process {self.pid}: {os.strerror(code)}")
            if collect:
                for region in regions[:count]:
                    if found and found[-1].start + found[-1].length == region.start:
                        found[-1] = Range(found[-1].start, region.end - found[-1].start)
                    else:
                        found.append(Range(region.start, region.end - region.start))
            if arg.walk_end <= start or count < _REGIONS:
                break
            start = arg.walk_end


def track(pid: int) -> Tracker:
    """Track the pages process ``pid`` writes (one address space: each process of a tree needs its own);
    its memory is protected at once (:meth:`Tracker.protect`). NotTrackable, in one line, where it
    cannot be: not x86-64, a kernel without asynchronous write-protection, a process torpor may not
    trace (or one traced already: CRIU, a debugger)."""
    if platform.machine() != "x86_64":
        raise NotTrackable(f"tracking a process's writes is built for x86-64, not {platform.machine()}")
    if procfs.process_state(pid) in ("T", "t"):  # making it run a call would let it run on after
        raise NotTrackable(f"process {pid} is stopped: its writes are tracked from while it runs")
    theirs = _inject_apart(pid, _NR_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
    if theirs < 0:
        raise NotTrackable(f"process {pid} cannot make a userfaultfd: {os.strerror(-theirs)}")
    try:
        uffd = _take_fd(pid, theirs)
    finally:
        _inject_apart(pid, _NR_CLOSE, theirs, if_stopped=True)  # stopped meanwhile: it must not keep it
    try:
        api = ctypes.create_string_buffer(
            struct.pack("QQQ", _UFFD_API, _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED, 0), 24
        )
        if _libc.ioctl(uffd, _UFFDIO_API, api) != 0:
            code = ctypes.get_errno()
            raise NotTrackable(
                f"this kernel has no asynchronous userfaultfd write-protection ({os.strerror(code)}): "
                "Linux 6.7 or later is needed"
            )
        tracker = Tracker(pid, uffd)
    except OSError as exc:  # its pagemap: it ended meanwhile
        os.close(uffd)
        raise NotTrackable(f"cannot read the page table of process {pid}: {exc.strerror}") from None
    except BaseException:
        os.close(uffd)
        raise
    try:
        tracker.protect()
    except BaseException:
        tracker.close()
        raise
    return tracker


def merged(ranges: Iterable[Range]) -> list[Range]:
    """``ranges`` in address order, those that meet or overlap made one."""
    found: list[Range] = []
    for each in sorted(ranges, key=lambda r: r.start):
        end = each.start + each.length
        if found and found[-1].start + found[-1].length >= each.start:
            last = found[-1]
            found[-1] = Range(last.start, max(last.start + last.length, end) - last.start)
        else:
            found.append(each)
    return found


def probe() -> str | None:
    """Whether this machine can track a process's writes (``torpor doctor``): None if it can, else why
    not, in one line. Tracks a short-lived child of its own (``sleep``) and lets it go."""
    child = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        # Popen returns once exec began, before the kernel mapped the new program's vDSO: until it sleeps
        deadline = time.monotonic() + 5
        while procfs.process_state(child.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.005)
        with track(child.pid) as tracker:
            tracker.written()
        return None
    except NotTrackable as exc:
        return exc.message
    finally:
        child.kill()
        child.wait()


def _writable_mappings(pid: int) -> Iterator[Range]:
    """The private writable mappings of ``pid`` (anonymous memory, heap, stacks, private file pages),
    not the kernel's own (vDSO, vvar, vsyscall)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            name = fields[5].strip() if len(fields) > 5 else ""
            if fields[1][1] != "w" or fields[1][3] != "p" or name.startswith("[v"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            yield Range(start, end - start)


def _take_fd(pid: int, fd: int) -> int:
    """A descriptor of ours for process ``pid``'s descriptor ``fd`` (``pidfd_getfd``)."""
    pidfd = _libc.syscall(_NR_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        raise NotTrackable(f"cannot open process {pid}: {os.strerror(ctypes.get_errno())}")
    try:
        ours = _libc.syscall(_NR_PIDFD_GETFD, pidfd, fd, 0)
        if ours < 0:
            raise NotTrackable(
                f"cannot take the userfaultfd of process {pid}: {os.strerror(ctypes.get_errno())}"
            )
        return int(ours)
    finally:
        os.close(pidfd)


def _vdso_syscall(pid: int) -> int:
    """The address of a ``syscall`` instruction in ``pid``'s vDSO (its fallbacks make real calls)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            vdso = [line for line in maps if line.rstrip().endswith("[vdso]")]
        if not vdso:
            raise NotTrackable(f"process {pid} has no vDSO to make a system call from")
        start, end = (int(x, 16) for x in vdso[0].split()[0].split("-"))
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            mem.seek(start)
            code = mem.read(end - start)
    except OSError as exc:
        raise NotTrackable(f"cannot read process {pid}: {exc.strerror}") from None
    at = code.find(b"\x0f\x05")
    if at < 0:
        raise NotTrackable(f"no system call instruction found in the vDSO of process {pid}")
    return start + at


def _ptrace(request: int, pid: int, addr: int = 0, data: object = None) -> None:
    argument = (
        ctypes.cast(ctypes.byref(data), ctypes.c_void_p) if isinstance(data, ctypes.Structure) else data
    )
    if _libc.ptrace(request, pid, addr, argument) != 0:
        code = ctypes.get_errno()
        raise NotTrackable(f"cannot trace process {pid}: {os.strerror(code)}")


def _wait_stop(pid: int) -> int:
    """Wait until the traced thread ``pid`` stops; the stop's signal (SIGTRAP | 0x80: a system call)."""
    while True:
        _, status = os.waitpid(pid, _WALL)
        if os.WIFSTOPPED(status):
            return os.WSTOPSIG(status) | (status >> 16 << 8)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            raise NotTrackable(f"process {pid} ended while torpor made it a system call")


def _inject_apart(pid: int, number: int, *args: int, if_stopped: bool = False) -> int:
    """:func:`_inject`, run by a process of its own (``python -m torpor.adapters.writetrack``).

    The tracer must not be the process's parent: a parent that waits for its child (torpor's launcher
    does, in a thread of its own) would take the ptrace stops the tracer waits for, and both would wait
    for ever, the process stopped."""
    command = [sys.executable, "-m", __name__, str(pid), str(number), *map(str, args)]
    try:
        done = subprocess.run(
            [*command, *(["--if-stopped"] if if_stopped else [])],
            capture_output=True,
            text=True,
            timeout=_INJECT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:  # killed: its tracee is let go with it
        raise NotTrackable(
            f"making process {pid} run a system call took over {_INJECT_TIMEOUT_S} s"
        ) from None
    if done.returncode == 0:
        return int(done.stdout.strip())
    lines = (done.stderr or done.stdout).strip().splitlines()
    raise NotTrackable(lines[-1] if lines else f"making process {pid} run a system call failed")


def _main(argv: list[str]) -> int:
    """``python -m torpor.adapters.writetrack PID NUMBER [ARG...] [--if-stopped]``: :func:`_inject`; the
    call's return value on stdout, or why not on stderr (exit 3)."""
    if_stopped = "--if-stopped" in argv
    numbers = [int(each) for each in argv if each != "--if-stopped"]
    try:
        print(_inject(numbers[0], numbers[1], *numbers[2:], if_stopped=if_stopped))
    except NotTrackable as exc:
        print(exc.message, file=sys.stderr)
        return 3
    return 0


def _inject(pid: int, number: int, *args: int, if_stopped: bool = False) -> int:
    """Make process ``pid`` (its main thread) run system call ``number`` with ``args``, then go on as
    it was; the call's return value (a negative errno on failure). A process stopped by a signal is
    refused (NotTrackable), or with ``if_stopped`` made to run the call and stopped again after."""
    entry = _vdso_syscall(pid)
    _ptrace(_PTRACE_SEIZE, pid, 0, _PTRACE_O_TRACESYSGOOD)
    pending: list[int] = []
    try:
        _ptrace(_PTRACE_INTERRUPT, pid)
        first = _wait_stop(pid) & 0xFF
        if first in _STOP_SIGNALS:  # it was stopped (a group stop), not interrupted by us
            if not if_stopped:
                pending.append(first)  # detached, it stays stopped
                raise NotTrackable(f"process {pid} is stopped: its writes are tracked from while it runs")
            pending.append(first)
        saved = _Regs()
        _ptrace(_PTRACE_GETREGS, pid, 0, saved)
        _restartable(saved)
        call = _Regs.from_buffer_copy(saved)
        call.rax, call.orig_rax, call.rip = number, (1 << 64) - 1, entry
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            setattr(call, name, value)
        _ptrace(_PTRACE_SETREGS, pid, 0, call)
        stops = 0
        while stops < 2:  # the call's entry, then its exit
            _ptrace(_PTRACE_SYSCALL, pid)
            sig = _wait_stop(pid) & 0xFF
            if sig == 0x80 | signal.SIGTRAP:
                stops += 1
            elif sig != signal.SIGTRAP:  # a signal meant for the process (a stop too): given it at the end
                pending.append(sig)
        done = _Regs()
        _ptrace(_PTRACE_GETREGS, pid, 0, done)
        _ptrace(_PTRACE_SETREGS, pid, 0, saved)
        result = ctypes.c_longlong(done.rax).value
    finally:
        with contextlib.suppress(NotTrackable):
            _ptrace(_PTRACE_DETACH, pid, 0, pending[0] if pending else 0)
    return int(result)


def _restartable(regs: _Regs) -> None:
    """A thread stopped inside an interrupted system call: its registers set to make that call again
    when it runs on (what the kernel would have done had no tracer stopped it), as CRIU's compel does."""
    if ctypes.c_longlong(regs.orig_rax).value < 0:
        return
    returned = ctypes.c_longlong(regs.rax).value
    if returned in (-_ERESTARTSYS, -_ERESTARTNOINTR, -_ERESTARTNOHAND):
        regs.rax, regs.rip = regs.orig_rax, regs.rip - 2
    elif returned == -_ERESTART_RESTARTBLOCK:
        regs.rax, regs.rip = _NR_RESTART_SYSCALL, regs.rip - 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
