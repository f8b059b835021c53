"""The exceptions torpor raises on purpose, with the exit code the CLI uses for each.

::

    TorporError                      expected failures: the CLI prints the message, no traceback
    ├── UsageError (2)               bad input: unknown job, bad id, bad flag combination
    │   ├── JobNotFound
    │   ├── CheckpointNotFound
    │   ├── WrongState               e.g. checkpoint a hibernated job, resume a running one
    │   ├── FilesChanged             a resume would cut files someone else changed since the job stopped
    │   └── TemplateNotFound         no template of that name
    ├── EnvironmentProblem (3)       the machine cannot do it: CRIU missing/too old, dir not writable
    │   ├── CriuUnavailable
    │   ├── UnsafePath               a folder torpor keeps state in is not its own (owner, mode, link)
    │   ├── JobStartFailed           the job could not be started: no PID or IPC namespace, its command won't exec
    │   ├── SlurmCommandFailed       a Slurm client command failed (slurmctld unreachable, unknown job)
    │   └── NotTrackable             a running process's writes cannot be tracked here (adapters/writetrack)
    ├── CheckpointFailed (4)         a dump failed; the job was left running (invariant 1)
    │   ├── JobExited                the job ended while it was being checkpointed
    │   └── PreCopyIncomplete        a pre-copied dump found a page torpor holds no copy of (dumped again, whole)
    ├── RestoreFailed (5)            a restore failed; the image and the job record are unchanged
    ├── StoreError (6)               the image store refused or lost data
    │   ├── CorruptImage             a byte read back does not match its content hash
    │   ├── StorageFull              no space left
    │   ├── ObjectNotFound           a backend has no object of that name
    │   ├── KeyProblem               encryption key missing, unreadable or not the store's key
    │   └── StoreBusy                the store stayed locked by others (e.g. gc during writes)
    ├── LauncherUnreachable (7)      the job's launcher does not answer on its socket
    │   └── LauncherFailed           a new launcher died before it reported (its log's last lines say why)
    └── DemoFailed (1)               the demo's own check failed (its job ended, a step never came)

Errors that reveal a bug in torpor are *not* TorporErrors, so no handler swallows them.
"""

from __future__ import annotations


class TorporError(Exception):
    """Base of every failure torpor expects and explains; ``str()`` is the one-line message."""

    exit_code = 1

    def __init__(self, message: str, *, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: extra lines that explain the failure (e.g. the CRIU log lines), shown under the message
        self.details: list[str] = list(details or [])

    def to_dict(self) -> dict[str, object]:
        # a class the other side cannot rebuild (a private one) crosses as its nearest mapped ancestor,
        # so that its exit code survives
        name = next(c.__name__ for c in type(self).__mro__ if _BY_NAME.get(c.__name__) is c)
        return {"error": name, "message": self.message, "details": self.details}


class UsageError(TorporError):
    exit_code = 2


class JobNotFound(UsageError):
    pass


class CheckpointNotFound(UsageError):
    pass


class WrongState(UsageError):
    pass


class FilesChanged(UsageError):
    pass


class TemplateNotFound(UsageError):
    pass


class EnvironmentProblem(TorporError):
    exit_code = 3


class CriuUnavailable(EnvironmentProblem):
    pass


class UnsafePath(EnvironmentProblem):
    """A place torpor would keep images or state in could be read or changed by someone else."""


class JobStartFailed(EnvironmentProblem):
    """The launcher could not start the job: creating its PID and IPC namespaces failed, or its command would
    not run."""


class SlurmCommandFailed(EnvironmentProblem):
    """A Slurm client command failed (slurmctld unreachable, unknown job); ``details`` holds what it said."""


class NotTrackable(EnvironmentProblem):
    """The pages a process writes cannot be tracked here (the kernel, the architecture, or the process);
    the message says why, in one line."""


class CheckpointFailed(TorporError):
    exit_code = 4


class JobExited(CheckpointFailed):
    pass


class PreCopyIncomplete(CheckpointFailed):
    """A pre-copied dump cannot be made whole (torpor.core.precopy): the checkpoint dumps the job again,
    whole."""


class CudaError(CheckpointFailed):
    """A call of NVIDIA's checkpoint API failed, or the API is not there (torpor.adapters.cuda)."""


class RestoreFailed(TorporError):
    exit_code = 5


class StoreError(TorporError):
    exit_code = 6


class CorruptImage(StoreError):
    pass


class StorageFull(StoreError):
    pass


class ObjectNotFound(StoreError):
    pass


class KeyProblem(StoreError):
    pass


class StoreBusy(StoreError):
    pass


class LauncherUnreachable(TorporError):
    exit_code = 7


class LauncherFailed(LauncherUnreachable):
    """A launcher died before reporting that it started (or restored) the job."""


class DemoFailed(TorporError):
    """The demo's own check failed: its job ended early, a step never came, processes outlived hibernation."""

    exit_code = 1


_BY_NAME: dict[str, type[TorporError]] = {
    cls.__name__: cls
    for cls in (
        TorporError,
        UsageError,
        JobNotFound,
        CheckpointNotFound,
        WrongState,
        FilesChanged,
        TemplateNotFound,
        EnvironmentProblem,
        CriuUnavailable,
        UnsafePath,
        JobStartFailed,
        SlurmCommandFailed,
        NotTrackable,
        CheckpointFailed,
        JobExited,
        PreCopyIncomplete,
        CudaError,
        RestoreFailed,
        StoreError,
        CorruptImage,
        StorageFull,
        ObjectNotFound,
        KeyProblem,
        StoreBusy,
        LauncherUnreachable,
        LauncherFailed,
        DemoFailed,
    )
}


def from_dict(data: dict[str, object]) -> TorporError:
    """Rebuild an error that crossed a process boundary (launcher → CLI) as JSON."""
    cls = _BY_NAME.get(str(data.get("error")), TorporError)
    raw_details = data.get("details")
    details = [str(line) for line in raw_details] if isinstance(raw_details, list) else []
    return cls(str(data.get("message", "unknown error")), details=details)
