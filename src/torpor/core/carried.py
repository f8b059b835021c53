"""Files a job writes, carried to where it is restored: put in their places on the machine it moved to
(:func:`place`, for an arrival), and kept in a pod's slot from one pod to the next (:func:`keep`,
:func:`put_back`).

A pod's own file systems do not follow its identity to another node: the container's root file system,
its ``emptyDir`` volumes and other tmpfs mounts are the node's (:func:`torpor.policy.pod.pod_local`). A
job that wrote a file there (its scratch data, a log of its own) could not be restored on another node
without it: CRIU finds the file missing, or of another size. So when a pod's job hibernates, each file
the checkpoint saw the job writing on such a file system is copied into the slot, beside the job's
records (``carried/``, ``carried.json``: path, size, modification time, owner, mode), cut to its size
at the stop; the next pod of the identity, on any node, puts back each one that is not there as it was
before it restores the job. Files on other volumes (a PersistentVolumeClaim, NFS, the store itself) are
the volume's and stay where they are. Only a hibernation carries files: a pod that comes back from a
periodic checkpoint (its pod killed, its node gone) finds those files as its node has them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torpor.adapters.system import mounts, private
from torpor.core import rewind
from torpor.core.migrate import written_there
from torpor.core.recordtypes import CheckpointId
from torpor.errors import EnvironmentProblem, WrongState
from torpor.policy import migration
from torpor.policy import pod as pod_policy

#: in a slot's state directory: the copies, and what they are
CARRIED_DIR, CARRIED_LIST = "carried", "carried.json"


def place(path: Path, staged: Path, each: dict[str, Any], tag: str) -> None:
    """Put the copy ``staged`` in the place of ``path`` (a copy beside it, then renamed over it: a file
    there is replaced whole or not at all), with the owner, mode and modification time ``each`` gives
    (``uid``, ``gid``, ``mode``, ``mtime_ns``); ``tag`` names the copy beside it while it is written."""
    problems = migration.written_problems((each["uid"], each["gid"]), written_there(str(path)))
    if migration.FOREIGN in problems:
        raise WrongState(f"{path} belongs to another user here: the job's file is not put over it")
    if migration.NO_FOLDER in problems:
        raise EnvironmentProblem(f"cannot put {path} in its place here: {os.strerror(errno.ENOENT)}")
    if migration.LINKED in problems:
        raise WrongState(f"{path} is reached through a symbolic link here: the job's file is not put there")
    if migration.SHUT in problems:
        raise WrongState(f"{path.parent} is not the job's user's to write in here: its file is not put there")
    beside = path.with_name(f".{path.name}.torpor-{tag}")
    with contextlib.suppress(FileNotFoundError):
        beside.unlink()
    try:
        fd = os.open(beside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out, staged.open("rb") as source:
            shutil.copyfileobj(source, out, 1 << 20)
            out.flush()
            os.fchown(fd, each["uid"], each["gid"])
            os.fchmod(fd, each["mode"])
            os.utime(fd, ns=(each["mtime_ns"], each["mtime_ns"]))
            os.fsync(fd)
        os.replace(beside, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            beside.unlink()
        raise EnvironmentProblem(f"cannot put {path} in its place here: {exc.strerror}") from exc


def keep(
    home: Path, job_dir: Path, checkpoint_id: CheckpointId, store: Path, say: Callable[[str], None]
) -> int:
    """After the hibernation ``checkpoint_id`` of the job of the slot ``home``: copy into it the files
    the job wrote on the pod's own file systems (not under ``store``, the volume the slots are on); how
    many. A file that cannot be read is said and left out: the next pod restores without it, or starts
    cold saying why."""
    stopped = rewind.load_stopped(job_dir, checkpoint_id)
    shared = os.path.realpath(store)
    folder, listed = home / f"{CARRIED_DIR}.new", list[dict[str, Any]]()
    shutil.rmtree(folder, ignore_errors=True)
    private.make_private_dirs(folder)
    for path, state in sorted(stopped.items()):
        real = os.path.realpath(path)
        mount = mounts.mount_of(real)
        if real == shared or real.startswith(shared + "/") or mount is None:
            continue
        if not pod_policy.pod_local(str(mount.point), mount.fstype, mount.root):
            continue
        copy = folder / str(len(listed))
        try:
            fd = private.open_private(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with open(path, "rb") as source, os.fdopen(fd, "wb") as out:
                info = os.fstat(source.fileno())
                left = state.size
                while left > 0 and (piece := source.read(min(left, 1 << 20))):
                    out.write(piece)
                    left -= len(piece)
        except OSError as exc:
            say(f"cannot keep {path}, a file the job writes, for the next pod: {exc.strerror}")
            continue
        listed.append(
            {
                "path": path,
                "size": state.size - left,  # shorter than at the stop only if someone cut it since
                "mtime_ns": info.st_mtime_ns,
                "mode": stat.S_IMODE(info.st_mode),
                "uid": info.st_uid,
                "gid": info.st_gid,
            }
        )
    shutil.rmtree(home / CARRIED_DIR, ignore_errors=True)
    os.replace(folder, home / CARRIED_DIR)
    data = {"checkpoint": checkpoint_id, "files": listed}
    private.write_private(home / f"{CARRIED_LIST}.tmp", json.dumps(data).encode())
    os.replace(home / f"{CARRIED_LIST}.tmp", home / CARRIED_LIST)
    if listed:
        total = sum(each["size"] for each in listed)
        say(
            f"kept {len(listed)} file(s) the job writes in this pod ({total / 2**20:.1f} MiB) for the next pod"
        )
    return len(listed)


def put_back(home: Path, job_dir: Path, checkpoint_id: CheckpointId, say: Callable[[str], None]) -> int:
    """Before the slot's job is restored from ``checkpoint_id``: put back each file :func:`keep` kept
    at that hibernation that is not here as it was (a new node has none of them); how many. Raises
    what :func:`place` raises (the restore then does not run)."""
    try:
        data = json.loads((home / CARRIED_LIST).read_bytes())
    except (OSError, ValueError):
        return 0
    if not isinstance(data, dict) or data.get("checkpoint") != checkpoint_id:
        return 0  # kept at another hibernation: this checkpoint is not the one they are of
    placed = 0
    for index, each in enumerate(data.get("files") or []):
        here = rewind.file_state(Path(each["path"]))
        if here is not None and (here.size, here.mtime_ns) == (each["size"], each["mtime_ns"]):
            continue  # the same node, or a volume that came along: as the job left it
        try:
            os.makedirs(os.path.dirname(each["path"]), exist_ok=True)
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot make the folder of {each['path']} here: {exc.strerror}"
            ) from exc
        place(Path(each["path"]), home / CARRIED_DIR / str(index), each, "pod")
        placed += 1
    if placed:
        say(f"put back {placed} file(s) the job writes, kept by the pod before")
    rewind.adopt_stopped(job_dir)
    return placed
