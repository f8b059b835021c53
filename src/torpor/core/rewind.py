"""The files a job writes, around a restore: recorded when it hibernates, cut back, put back on failure.

A restored job continues from its checkpoint and writes again what followed it, so before ``criu
restore`` the files it had open for writing are brought back to their size at the checkpoint
(:func:`rewind_written_files`); :mod:`torpor.policy.rewind` decides, per file, whether to leave it,
cut it, or refuse the restore because someone else changed it since the job stopped. To tell, a
hibernation records the state of those files once the job is gone (:func:`record_stopped`, into
``jobs/NAME/files-at-stop.json``); a job that was stopped or exited has its end time on record instead.

Nothing is changed unless the whole plan proceeds; a cut saves the bytes after the checkpoint's size
under ``jobs/NAME/rewound/CHECKPOINT/`` first (named by their hash, so a second attempt that cuts the same
bytes does not store them twice), and :meth:`Rewound.undo` puts them back — size, content and times —
when the restore then fails, so a failed resume leaves the files as it found them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from torpor.adapters.criuimage import OpenFile, open_files
from torpor.adapters.system import private
from torpor.core.recordtypes import CheckpointId
from torpor.errors import FilesChanged, RestoreFailed
from torpor.policy import rewind as policy

#: in the job's folder: the state of the files it writes, recorded when it last hibernated
STOPPED_FILE = "files-at-stop.json"
_FORMAT = 1


def written_sizes(files: list[OpenFile]) -> dict[Path, tuple[int, bool]]:
    """Each regular file the job had open for writing: (its size at the checkpoint, CRIU checks it).

    CRIU records the size of a file open for writing, and refuses to restore when it changed ("bad
    size") — except for files opened with O_APPEND (logs, CSV files), whose size it does not record.
    For those, the offset of a descriptor that appended is where the file ended after its last write,
    which is its size at the checkpoint when the job is its only writer; a descriptor that never wrote
    (offset 0) says nothing.
    """
    checked: dict[Path, int] = {}
    appended: dict[Path, int] = {}
    for entry in files:
        if not entry.writable:
            continue
        path = Path(entry.path if entry.path.startswith("/") else "/" + entry.path)
        if entry.size is not None:
            checked[path] = entry.size
        elif entry.append and entry.pos > 0:
            appended[path] = max(appended.get(path, 0), entry.pos)
    sizes = {path: (size, False) for path, size in appended.items()}
    sizes.update((path, (size, True)) for path, size in checked.items())
    return sizes


def read_write_paths(files: list[OpenFile]) -> set[Path]:
    """The regular files the job had open read-write (``O_RDWR``): those it may have written anywhere."""
    return {Path(f.path if f.path.startswith("/") else "/" + f.path) for f in files if f.read_write}


def file_state(path: Path) -> policy.FileState | None:
    """``lstat`` of ``path`` as the policy sees it; None when there is nothing there."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return policy.FileState(st.st_size, st.st_mtime_ns, st.st_ino)


# -- at a hibernation ---------------------------------------------------------------------------------


def record_stopped(job_dir: Path, checkpoint_id: CheckpointId, image_dir: Path) -> None:
    """Record the state of the regular files the hibernated job had open for writing (it is gone now).

    Never fails the hibernation: without a record, a resume judges the files by the job's end time.
    """
    files: dict[str, dict[str, int]] = {}
    try:
        for path in written_sizes(open_files(image_dir)):
            state = file_state(path)
            if state is not None and stat.S_ISREG(path.lstat().st_mode):
                files[str(path)] = {"size": state.size, "mtime_ns": state.mtime_ns, "ino": state.ino}
        data = {"format": _FORMAT, "checkpoint": checkpoint_id, "files": files}
        temp = job_dir / (STOPPED_FILE + ".tmp")
        private.write_private(temp, json.dumps(data).encode())
        os.replace(temp, job_dir / STOPPED_FILE)
    except OSError:
        with contextlib.suppress(OSError):
            (job_dir / STOPPED_FILE).unlink()


def adopt_stopped(job_dir: Path) -> None:
    """After the job came from another machine: each file of its record at the hibernation that is here
    with the same size and modification time (carried, or shared) takes this machine's inode number, so
    that a restore here takes it for the job's own file, not one someone else replaced."""
    record = job_dir / STOPPED_FILE
    try:
        data = json.loads(record.read_bytes())
        for path, recorded in data["files"].items():
            state = file_state(Path(path))
            if state is not None and (state.size, state.mtime_ns) == (recorded["size"], recorded["mtime_ns"]):
                recorded["ino"] = state.ino
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # no record (or not one this reads): a restore judges the files by the job's end time
    temp = job_dir / (STOPPED_FILE + ".tmp")
    private.write_private(temp, json.dumps(data).encode())
    os.replace(temp, record)


def load_stopped(job_dir: Path, checkpoint_id: CheckpointId | None) -> dict[str, policy.FileState]:
    """What :func:`record_stopped` recorded at hibernation ``checkpoint_id``; empty if not that one."""
    try:
        data = json.loads((job_dir / STOPPED_FILE).read_bytes())
        if data.get("format") != _FORMAT or data.get("checkpoint") != checkpoint_id:
            return {}
        return {
            path: policy.FileState(int(s["size"]), int(s["mtime_ns"]), int(s["ino"]))
            for path, s in data["files"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


# -- at a restore ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Done:
    path: Path
    size: int  # cut to this
    saved: Path  # the bytes after it
    before: os.stat_result  # the file before the cut
    created: bool  # ``saved`` was written by this cut (not by an earlier one that cut the same bytes)


@dataclass
class Rewound:
    """The cuts a restore made (``paths``), and the way to undo them."""

    done: list[_Done] = field(default_factory=list)
    changed_elsewhere: list[str] = field(default_factory=list)
    changed_inside: list[str] = field(default_factory=list)  # see policy.rewind.changed_inside

    @property
    def paths(self) -> list[str]:
        return [str(d.path) for d in self.done]

    def undo(self) -> list[str]:
        """Put the cut bytes back (and the times); return what could not be, in words."""
        problems = []
        for done in reversed(self.done):
            try:
                now = done.path.lstat()
                if (now.st_ino, now.st_dev, now.st_size) != (
                    done.before.st_ino,
                    done.before.st_dev,
                    done.size,
                ):
                    problems.append(
                        f"{done.path} changed again after torpor cut it; its bytes stay in {done.saved}"
                    )
                    continue
                fd = private.open_private(done.path, os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
                with os.fdopen(fd, "ab") as out, open(done.saved, "rb") as saved:
                    shutil.copyfileobj(saved, out)
                    out.flush()
                    os.fsync(out.fileno())
                os.utime(
                    done.path, ns=(done.before.st_atime_ns, done.before.st_mtime_ns), follow_symlinks=False
                )
                if done.created:
                    done.saved.unlink()
            except OSError as exc:
                problems.append(
                    f"cannot put back the end of {done.path} ({exc.strerror}); it is in {done.saved}"
                )
        with contextlib.suppress(OSError):
            if self.done:
                self.done[0].saved.parent.rmdir()  # only if empty
        self.done.clear()
        return problems


def rewind_written_files(
    image_dir: Path,
    keep_dir: Path,
    keep: frozenset[Path] = frozenset(),
    at_stop: dict[str, policy.FileState] | None = None,
    stopped_ns: int | None = None,
    rewind: bool = False,
    checkpoint_ns: int | None = None,
) -> Rewound:
    """Bring the files the job had open for writing back to their size at the checkpoint, as planned.

    ``at_stop``/``stopped_ns``: what is known of the files when the job stopped (see
    :mod:`torpor.policy.rewind`); ``rewind``: cut files someone else changed too (``--rewind``).
    ``checkpoint_ns``: when the checkpoint was taken, to name the read-write files modified since (the
    result's ``changed_inside``); None: the caller does not ask.
    Files in ``keep`` (the job's own output log, a record of all that happened) are left as they are.
    Raises before changing anything when the plan refuses; the bytes cut off are saved under
    ``keep_dir`` before each cut.
    """
    at_stop = at_stop or {}
    files = []
    opened = open_files(image_dir)
    read_write = read_write_paths(opened)
    for path, (size, checked) in written_sizes(opened).items():
        if path in keep:
            continue
        now = file_state(path)
        if now is not None:
            if os.path.islink(path) or os.path.realpath(path) != str(path):
                # CRIU recorded where the file really was: a link there now was put there since, maybe by
                # someone who wants root to cut another file
                raise RestoreFailed(
                    f"{path} is now reached through a symbolic link ({os.path.realpath(path)}); torpor does "
                    "not rewind a file through a link: put the job's file back at that path"
                )
            if not stat.S_ISREG(path.lstat().st_mode):
                continue
        files.append(
            policy.WrittenFile(str(path), size, checked, now, at_stop.get(str(path)), path in read_write)
        )
    plan = policy.plan(files, stopped_ns, rewind)
    if not plan.proceed:
        raise _refusal(plan.refusals)
    result = Rewound(changed_elsewhere=list(plan.changed_elsewhere))
    if checkpoint_ns is not None:
        result.changed_inside = policy.changed_inside(files, checkpoint_ns)
    try:
        for cut in plan.cuts:
            result.done.append(_cut(Path(cut.path), cut.size, keep_dir))
    except OSError as exc:
        problems = result.undo()
        raise RestoreFailed(
            f"cannot rewind {exc.filename or 'a file the job writes'}: {exc.strerror}", details=problems
        ) from exc
    return result


def _refusal(refusals: tuple[policy.Refusal, ...]) -> RestoreFailed | FilesChanged:
    listed = "; ".join(f"{r.path}: {r.reason}" for r in refusals)
    if not any(r.foreign for r in refusals):
        return RestoreFailed(listed)
    if all(r.rewindable for r in refusals):
        hint = (
            "nothing was changed; if the job's view should win, pass --rewind (torpor cuts each file back "
            "to its size at the checkpoint, the later bytes saved first), otherwise restore an older "
            "checkpoint or start the job again"
        )
    else:
        hint = (
            "nothing was changed; the job cannot continue without its files as they were: put them "
            "back, restore another checkpoint, or start the job again"
        )
    count = len(refusals)
    return FilesChanged(
        f"{count} file(s) the job writes changed since it stopped ({listed}); {hint}",
        details=[f"{r.path}: {r.reason}" for r in refusals] if count > 1 else [],
    )


def _cut(path: Path, size: int, keep_dir: Path) -> _Done:
    """Save the bytes of ``path`` after ``size`` under ``keep_dir`` (once: named by their hash), then cut."""
    private.make_private_dirs(keep_dir)
    fd = private.open_private(path, os.O_RDWR | os.O_NOCTTY)
    with open(fd, "r+b") as handle:
        before = os.fstat(handle.fileno())
        temp = keep_dir / f".saving-{os.getpid()}"
        digest = hashlib.sha256()
        handle.seek(size)
        with os.fdopen(private.open_private(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as out:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        name = str(path).strip("/").replace("/", "%") + f".{digest.hexdigest()[:12]}.after-{size}"
        saved = keep_dir / name
        created = not saved.exists()
        if created:
            os.replace(temp, saved)
        else:
            temp.unlink()  # the same bytes, saved by an earlier attempt
        handle.truncate(size)
    return _Done(path, size, saved, before, created)
