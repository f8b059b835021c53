"""The one typed seam to the ``criu`` binary.

Every CRIU run goes through :class:`Criu`. A failed run raises a torpor error that carries the CRIU log
lines explaining it (not just "exit status 1"); the options that make dumps work on these machines
(TCP connections kept with the nftables network lock, file locks, large ghost files) live here, so the
engine only says *what* to dump and where.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torpor.adapters import system
from torpor.errors import (
    CheckpointFailed,
    CriuUnavailable,
    JobExited,
    RestoreFailed,
    StorageFull,
)

MIN_VERSION = (4, 2)

#: options used for every dump and restore of a job: keep TCP connections and file locks
COMMON_OPTIONS: tuple[str, ...] = ("--tcp-established", "--file-locks")
#: dump only (restore takes the method from the image): iptables is missing here, nftables works
DUMP_OPTIONS: tuple[str, ...] = ("--network-lock", "nftables")
#: deleted files still open or mapped (e.g. DataLoader shared memory in /dev/shm) are kept up to this size
GHOST_LIMIT = "1G"

# Lines CRIU prints on every run here that explain nothing (no CAP_SYS_RESOURCE for RLIMIT_NOFILE).
_NOISE = re.compile(r"RLIMIT_NOFILE")
_ERROR_LINE = re.compile(r"\b(Error|Warn)\s*\(")


@dataclass(frozen=True)
class DumpStats:
    """What CRIU measured during a dump (from its ``stats-dump`` image), in seconds and pages."""

    freezing_s: float
    frozen_s: float
    memdump_s: float
    memwrite_s: float
    pages_written: int


@dataclass(frozen=True)
class OpenFile:
    """A regular file the dumped tree had open, as recorded in ``files.img``."""

    path: str
    writable: bool
    size: int | None  # CRIU checks this size on restore; None when it does not (e.g. O_APPEND logs)
    append: bool = False  # opened with O_APPEND
    pos: int = 0  # the descriptor's file offset at the dump (for O_APPEND: the end at its last write)


@dataclass(frozen=True)
class CriuInfo:
    path: Path
    version: str
    version_tuple: tuple[int, ...]


def log_excerpt(log_path: Path, limit: int = 12) -> list[str]:
    """The CRIU log lines that explain a failure: its errors, or failing that, its last lines."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    lines = [line for line in lines if not _NOISE.search(line)]
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


#: CRIU runs this at each step of a restore. At ``post-restore`` every task of the tree is back, memory
#: included, and none runs yet: it waits there for the verdict file, and a verdict other than
#: ``verified`` (or the death of the process that was to write it) makes CRIU kill the tree and fail.
GATE_SCRIPT = """#!/bin/sh
# torpor: hold a restored tree until its image is verified (written by torpor; see adapters/criu.py)
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
while [ ! -e "$TORPOR_GATE_VERDICT" ]; do
    kill -0 "$TORPOR_GATE_PID" 2>/dev/null || [ -e "$TORPOR_GATE_VERDICT" ] || exit 1
    sleep 0.005
done
read -r verdict < "$TORPOR_GATE_VERDICT"
[ "$verdict" = verified ]
"""


@dataclass(frozen=True)
class RestoreGate:
    """Lets CRIU restore a tree while its image is still being verified (by process ``writer_pid``).

    The writer calls :meth:`open` when the verification passed and :meth:`shut` when it failed; CRIU
    reads memory in parallel and lets the tree run only after ``open``.
    """

    script: Path
    verdict: Path
    writer_pid: int

    @staticmethod
    def install(script: Path) -> Path:
        """Write :data:`GATE_SCRIPT` to ``script`` (an executable file), unless it is there already."""
        if not script.is_file() or script.read_text() != GATE_SCRIPT:
            tmp = script.with_name(f".{script.name}.{os.getpid()}.tmp")
            system.write_private(tmp, GATE_SCRIPT.encode())
            tmp.chmod(0o700)  # CRIU runs it as torpor's user
            os.replace(tmp, script)
        return script

    def env(self) -> dict[str, str]:
        return {"TORPOR_GATE_VERDICT": str(self.verdict), "TORPOR_GATE_PID": str(self.writer_pid)}

    def _say(self, text: str) -> None:
        tmp = self.verdict.with_name(f".{self.verdict.name}.tmp")
        system.write_private(tmp, (text + "\n").encode())
        os.replace(tmp, self.verdict)  # whole or absent: the script never reads half a verdict

    def open(self) -> None:
        self._say("verified")

    def shut(self, why: str) -> None:
        self._say("refused: " + why.replace("\n", " "))

    def verdict_text(self) -> str:
        try:
            return self.verdict.read_text().strip() or "no verdict"
        except OSError:
            return "no verdict: the verifying process is gone"


#: what ``criu --version`` said, by (path, inode, mtime, size) of the binary
_VERSIONS: dict[tuple[Path, int, int, int] | None, CriuInfo] = {}


class Criu:
    """A criu binary, checked to be new enough before it is used."""

    def __init__(self, path: Path | None) -> None:
        if path is None:
            raise CriuUnavailable(
                "criu was not found: run 'make setup' (it installs CRIU >= 4.2 into .venv/bin) "
                "or set TORPOR_CRIU to a criu binary"
            )
        self.path = path
        self._info: CriuInfo | None = None

    # -- inspection -------------------------------------------------------------------------------

    def _run(
        self,
        args: list[str],
        timeout: float = 60,
        abandon_if: Callable[[], bool] | None = None,
        abandon_after: float = 10.0,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run criu; kill it if it outlives ``timeout``, or if ``abandon_if()`` stays true ``abandon_after`` s.

        ``abandon_if`` guards against a criu that waits forever on a process that died under it.
        """
        try:
            proc = subprocess.Popen(
                [str(self.path), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
                env=None if env is None else {**os.environ, **env},
                cwd=cwd,
            )
        except FileNotFoundError as exc:
            raise CriuUnavailable(f"criu not found at {self.path}: run 'make setup'") from exc
        except PermissionError as exc:
            raise CriuUnavailable(f"criu at {self.path} is not executable") from exc
        deadline = time.monotonic() + timeout
        abandoned_since: float | None = None
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=0.25)
                return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            gone = abandon_if is not None and abandon_if()
            abandoned_since = (abandoned_since or now) if gone else None
            if now > deadline or (abandoned_since is not None and now - abandoned_since > abandon_after):
                proc.kill()
                stdout, stderr = proc.communicate()
                why = "timed out" if now > deadline else "hung on a process that is gone"
                return subprocess.CompletedProcess(proc.args, -9, stdout, stderr + f"\ncriu {why}; killed")

    def info(self) -> CriuInfo:
        """Version of this criu; raises :class:`CriuUnavailable` if it is older than 4.2.

        Asked once per binary and process (a launcher, forked from the CLI, knows it too): running
        ``criu --version`` takes milliseconds, which a restore would otherwise spend twice.
        """
        if self._info is not None:
            return self._info
        try:
            stat = self.path.stat()
            key: tuple[Path, int, int, int] | None = (self.path, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            key = None
        if key in _VERSIONS:
            self._info = _VERSIONS[key]
            return self._info
        out = self._run(["--version"])
        match = re.search(r"Version:\s*([0-9][0-9.]*)", out.stdout)
        if out.returncode != 0 or not match:
            raise CriuUnavailable(f"{self.path} --version failed: {(out.stderr or out.stdout).strip()[:200]}")
        version = match.group(1)
        parts = tuple(int(p) for p in version.split(".") if p.isdigit())
        self._info = CriuInfo(self.path, version, parts)
        if key is not None:
            _VERSIONS[key] = self._info
        return self._info

    def require(self) -> CriuInfo:
        info = self.info()
        if info.version_tuple[:2] < MIN_VERSION:
            raise CriuUnavailable(
                f"criu {info.version} at {info.path} is too old: torpor needs >= "
                f"{'.'.join(map(str, MIN_VERSION))} on this kernel (run 'make setup' to install one)"
            )
        return info

    def check(self) -> tuple[bool, str]:
        """``criu check``: (passed, what it said)."""
        out = self._run(["check"])
        text = "\n".join(line for line in (out.stdout + out.stderr).splitlines() if not _NOISE.search(line))
        return out.returncode == 0, text.strip()

    def has_feature(self, feature: str) -> bool:
        """``criu check --feature NAME`` (e.g. ``mem_dirty_track``, ``uffd-noncoop``)."""
        return self._run(["check", "--feature", feature]).returncode == 0

    # -- dump and restore -----------------------------------------------------------------------

    def dump_command(
        self,
        pid: int,
        images_dir: Path,
        log_path: Path,
        *,
        leave_running: bool,
        extra: tuple[str, ...] = (),
    ) -> list[str]:
        """The ``criu dump`` command line torpor runs (benchmarks run the same one as their anchor)."""
        return [
            str(self.path),
            "dump",
            "--tree",
            str(pid),
            "--images-dir",
            str(images_dir),
            "--log-file",
            str(log_path),
            "-v4",
            *COMMON_OPTIONS,
            *DUMP_OPTIONS,
            "--ghost-limit",
            GHOST_LIMIT,
            *extra,
            *(["--leave-running"] if leave_running else []),
        ]

    def dump(
        self,
        pid: int,
        images_dir: Path,
        log_path: Path,
        *,
        leave_running: bool,
        extra: tuple[str, ...] = (),
    ) -> DumpStats:
        """Dump the process tree rooted at ``pid`` into ``images_dir``: one attempt.

        CRIU itself resumes the tree when a dump fails; the caller still checks (invariant 1). Whether a
        failed dump is tried again is the caller's to decide (:func:`torpor.core.checkpoint.dump`).
        """
        self.require()
        args = self.dump_command(pid, images_dir, log_path, leave_running=leave_running, extra=extra)[1:]
        out = self._run(args, timeout=6 * 3600, abandon_if=lambda: not Path(f"/proc/{pid}").exists())
        if out.returncode != 0:
            details = log_excerpt(log_path) or [(out.stderr or out.stdout).strip()]
            text = "\n".join(details)
            if "No space left on device" in text or "ENOSPC" in text:
                raise StorageFull(
                    f"no space left on the device of {images_dir.parent} while dumping: free space there"
                    " or move TORPOR_HOME",
                    details=details,
                )
            if not Path(f"/proc/{pid}").exists():
                raise JobExited("the job exited while it was being checkpointed", details=details)
            raise CheckpointFailed(
                f"criu dump failed (exit status {out.returncode}); the job was left running",
                details=details,
            )
        return read_dump_stats(images_dir)

    def start_lazy_pages(
        self, images_dir: Path, log_path: Path, timeout: float = 10, *, page_server_fd: int | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``criu lazy-pages`` on ``images_dir`` and return once it listens.

        It serves the memory of a tree restored with ``restore(lazy=True)`` on demand (userfaultfd), copies
        the rest in the background, and exits once every page is in (or the tree is gone): the caller
        waits for it before deleting ``images_dir``.

        ``page_server_fd``: a connected socket (see :mod:`torpor.adapters.pageserver`) the daemon asks for
        the lazy pages instead of reading them from ``images_dir``, which then needs only the pagemaps and
        the pages that are not lazy. The caller closes its copy of the fd once this returns.
        """
        self.require()
        listening = images_dir / "lazy-pages.socket"
        process = subprocess.Popen(
            [
                str(self.path),
                "lazy-pages",
                "--images-dir",
                str(images_dir),
                "--log-file",
                str(log_path),
                "-v4",
                *(
                    ["--page-server", "--ps-socket", str(page_server_fd)]
                    if page_server_fd is not None
                    else []
                ),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=() if page_server_fd is None else (page_server_fd,),
        )
        deadline = time.monotonic() + timeout
        while not listening.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                if process.poll() is None:
                    process.kill()
                process.wait()
                raise RestoreFailed(
                    "criu lazy-pages did not start (userfaultfd missing? see 'torpor doctor')",
                    details=log_excerpt(log_path),
                )
            time.sleep(0.002)
        return process

    def restore(
        self,
        images_dir: Path,
        log_path: Path,
        pidfile: Path,
        *,
        extra: tuple[str, ...] = (),
        lazy: bool = False,
        gate: RestoreGate | None = None,
        stream: bool = False,
    ) -> int:
        """Restore a tree detached (``-d``) and return its root's pid.

        The restored root is re-parented to the nearest subreaper above criu: the caller's launcher.
        ``lazy``: memory comes from a running :meth:`start_lazy_pages` on the same folder.
        ``gate``: the tree is restored in full but not let run until the gate's verdict says so.
        ``stream``: every image file comes through an image streamer listening in ``images_dir``
        (:mod:`torpor.adapters.imagestreamer`), not from the folder. CRIU then runs in ``images_dir``
        with ``--images-dir .``: it connects to the streamer by a path it makes from that argument, and
        a socket path holds at most 107 bytes.
        """
        self.require()
        args = [
            "restore",
            "--images-dir",
            "." if stream else str(images_dir),
            "--log-file",
            str(log_path),
            "-v4",
            "--restore-detached",
            "--pidfile",
            str(pidfile),
            *COMMON_OPTIONS,
            *(["--lazy-pages"] if lazy else []),
            *(["--action-script", str(gate.script)] if gate else []),
            *(["--stream"] if stream else []),
            *extra,
        ]
        out = self._run(
            args, timeout=6 * 3600, env=gate.env() if gate else None, cwd=images_dir if stream else None
        )
        if out.returncode != 0:
            details = log_excerpt(log_path) or [(out.stderr or out.stdout).strip()]
            message = f"criu restore failed (exit status {out.returncode})"
            if any("Address already in use" in line for line in details):
                message += (
                    ": a TCP port the job used is still taken (after a kill the kernel holds it up to 60 s"
                    " in TIME_WAIT, or another process has it); retry later"
                )
            if gate is not None and any("post-restore script" in line for line in details):
                message += f": the image did not pass its verification ({gate.verdict_text()})"
            raise RestoreFailed(message, details=details)
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise RestoreFailed(f"criu restore wrote no pid to {pidfile}") from exc


# -- the stats-dump image ---------------------------------------------------------------------------
#
# A CRIU image is: u32 magic, u32 image magic, then records of u32 size + protobuf message. We read the
# one StatsEntry by hand rather than depend on CRIU's Python bindings (not packaged for this setup).


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> dict[int, int | bytes]:
    """Decode one protobuf message into {field number: value} (last value wins; enough for stats)."""
    out: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            out[number], pos = _varint(buf, pos)
        elif wire == 2:
            length, pos = _varint(buf, pos)
            out[number] = buf[pos : pos + length]
            pos += length
        elif wire == 1:
            out[number] = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == 5:
            out[number] = int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return out


def _records(raw: bytes, header: int = 8) -> list[bytes]:
    """The protobuf records of an image (after its magic words)."""
    out = []
    pos = header
    while pos + 4 <= len(raw):
        size = int.from_bytes(raw[pos : pos + 4], "little")
        out.append(raw[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return out


_FD_TYPE_REG = 1
_FD_TYPE_UNIXSK = 5
_O_ACCMODE = 3
_O_APPEND = 0o2000


def _file_entries(images_dir: Path) -> list[dict[int, int | bytes]]:
    try:
        raw = (images_dir / "files.img").read_bytes()
    except OSError:
        return []
    return [_fields(record) for record in _records(raw)]


def unix_socket_paths(images_dir: Path) -> list[str]:
    """Filesystem paths of the unix sockets the tree had bound (FileEntry.usk=16, UnixSkEntry.name=11)."""
    paths = []
    for entry in _file_entries(images_dir):
        usk = entry.get(16)
        if entry.get(1) != _FD_TYPE_UNIXSK or not isinstance(usk, bytes):
            continue
        name = _fields(usk).get(11)
        if isinstance(name, bytes) and name.startswith(b"/"):
            paths.append(name.rstrip(b"\0").decode(errors="surrogateescape"))
    return paths


def open_files(images_dir: Path) -> list[OpenFile]:
    """Regular files in ``files.img``.

    FileEntry{type=1, reg=3: RegFileEntry{flags=2, pos=3, name=6, size=8}}.
    """
    found = []
    for entry in _file_entries(images_dir):
        reg = entry.get(3)
        if entry.get(1) != _FD_TYPE_REG or not isinstance(reg, bytes):
            continue
        fields = _fields(reg)
        name, flags, size, pos = fields.get(6), fields.get(2, 0), fields.get(8), fields.get(3, 0)
        if not isinstance(name, bytes) or not isinstance(flags, int):
            continue
        found.append(
            OpenFile(
                path=name.decode(errors="surrogateescape"),
                writable=(flags & _O_ACCMODE) != 0,
                size=size if isinstance(size, int) else None,
                append=bool(flags & _O_APPEND),
                pos=pos if isinstance(pos, int) else 0,
            )
        )
    return found


def read_dump_stats(images_dir: Path) -> DumpStats:
    """Parse ``stats-dump``; zeros when CRIU wrote none (never fail a good dump over statistics)."""
    try:
        raw = (images_dir / "stats-dump").read_bytes()
        size = int.from_bytes(raw[8:12], "little")
        entry = _fields(raw[12 : 12 + size])
        dump = entry.get(1)
        fields = _fields(dump) if isinstance(dump, bytes) else {}
    except (OSError, ValueError, IndexError):
        fields = {}

    def usec(number: int) -> float:
        value = fields.get(number, 0)
        return value / 1e6 if isinstance(value, int) else 0.0

    pages = fields.get(7, 0)
    return DumpStats(
        freezing_s=usec(1),
        frozen_s=usec(2),
        memdump_s=usec(3),
        memwrite_s=usec(4),
        pages_written=pages if isinstance(pages, int) else 0,
    )
