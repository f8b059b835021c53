"""The store of pod identities as the operator reads and clears it: each slot's pod, job and
checkpoints (:func:`slots`), and an identity deleted whole (:func:`remove_identity`). Where the slots are
and how a pod takes one is :mod:`torpor.core.pod`'s.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torpor.adapters.system import private
from torpor.core.engine import Engine
from torpor.core.pod import end_processes, identity_dir, read_json
from torpor.core.records import Records
from torpor.core.recordtypes import Checkpoint, Job
from torpor.core.store import config as store_config
from torpor.core.store.config import StoreConfig
from torpor.errors import TorporError
from torpor.settings import Settings


@dataclass(frozen=True)
class SlotState:
    """What the store says of one slot of an identity, for the operator (:func:`slots`)."""

    identity: str
    slot: int
    #: what its pod wrote of itself (torpor.core.pod.Slot.record)
    pod: dict[str, Any]
    #: the job's state (``None``: no job)
    state: str | None
    checkpoints: list[Checkpoint]
    #: a pod holds it now
    held: bool


def slots(store: Path) -> list[SlotState]:
    """Every slot of every identity in the whole volume ``store`` (``NAMESPACE/NAME/.../slot-N.json``:
    each namespace's folder is what its pods see as theirs), as the store says."""
    found = []
    for info in sorted(store.glob("**/slot-*.json")):
        folder = info.parent
        n = info.stem.removeprefix("slot-")
        home = folder / info.stem
        if not n.isdigit() or not (home / "torpor.db").is_file():
            continue
        try:
            records = Records(home / "torpor.db")
            job: Job | None = next(iter(records.jobs()), None)
        except TorporError:
            continue
        found.append(
            SlotState(
                str(folder.relative_to(store)),
                int(n),
                read_json(info),
                None if job is None else str(job.state),
                records.checkpoints(job.name) if job is not None else [],
                _held(folder / f"{info.stem}.lock"),
            )
        )
    return found


def _held(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


#: empties the S3 prefix of slot N of an identity whose store configuration is this: how many objects
#: went; TorporError, saying why, where it may not or cannot (the operator's: it has the credentials)
PurgeS3 = Callable[[str, int, StoreConfig], int]


def remove_identity(
    store: Path, identity: str, settings: Settings, wait_s: float = 300, purge_s3: PurgeS3 | None = None
) -> list[str]:
    """Delete an identity of the whole volume ``store``: every slot's job and checkpoints, then its
    folder; returns the checkpoint ids deleted. Each slot is taken first (a pod still hibernating into
    it is waited for, ``wait_s`` at most: ``TorporError`` if it does not let go).

    A slot whose images are in S3 has its prefix emptied by ``purge_s3`` (its checkpoints' chunks and
    manifests, without the namespace's key), before any slot's images on the volume go: without a
    purge nothing is deleted, and where one fails the slots on the volume are still whole. Either way
    the caller tries again at its next pass."""
    folder = identity_dir(store / identity.split("/")[0], identity)
    locks = sorted(folder.glob("slot-*.lock"))
    in_s3 = {}
    for lock in locks:
        config = store_config.load(folder / lock.stem)
        if config is not None and config.cold_url(folder / lock.stem).startswith("s3://"):
            if purge_s3 is None:
                raise TorporError(
                    f"{lock.stem} of {identity} has its images in S3 ({config.url}): not removed"
                )
            in_s3[lock.stem] = config
    deleted: list[str] = []
    for lock in sorted(locks, key=lambda each: each.stem not in in_s3):  # stable: by name within each
        fd = private.open_private(lock, os.O_RDWR)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TorporError(f"a pod still holds {lock.name} of {identity}") from None
                    time.sleep(0.5)
            home = folder / lock.stem
            if (home / "torpor.db").is_file():
                engine = Engine(replace(settings, home=home))
                previous = read_json(folder / f"{lock.stem}.json")
                for job in engine.records.jobs():
                    end_processes(engine, job.name, previous, lambda _text: None)
                    if lock.stem in in_s3:
                        deleted += [each.id for each in engine.records.checkpoints(job.name)]
                    else:
                        deleted += engine.remove(job.name)
            if lock.stem in in_s3 and purge_s3 is not None:
                purge_s3(identity, int(lock.stem.removeprefix("slot-")), in_s3[lock.stem])
        finally:
            os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)
    return deleted
