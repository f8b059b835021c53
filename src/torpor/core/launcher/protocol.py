"""How the CLI and a launcher it starts talk before the control socket exists: the spec and three pipes.

Both ends are here, so that the order of the conversation is read in one place:

* **spec** — :class:`LaunchSpec` (settings, job, start or restore) travels on the launcher's command
  line, as JSON;
* **go** (CLI → launcher) — the launcher starts early (a restore fetches its image meanwhile) and waits
  for one line: ``{}`` for a start, a :class:`RestoreSpec` for a restore; EOF calls it off;
* **ready** (launcher → CLI) — one line: :class:`Started` (the job runs) or a serialised
  :class:`~torpor.errors.TorporError`;
* **life** — the launcher holds its write end until it exits: EOF at the CLI's end says it has.

Starting the process is :mod:`torpor.core.launcher.spawn`'s; what the launcher does is
:mod:`torpor.core.launcher.server`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from torpor.core.recordtypes import CheckpointId, JobName
from torpor.errors import LauncherFailed, TorporError, from_dict
from torpor.settings import Settings


class LaunchMode(StrEnum):
    """What a new launcher is for: start the job's command, or restore it from an image."""

    START = "start"  # run the job's command
    RESTORE = "restore"  # restore the job from an image (the rest comes as a RestoreSpec)


@dataclass(frozen=True)
class LaunchSpec:
    """What the CLI asks a new launcher to do (JSON on its command line)."""

    #: the CLI's Settings (Settings.to_dict; the store configuration is the state directory's, read at use)
    settings_dict: dict[str, Any]
    job: JobName
    mode: LaunchMode
    #: a start's environment and umask, when not the caller's own (a job the agent starts for a
    #: ``torpor submit`` runs with its submitter's); None: inherited from the launcher's caller
    env: dict[str, str] | None = None
    umask: int | None = None
    #: a start's cgroup folder (the scheduler's per-job memory cgroup): the job's first process joins it
    #: before it runs, so that everything the job allocates is counted there (a restore needs none: CRIU
    #: puts the restored tree back into the cgroups it was dumped from)
    cgroup: str | None = None
    #: ``--warm-start``: once the job is ready by ``ready_when`` (policy.ready), the launcher saves it as
    #: template ``warm``
    warm: str | None = None
    ready_when: str | None = None

    def settings(self) -> Settings:
        return Settings.from_dict(self.settings_dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        data = json.loads(text)
        return cls(
            data["settings_dict"],
            JobName(data["job"]),
            LaunchMode(data["mode"]),
            data.get("env"),
            data.get("umask"),
            data.get("cgroup"),
            data.get("warm"),
            data.get("ready_when"),
        )


@dataclass(frozen=True)
class RestoreSpec:
    """The rest of a restore's spec, sent on the go pipe once the image is in place."""

    image_dir: str  # the image folder (verified but for a gate) the launcher consumes
    checkpoint_id: CheckpointId  # which checkpoint the image is
    lazy: bool = False  # start the job before its memory is in (CRIU lazy pages)
    served: bool = False  # lazy restore: memory comes from the store through torpor's page server
    stream: bool = False  # CRIU reads the image from the image streamer the CLI runs on it
    #: the image's pages are still being verified by process ``gate_pid``, which writes its verdict to
    #: the file ``gate``; the restored job runs only once it says so (criu.RestoreGate)
    gate: str | None = None
    gate_pid: int | None = None
    #: the image is a template's whose job wrote to this log: the job is a new copy (restore.py)
    copy_of: str | None = None
    #: the network namespace (a path) the restored tree joins: the job's own network
    net_namespace: str | None = None
    #: the image names its network namespace as external (it was dumped in a job network): it is handed
    #: ``net_namespace`` (the machine's own when None) as a descriptor
    net_external: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestoreSpec:
        return cls(**{**data, "checkpoint_id": CheckpointId(data["checkpoint_id"])})


@dataclass(frozen=True)
class Go:
    """What the go pipe said: go ahead, with the restore's spec for a restore."""

    restore: RestoreSpec | None


@dataclass(frozen=True)
class Started:
    """The launcher's report on the ready pipe: the job runs as ``pid``."""

    pid: int
    launcher_pid: int


@dataclass(frozen=True)
class LauncherEnds:
    """The pipe ends a new launcher keeps; the CLI closes its copies once the launcher has them."""

    ready_w: int
    go_r: int
    life_w: int

    @property
    def fds(self) -> tuple[int, int, int]:
        return (self.ready_w, self.go_r, self.life_w)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


# -- the CLI's end -----------------------------------------------------------------------------------


class PendingLauncher:
    """A launcher that has started and waits for the rest of its spec on a pipe (or for EOF: abort)."""

    def __init__(self, job: JobName, log: Path, ready_fd: int, go_fd: int, life_fd: int) -> None:
        self.job = job
        self.log = log
        self.ready_fd = ready_fd
        self.go_fd: int | None = go_fd
        self.life_fd = life_fd

    @classmethod
    def open_pipes(cls, job: JobName, log: Path) -> tuple[PendingLauncher, LauncherEnds]:
        """The three pipes: the CLI's ends (as a PendingLauncher) and the ends the launcher is to keep."""
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        life_r, life_w = os.pipe()
        return cls(job, log, ready_r, go_w, life_r), LauncherEnds(ready_w, go_r, life_w)

    def close(self) -> None:
        """Close the CLI's ends of a launcher that could not be started."""
        for fd in (self.ready_fd, self.go_fd, self.life_fd):
            if fd is not None:
                os.close(fd)
        self.go_fd = None

    def release(self, restore: RestoreSpec | None = None) -> Started:
        """Send the rest of the spec and wait for the launcher's report; raise its error if it failed."""
        assert self.go_fd is not None
        try:
            os.write(self.go_fd, json.dumps(restore.to_json() if restore else {}).encode() + b"\n")
        except BrokenPipeError:
            pass  # it died already: its report (or its silence) says why
        finally:
            os.close(self.go_fd)
            self.go_fd = None
        with os.fdopen(self.ready_fd) as pipe:
            line = pipe.readline()
        if not line:
            self._wait_gone()
            tail = self.log.read_text(errors="replace").splitlines()[-8:]
            raise LauncherFailed(f"the launcher for '{self.job}' died before reporting", details=tail)
        report: dict[str, Any] = json.loads(line)
        if not report.get("ok"):
            self._wait_gone()
            raise from_dict(report)
        os.close(self.life_fd)
        return Started(pid=int(report["pid"]), launcher_pid=int(report["launcher_pid"]))

    def abort(self) -> None:
        """Tell a launcher still waiting for :meth:`release` to exit without doing anything."""
        if self.go_fd is not None:
            os.close(self.go_fd)
            self.go_fd = None
            os.close(self.ready_fd)
            self._wait_gone()

    def _wait_gone(self, timeout: float = 60) -> None:
        """Wait for the launcher to exit (so the next command sees what it left), at most ``timeout``."""
        try:
            ready, _, _ = select.select([self.life_fd], [], [], timeout)
            if ready:
                os.read(self.life_fd, 1)  # EOF: its end closed as it exited
        finally:
            os.close(self.life_fd)


# -- the launcher's end ------------------------------------------------------------------------------


def receive_go(go_fd: int) -> Go | None:
    """Wait for the CLI's go (closing the pipe); None: it called the launch off."""
    with os.fdopen(go_fd, "rb") as go:
        line = go.readline()
    if not line:
        return None
    data = json.loads(line)
    return Go(RestoreSpec.from_json(data) if data else None)


def report_started(ready_fd: int, started: Started) -> None:
    _report(ready_fd, {"ok": True, **asdict(started)})


def report_failed(ready_fd: int, exc: TorporError) -> None:
    _report(ready_fd, {"ok": False, **exc.to_dict()})


def _report(fd: int, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps(message).encode() + b"\n")
    with contextlib.suppress(OSError):
        os.close(fd)
