"""The one typed seam to the ``criu`` binary.

Every CRIU run goes through :class:`Criu`. A failed run raises a torpor error that carries the CRIU log
lines explaining it (not just "exit status 1"); the options that make dumps work on these machines
(TCP connections kept with the nftables network lock, file locks, large ghost files) live here, so the
engine only says *what* to dump and where.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# CRIU's images are read in criuimage.py: dump() returns the statistics of its stats-dump image
from torpor.adapters.criuimage import DumpStats, external_unix_peers, read_dump_stats
from torpor.adapters.criulog import EXT_UNIX_SK_OPTION, NOISE, dump_failure, log_excerpt
from torpor.adapters.system import private
from torpor.errors import CriuUnavailable, RestoreFailed

MIN_VERSION = (4, 2)

#: options used for every dump and restore of a job: keep TCP connections and file locks
COMMON_OPTIONS: tuple[str, ...] = ("--tcp-established", "--file-locks")
#: dump only (restore takes the method from the image): iptables is missing here, nftables works
DUMP_OPTIONS: tuple[str, ...] = ("--network-lock", "nftables")
#: a dump of a tree without any TCP socket: neither the connections' option nor the network lock, which
#: alone costs ~0.4 s of the freeze here (nftables set up and torn down while the tree is frozen).
#: Should a connection appear between torpor's look and CRIU's freeze, CRIU refuses it without
#: ``--tcp-established`` (:data:`torpor.policy.retry.TCP_DUMP_ERRORS`) and the dump is tried again with them
NO_TCP_DUMP_OPTIONS: tuple[str, ...] = ("--file-locks",)
#: deleted files still open or mapped (e.g. DataLoader shared memory in /dev/shm) are kept up to this size
GHOST_LIMIT = "1G"

#: where scripts/install-criu.sh puts torpor's rlimit shim, relative to the folder above the criu wrapper
#: (PREFIX/bin/criu preloads PREFIX/lib/torpor-criu-rlimits.so; see scripts/criu-rlimits.c)
RLIMIT_SHIM = Path("lib/torpor-criu-rlimits.so")


@dataclass(frozen=True)
class CriuInfo:
    path: Path
    version: str
    version_tuple: tuple[int, ...]


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
        return private.install_script(script, GATE_SCRIPT)

    def env(self) -> dict[str, str]:
        return {"TORPOR_GATE_VERDICT": str(self.verdict), "TORPOR_GATE_PID": str(self.writer_pid)}

    def _say(self, text: str) -> None:
        tmp = self.verdict.with_name(f".{self.verdict.name}.tmp")
        try:
            private.write_private(tmp, (text + "\n").encode())
            os.replace(tmp, self.verdict)  # whole or absent: the script never reads half a verdict
        except FileNotFoundError:
            pass  # the restore failed and its folder went with it: nobody waits for a verdict any more

    def open(self) -> None:
        self._say("verified")

    def shut(self, why: str) -> None:
        self._say("refused: " + why.replace("\n", " "))

    def verdict_text(self) -> str:
        try:
            return self.verdict.read_text().strip() or "no verdict"
        except OSError:
            return "no verdict: the verifying process is gone"


@dataclass(frozen=True)
class StreamedDump:
    """How CRIU streams a dump to torpor: the action script it runs at each step, and its environment."""

    script: Path
    env: Mapping[str, str]


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
        pass_fds: Sequence[int] = (),
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
                pass_fds=tuple(pass_fds),
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
        text = "\n".join(line for line in (out.stdout + out.stderr).splitlines() if not NOISE.search(line))
        return out.returncode == 0, text.strip()

    def has_feature(self, feature: str) -> bool:
        """``criu check --feature NAME`` (e.g. ``mem_dirty_track``, ``uffd-noncoop``)."""
        return self._run(["check", "--feature", feature]).returncode == 0

    def rlimit_shim(self) -> Path | None:
        """torpor's rlimit shim this criu's wrapper preloads (:data:`RLIMIT_SHIM`), if it was built."""
        shim = self.path.parent.parent / RLIMIT_SHIM
        return shim if shim.is_file() else None

    def probe_dump(self, argv: list[str], uid: int, gid: int, images_dir: Path) -> list[str]:
        """Start ``argv`` as ``uid``:``gid`` (own session, no stdio), dump it left running into
        ``images_dir``, then kill it: the CRIU log lines that explain a failure, ``[]`` if the dump worked.

        ``torpor doctor`` asks this whether a job's dump would meet a process of another user.
        """
        self.require()
        process = subprocess.Popen(
            argv,
            user=uid,
            group=gid,
            extra_groups=[],
            start_new_session=True,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            log = images_dir / "dump.log"
            args = ["dump", "--tree", str(process.pid), "--images-dir", str(images_dir)]
            out = self._run([*args, "--log-file", str(log), "-v4", "--leave-running"], timeout=60)
            if out.returncode == 0:
                return []
            return log_excerpt(log) or [(out.stderr or out.stdout).strip()]
        finally:
            process.kill()
            process.wait()

    # -- dump and restore -----------------------------------------------------------------------

    def dump_command(
        self,
        pid: int,
        images_dir: Path,
        log_path: Path,
        *,
        leave_running: bool,
        extra: tuple[str, ...] = (),
        external_unix: Sequence[int] = (),
        tcp: bool = True,
    ) -> list[str]:
        """The ``criu dump`` command line torpor runs (benchmarks run the same one as their anchor).

        ``tcp``: the tree may hold TCP connections: dump them (``--tcp-established``) behind the network
        lock; False for a tree with no TCP socket (:data:`NO_TCP_DUMP_OPTIONS`).

        ``external_unix``: inodes of the job's unix sockets whose peer may be outside the job; CRIU saves
        them without their peer (``--external unix[ino]``; naming a socket whose peer is inside changes
        nothing). :meth:`restore` gives each such socket a peer that is closed.
        """
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
            *((*COMMON_OPTIONS, *DUMP_OPTIONS) if tcp else NO_TCP_DUMP_OPTIONS),
            "--ghost-limit",
            GHOST_LIMIT,
            *extra,
            *(arg for ino in external_unix for arg in ("--external", f"unix[{ino}]")),
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
        external_unix: Sequence[int] = (),
        tcp: bool = True,
        stream: StreamedDump | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DumpStats:
        """Dump the process tree rooted at ``pid`` into ``images_dir``: one attempt (``tcp``: see
        :meth:`dump_command`).

        ``stream``: every image file goes to an image capture listening in ``images_dir``
        (:class:`torpor.adapters.imagestreamer.ImageCapture`), not into a file CRIU writes, and CRIU runs
        the stream's action script. CRIU then runs in ``images_dir`` with ``--images-dir .`` (a socket
        path holds at most 107 bytes); it still writes its ``stats-dump`` there itself.

        ``env``: more of CRIU's environment (a pre-copy's, :meth:`torpor.core.precopy.PreCopy.env`).

        CRIU itself resumes the tree when a dump fails; the caller still checks (invariant 1). Whether a
        failed dump is tried again is the caller's to decide (:func:`torpor.core.checkpoint.dump`).
        """
        self.require()
        args = self.dump_command(
            pid,
            Path(".") if stream else images_dir,
            log_path,
            leave_running=leave_running,
            extra=extra,
            external_unix=external_unix,
            tcp=tcp,
        )[1:]
        if stream is not None:
            args += ["--stream", "--action-script", str(stream.script)]
        out = self._run(
            args,
            timeout=6 * 3600,
            abandon_if=lambda: not Path(f"/proc/{pid}").exists(),
            env=None if stream is None and env is None else {**(stream.env if stream else {}), **(env or {})},
            cwd=None if stream is None else images_dir,
        )
        if out.returncode != 0:
            raise dump_failure(pid, images_dir, log_path, out.returncode, out.stderr or out.stdout)
        return read_dump_stats(images_dir)

    def start_lazy_pages(
        self,
        images_dir: Path,
        log_path: Path,
        timeout: float = 10,
        *,
        page_server_fd: int | None = None,
        wait: bool = True,
    ) -> subprocess.Popen[bytes]:
        """Start ``criu lazy-pages`` on ``images_dir`` and return once it listens (``wait=False``: at once;
        then call :meth:`wait_lazy_pages` before ``restore``). It reads ``inventory.img`` and
        ``pstree.img`` as it starts; the pagemaps and pages only once ``restore`` runs.

        It serves the memory of a tree restored with ``restore(lazy=True)`` on demand (userfaultfd), copies
        the rest in the background, and exits once every page is in (or the tree is gone): the caller
        waits for it before deleting ``images_dir``.

        ``page_server_fd``: a connected socket (see :mod:`torpor.adapters.pageserver`) the daemon asks for
        the lazy pages instead of reading them from ``images_dir``, which then needs only the pagemaps and
        the pages that are not lazy. The caller closes its copy of the fd once this returns.
        """
        self.require()
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
        if wait:
            self.wait_lazy_pages(process, images_dir, log_path, timeout)
        return process

    def wait_lazy_pages(
        self, process: subprocess.Popen[bytes], images_dir: Path, log_path: Path, timeout: float = 10
    ) -> None:
        """Return once the ``criu lazy-pages`` that :meth:`start_lazy_pages` started listens; kill it and
        raise RestoreFailed if it exits first or does not listen within ``timeout`` seconds."""
        listening = images_dir / "lazy-pages.socket"
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
        files: Mapping[str, int] | None = None,
        fresh_copy: bool = False,
        net_namespace: str | None = None,
    ) -> int:
        """Restore a tree detached (``-d``) and return its root's pid.

        The restored root is re-parented to the nearest subreaper above criu: the caller's launcher.
        ``lazy``: memory comes from a running :meth:`start_lazy_pages` on the same folder.
        ``gate``: the tree is restored in full but not let run until the gate's verdict says so.
        A unix socket the job had connected outside it (dumped with ``external_unix``) comes back with a
        peer that is closed: the job reads end-of-file from it, as if the outside process had hung up.
        ``stream``: every image file comes through an image streamer listening in ``images_dir``
        (:mod:`torpor.adapters.imagestreamer`), not from the folder. CRIU then runs in ``images_dir``
        with ``--images-dir .``: it connects to the streamer by a path it makes from that argument, and
        a socket path holds at most 107 bytes.

        ``files``: regular files of the image given other descriptors of ours (the image's path without
        its leading '/' → our descriptor, ``--inherit-fd``): a copy of a job writes its own log.
        ``fresh_copy``: the tree is a new copy of one that may still run (a start from a template): its
        TCP connections are not restored but closed (``--tcp-close``), as they are the original's.
        ``net_namespace``: the tree joins this network namespace (a path, ``--join-ns net:``) instead of
        the one it had.
        """
        self.require()
        # each socket the job had connected outside it gets a fresh one whose peer is already closed: the
        # outside end is gone (CRIU cannot reconnect a stream), and the job sees the connection closed
        closed_peers: list[socket.socket] = []
        inherit: list[str] = []
        externals = external_unix_peers(images_dir)
        for peer in externals:
            if peer.reconnects:
                continue  # a datagram socket: CRIU connects it to its peer's address again
            ours, theirs = socket.socketpair(socket.AF_UNIX, peer.type)
            theirs.close()
            closed_peers.append(ours)
            inherit += ["--inherit-fd", f"fd[{ours.fileno()}]:socket:[{peer.ino}]"]
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
            *(("--tcp-close", "--file-locks") if fresh_copy else COMMON_OPTIONS),
            *(["--join-ns", f"net:{net_namespace}"] if net_namespace else []),
            *(arg for key, fd in (files or {}).items() for arg in ("--inherit-fd", f"fd[{fd}]:{key}")),
            *(["--lazy-pages"] if lazy else []),
            *(["--action-script", str(gate.script)] if gate else []),
            *(["--stream"] if stream else []),
            *([EXT_UNIX_SK_OPTION] if externals else []),
            *inherit,
            *extra,
        ]
        try:
            out = self._run(
                args,
                timeout=6 * 3600,
                env=gate.env() if gate else None,
                cwd=images_dir if stream else None,
                pass_fds=[s.fileno() for s in closed_peers] + list((files or {}).values()),
            )
        finally:
            for ours in closed_peers:
                ours.close()
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


def restored_root(pidfile: Path, returned: threading.Event, timeout_s: float = 60.0) -> int | None:
    """The pid of the root of the tree a ``criu restore --pidfile PIDFILE`` is restoring, as soon as
    CRIU wrote it: before the tree runs any of its own code, and before CRIU's last steps, which write
    into the tree's memory (rseq) and so may wait on a lazy page themselves. None if the restore
    ``returned`` first without one, or after ``timeout_s``. Killing that pid kills the whole tree: a
    torpor job is PID 1 of its own PID namespace."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = returned.is_set()
        try:
            text = pidfile.read_text().strip()
        except OSError:
            text = ""
        if text.isdigit():
            return int(text)
        if done or time.monotonic() > deadline:
            return None
        time.sleep(0.005)
