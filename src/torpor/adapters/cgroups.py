"""Memory cgroups for the scheduler's jobs, and the node's memory readings (MemAvailable, PSI).

The agent gives each job the scheduler starts a memory cgroup of its own, so that the job's usage can be
read and its memory bounded without the kernel ever killing it: this module is the only code that
touches cgroupfs and ``/proc/meminfo``/``/proc/pressure``. It finds the controller the machine has for
torpor's own processes (cgroup v1 or v2), makes one folder per job under ``torpor-jobs`` in the calling
process's own memory cgroup, and reads and sets what the scheduler decides from. Which limit a job
gets, and when, is the policy's (policy/scheduler); starting a process inside a folder is the launcher's
(``Engine.run(..., cgroup=JobCgroup.path)``).

**A limit never kills.** Under v1 each job cgroup (and ``torpor-jobs``, so that a folder CRIU creates
again inherits it) has ``memory.oom_control`` ``oom_kill_disable 1``: a job that reaches its limit
*stalls* (its faulting threads sleep in the kernel, ``under_oom 1``: :meth:`JobCgroup.stalled`) until
the limit is raised, when it goes on as if nothing happened. Under v2 the limit is ``memory.high``: the
kernel reclaims and throttles the job there, and never kills at it; ``memory.max`` stays ``max``.

**A stalled job cannot be dumped as it is** (measured here, kernel 6.18, criu 4.2.1): CRIU cannot seize
a task that sleeps in the memcg OOM wait ("Unseizable non-zombie … state D") and gives up after its
10 s freeze timeout. Raising the limit by a margin alone is a race: the job's pending fault completes
and it keeps allocating before CRIU freezes it (a job growing 200 MiB/s needed 64 MiB of margin; with
16 MiB it stalled again *inside* CRIU's parasite and the dump hung until killed). What works every
time is :meth:`JobCgroup.unstall_for_dump`: SIGSTOP every process first (the stop is delivered the
moment the fault returns, before it is retried, so usage does not grow), then raise the limit to usage
plus :data:`DUMP_MARGIN`; CRIU's parasite needs well under 1 MiB in the job's cgroup (1 MiB was enough
in every try). The job is then dumped *stopped*, and CRIU restores it stopped: after the restore, raise
the limit and :meth:`JobCgroup.continue_processes`.

**CRIU and the cgroup at restore** (default ``--manage-cgroups`` soft mode, measured here): a restored
job goes back into the same cgroup path. If that folder exists, CRIU leaves its settings alone
(``memory.limit_in_bytes``, ``oom_kill_disable``: a higher limit set before the restore is kept; one
below what the job holds makes the restore fail cleanly, "Can't read mapping page … Bad address", and the
job stays hibernated). If the folder is missing, CRIU creates it with the limit, soft limit and
``oom_kill_disable`` it dumped. So: set the limit the job is to have *before* the restore, on a folder
that exists (:meth:`JobCgroup.create` makes it again after a :meth:`JobCgroup.remove`).

**v2's "no internal processes" rule**: a cgroup can hand the memory controller to its children
(``+memory`` in its ``cgroup.subtree_control``) only while it holds no process itself. ``torpor-jobs``
holds none, so it always can; the caller's own cgroup holds the caller. :meth:`MemoryController.prepare`
enables ``+memory`` there if it is not already; where the kernel refuses (EBUSY: the agent shares its
cgroup with itself), it says so and what to do: run the agent in a delegated cgroup whose memory
controller is already enabled for its children (systemd: ``Delegate=yes`` and the agent in a leaf
child), never moving processes itself. v2 cannot be run here (its memory controller is bound to v1):
its file formats are tested on a folder of files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from torpor.adapters.system import procfs
from torpor.adapters.system.mounts import Mount, parse
from torpor.errors import EnvironmentProblem, UsageError

#: the folder, in the memory cgroup of the process that calls, that holds one child per job
JOBS_FOLDER = "torpor-jobs"
#: what :meth:`JobCgroup.unstall_for_dump` adds to a stopped job's usage: CRIU's parasite needed under
#: 1 MiB in its cgroup here; four times that leaves room for a job of many threads
DUMP_MARGIN = 4 << 20
#: v1 reads "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages): anything this
#: large is no limit
_UNLIMITED = 1 << 62
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


class NodePressure(NamedTuple):
    """``/proc/pressure/memory``'s avg10 figures: percent of the last 10 s some / all tasks stalled on memory."""

    some_avg10: float
    full_avg10: float


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The node's MemAvailable in bytes: what can be allocated without swapping (the kernel's estimate)."""
    try:
        text = meminfo.read_text()
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read {meminfo}: {exc.strerror}") from exc
    match = re.search(r"^MemAvailable:\s+(\d+) kB$", text, re.MULTILINE)
    if match is None:
        raise EnvironmentProblem(f"{meminfo} has no MemAvailable line (kernel older than 3.14?)")
    return int(match.group(1)) << 10


def memory_pressure(path: Path = Path("/proc/pressure/memory")) -> NodePressure | None:
    """The node's memory PSI (some and full avg10, percent); None where the kernel has no PSI.

    A kernel built with PSI but booted with ``psi=0`` has the file and refuses to read it (EOPNOTSUPP):
    that is no PSI too.
    """
    try:
        text = path.read_text()
    except OSError:
        return None
    return _psi(text, path)


def _psi(text: str, source: Path) -> NodePressure:
    found = dict(re.findall(r"^(some|full) avg10=([0-9.]+)", text, re.MULTILINE))
    if "some" not in found:
        raise EnvironmentProblem(f"{source} does not read as PSI ('some avg10=…' missing)")
    # before 5.13 a cgroup's (and the node's cpu) file had no "full" line; memory always has one
    return NodePressure(float(found["some"]), float(found.get("full", 0.0)))


# -- finding the controller -------------------------------------------------------------------------


@dataclass(frozen=True)
class NoMemoryController:
    """Why this machine has no memory cgroup torpor can use for its jobs (the agent logs it and runs
    jobs without limits: the scheduler then goes by the node's readings alone)."""

    reason: str


@dataclass(frozen=True)
class MemoryController:
    """The memory controller of torpor's processes: v1 or v2, and where jobs' cgroups go."""

    version: Literal[1, 2]
    #: the calling process's own memory cgroup (a folder of the hierarchy's mount)
    own: Path
    #: one folder per state directory below ``torpor-jobs`` (:func:`scope_of`): agents of different
    #: homes in one cgroup (tests side by side) each see their own jobs only, even of the same names
    scope: str | None = None

    @property
    def jobs(self) -> Path:
        """The parent of every job's folder: ``torpor-jobs`` in our own cgroup (and the scope's folder)."""
        top = self.own / JOBS_FOLDER
        return top if self.scope is None else top / self.scope

    def scoped(self, scope: str) -> MemoryController:
        """The same controller with the jobs of one state directory (``scope``) in a folder of their own."""
        if not _NAME.fullmatch(scope):
            raise UsageError(f"{scope!r} cannot name a cgroup folder")
        return MemoryController(self.version, self.own, scope)

    def prepare(self) -> None:
        """Make ``torpor-jobs`` ready for children (idempotent; the agent calls it once at start).

        Created 0700 (cgroupfs keeps the mode: only root reaches the jobs' files). Under v1 it gets
        ``oom_kill_disable 1``, which a child inherits when made, CRIU's recreated ones included. Under
        v2 the memory controller is enabled for our own cgroup's children (refused while our cgroup
        holds processes and has not enabled it yet: see the module's docstring) and for torpor-jobs'.
        """
        if self.version == 2:
            _enable_memory(self.own)
        folders = [self.own / JOBS_FOLDER] + ([self.jobs] if self.scope is not None else [])
        for folder in folders:
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise EnvironmentProblem(
                    f"cannot create the jobs' cgroup {folder}: {exc.strerror} (is torpor running as root?)"
                ) from exc
            if self.version == 1:
                _write(folder / "memory.oom_control", "1")
            else:
                _enable_memory(folder)

    def job(self, name: str) -> JobCgroup:
        """The cgroup of job ``name`` (it need not exist yet). Names are single folder names."""
        if not _NAME.fullmatch(name):
            raise UsageError(
                f"{name!r} cannot name a cgroup: use letters, digits, '_', '.' and '-' (not first), "
                "at most 128 characters"
            )
        return JobCgroup(self, self.jobs / name)

    def job_names(self) -> list[str]:
        """The jobs that have a cgroup folder now, sorted (an agent that restarts finds its own)."""
        try:
            return sorted(
                entry.name for entry in os.scandir(self.jobs) if entry.is_dir(follow_symlinks=False)
            )
        except FileNotFoundError:
            return []


def detect_memory_controller(
    mountinfo: Path = Path("/proc/self/mountinfo"), cgroups: Path = Path("/proc/self/cgroup")
) -> MemoryController | NoMemoryController:
    """The memory controller for the calling process's cgroup, or why there is none.

    v1 first: a ``cgroup`` mount with the ``memory`` option holds the controller, and then v2 cannot
    have it (a hybrid machine, as this one, mounts cgroup2 without it). Else v2: the ``cgroup2`` mount,
    if our own cgroup there lists ``memory`` in ``cgroup.controllers``. Our cgroup is the line of
    ``/proc/self/cgroup`` for that hierarchy, a path from the hierarchy's root; the mount may show only
    part of the hierarchy (its root field, in a container), so the folder is the path below that root.
    The arguments are for tests: another process's or a fake machine's files.
    """
    try:
        mounts = [parse(line) for line in mountinfo.read_text().splitlines()]
        own = _own_cgroups(cgroups.read_text())
    except OSError as exc:
        return NoMemoryController(f"cannot read {exc.filename}: {exc.strerror}")
    v1 = next((m for m in mounts if m.fstype == "cgroup" and "memory" in m.options), None)
    if v1 is not None:
        path = own.get("memory")
        if path is None:
            return NoMemoryController(f"{cgroups} names no memory cgroup, though {v1.point} is mounted")
        folder = _below(v1, path)
        if folder is None:
            return NoMemoryController(f"our memory cgroup {path} is outside the mount {v1.point}")
        return MemoryController(1, folder)
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if v2 is None:
        return NoMemoryController("no cgroup v1 memory controller and no cgroup2 mount")
    path = own.get("")
    folder = None if path is None else _below(v2, path)
    if folder is None:
        return NoMemoryController(f"our cgroup v2 {path} is not below the mount {v2.point}")
    try:
        controllers = (folder / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return NoMemoryController(f"cannot read {folder / 'cgroup.controllers'}: {exc.strerror}")
    if "memory" not in controllers:
        return NoMemoryController(
            f"cgroup v2 at {v2.point} gives our cgroup {path} no memory controller "
            f"(cgroup.controllers: {' '.join(controllers) or 'none'})"
        )
    return MemoryController(2, folder)


def scope_of(home: Path) -> str:
    """The folder name of one state directory's jobs: a short digest of its resolved path."""
    return "home-" + hashlib.blake2b(str(home.resolve()).encode(), digest_size=6).hexdigest()


def find_memory_controller(
    mountinfo: Path = Path("/proc/self/mountinfo"), cgroups: Path = Path("/proc/self/cgroup")
) -> MemoryController | None:
    """:func:`detect_memory_controller` for callers that need no reason: None with no usable controller."""
    found = detect_memory_controller(mountinfo, cgroups)
    return found if isinstance(found, MemoryController) else None


def _own_cgroups(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` by controller: ``4:memory:/a/b`` → {"memory": "/a/b"}; v2's ``0::/x`` → {"": "/x"}."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def _below(mount: Mount, path: str) -> Path | None:
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return mount.point / path[len(root) :].lstrip("/")


def _enable_memory(folder: Path) -> None:
    """v2: hand the memory controller to ``folder``'s children, if it is not already."""
    control = folder / "cgroup.subtree_control"
    try:
        if "memory" in control.read_text().split():
            return
        _write(control, "+memory")
    except EnvironmentProblem as exc:
        if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EBUSY:
            raise EnvironmentProblem(
                f"cgroup v2 will not enable memory for the children of {folder}: it holds processes "
                "(the agent's own); start the agent in a cgroup whose parent delegates memory to it, "
                "alone in a leaf (systemd: Delegate=yes)"
            ) from exc.__cause__
        raise
    except OSError as exc:
        raise EnvironmentProblem(f"cannot read {control}: {exc.strerror}") from exc


def _write(path: Path, value: str) -> None:
    """Write one value to a cgroup file; the kernel's refusal comes back as its errno, kept as the cause."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot open {path}: {exc.strerror}") from exc
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise EnvironmentProblem(f"the kernel refused {value!r} in {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


# -- one job's cgroup -------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobCgroup:
    """The memory cgroup of one job: a folder below ``torpor-jobs``, made and removed by the agent."""

    controller: MemoryController
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def _v1(self) -> bool:
        return self.controller.version == 1

    def exists(self) -> bool:
        return self.path.is_dir()

    def create(self, limit: int | None) -> None:
        """Make the folder (if missing) with ``limit`` bytes (None: none), a limit that never kills.

        v1: ``oom_kill_disable 1`` and ``memory.limit_in_bytes``; v2: ``memory.high``, ``memory.max``
        left at ``max``. An existing folder (a hibernated job's, kept for its restore) gets the limit.
        """
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError as exc:
            raise EnvironmentProblem(
                f"cannot create {self.path}: {self.controller.jobs} is missing (call prepare() first)"
            ) from exc
        except OSError as exc:
            raise EnvironmentProblem(f"cannot create the cgroup {self.path}: {exc.strerror}") from exc
        if self._v1:
            _write(self.path / "memory.oom_control", "1")
        self.set_limit(limit)

    def set_limit(self, limit: int | None) -> None:
        """Set the limit to ``limit`` bytes (None: no limit); the kernel rounds it down to whole pages.

        v1 refuses (EBUSY) a limit below what the job holds once reclaim cannot free the difference;
        v2 takes it and throttles the job down to it.
        """
        if limit is not None and limit <= 0:
            raise UsageError(f"a cgroup memory limit must be more than 0 bytes, not {limit}")
        if self._v1:
            _write(self.path / "memory.limit_in_bytes", "-1" if limit is None else str(limit))
        else:
            _write(self.path / "memory.high", "max" if limit is None else str(limit))

    def limit(self) -> int | None:
        """The limit in bytes; None when there is none."""
        raw = self._read("memory.limit_in_bytes" if self._v1 else "memory.high").strip()
        if raw == "max":
            return None
        value = int(raw)
        return None if value >= _UNLIMITED else value

    def usage(self) -> int:
        """The bytes charged to the job now (its pages, page cache and kernel memory)."""
        return int(self._read("memory.usage_in_bytes" if self._v1 else "memory.current"))

    def pressure(self) -> float | None:
        """v2: the share of the last 10 s all the job's tasks stalled on memory ("full avg10", percent).

        v1 has no per-cgroup PSI: None (``stalled()`` says whether it stands at its limit).
        """
        if self._v1:
            return None
        return _psi(self._read("memory.pressure"), self.path / "memory.pressure").full_avg10

    def oom_kills(self) -> int:
        """How many of the job's processes the kernel OOM-killed in this cgroup (the agent means 0)."""
        name = "memory.oom_control" if self._v1 else "memory.events"
        return _keyed(self._read(name), name).get("oom_kill", 0)

    def stalled(self) -> bool:
        """Whether the job stands at its limit, its faulting tasks asleep until it is raised (v1).

        v2 never stalls at ``memory.high`` (it throttles: see ``pressure()``): always False.
        """
        if not self._v1:
            return False
        return _keyed(self._read("memory.oom_control"), "memory.oom_control").get("under_oom", 0) == 1

    def pids(self) -> list[int]:
        """The processes in the cgroup now (thread group ids), sorted; [] when the folder is gone."""
        try:
            return sorted(int(pid) for pid in (self.path / "cgroup.procs").read_text().split())
        except FileNotFoundError:
            return []

    def make_room(self, extra: int) -> int:
        """Raise the limit to at least usage + ``extra`` bytes (never lowers it); returns the new limit.

        Alone, this lets a stalled job go on (and grow again): to dump a stalled job, see
        :meth:`unstall_for_dump`.
        """
        if extra < 0:
            raise UsageError(f"the room to make must be at least 0 bytes, not {extra}")
        current = self.limit()
        wanted = self.usage() + extra
        if current is not None and current < wanted:
            self.set_limit(wanted)
            current = wanted
        return current if current is not None else wanted

    def stop_processes(self) -> list[int]:
        """SIGSTOP every process in the cgroup; returns those signalled (a process gone meanwhile is not)."""
        return self._signal(signal.SIGSTOP)

    def continue_processes(self) -> list[int]:
        """SIGCONT every process in the cgroup (after a stalled job's restore: CRIU restores it stopped)."""
        return self._signal(signal.SIGCONT)

    def unstall_for_dump(self, margin: int = DUMP_MARGIN, timeout: float = 5.0) -> bool:
        """Make a (possibly stalled) job dumpable without it growing: stop it, then give it ``margin``.

        SIGSTOP first, so that the fault a stalled task waits in returns to a pending stop instead of
        being retried; then the limit rises to usage + ``margin`` (room for CRIU's parasite). Returns
        whether every process stopped within ``timeout`` s (False: one still waits in the kernel; raise
        the margin). The job stays stopped: CRIU dumps and restores it so; after the restore, raise its
        limit and call :meth:`continue_processes` (a failed dump's caller sends SIGCONT, as checkpoints do).
        """
        stopped = self.stop_processes()
        self.make_room(margin)
        deadline = time.monotonic() + timeout
        while True:
            states = [procfs.process_state(pid) for pid in stopped]
            if all(state in (None, "T", "t", "Z", "X") for state in states):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def remove(self) -> None:
        """Remove the folder (a hibernated job's may go: CRIU makes it again, and ``create`` too).

        Only an empty cgroup can go: one that still holds processes is refused (EBUSY) with the reason.
        A missing folder is fine.
        """
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            held = f" (it still holds processes {self.pids()})" if exc.errno == errno.EBUSY else ""
            raise EnvironmentProblem(f"cannot remove the cgroup {self.path}: {exc.strerror}{held}") from exc

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except FileNotFoundError as exc:
            raise EnvironmentProblem(f"the cgroup of job {self.name} is gone ({self.path / name})") from exc
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read {self.path / name}: {exc.strerror}") from exc

    def _signal(self, sig: signal.Signals) -> list[int]:
        sent = []
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                sent.append(pid)
        return sent


def _keyed(text: str, name: str) -> dict[str, int]:
    """A flat-keyed cgroup file (``key value`` per line: memory.events, memory.oom_control)."""
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise EnvironmentProblem(f"{name} does not read as 'key value' lines: {line!r}")
        found[parts[0]] = int(parts[1])
    return found
