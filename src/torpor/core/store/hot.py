"""The hot tier: a folder in RAM that CRIU dumps into, so the job resumes at memory speed.

Layout under the hot folder::

    <id>.partial/           a dump in progress (``.owner`` says which process); never listed
    <id>/                   a complete image: the CRIU files plus ``.torpor.json`` (its record)
    restore-<id>-<rand>/    an image being restored (removed by the engine once CRIU has read it)
    destager.lock           held (flock) by the running destager
    destager.log            what the destager did

The record (written atomically, format-versioned) holds the checkpoint's job, each file's size and, once
taken, BLAKE3 hash, and its state: ``staged`` (waiting for the destager), ``destaging`` (with bytes done),
``durable`` (a manifest is in the cold tier; the hot copy is only a cache now: the destager drops it
once a newer checkpoint of the job is durable, :meth:`HotTier.make_room` oldest first when the tier
is over capacity, and :meth:`HotTier.take_over` when the job's next checkpoint writes over its memory —
which copies go is :mod:`torpor.policy.hot`'s decision, the I/O is here). A hot image
is verified when read back like any other: once durable, against its manifest's chunk hashes (the
destager's one pass over the image both stores and hashes it); before that, against file hashes taken by
the first restore — so that ``put`` costs only a rename.

Whose folder it is — made private, checked to be torpor's own on every use, mounted — is
:mod:`torpor.core.store.hotfolder`'s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import blake3

from torpor.adapters.system import private, procfs
from torpor.core.store.base import STAGED
from torpor.core.store.hotfolder import HotFolder
from torpor.core.store.manifest import safe_file_name
from torpor.core.store.pagemap import read_pagemap
from torpor.errors import (
    CheckpointNotFound,
    CorruptImage,
    StorageFull,
    StoreError,
    TorporError,
    UnsafePath,
)
from torpor.policy import hot as hot_policy

RECORD = ".torpor.json"
OWNER = ".owner"
#: in a dump's staging folder: the processes being dumped, one per line
PIDS = ".pids"
#: in a dump's staging folder: the checkpoint's kind (``hibernate``, ...)
KIND = ".kind"
RECORD_FORMAT = "torpor-hot-image"
RECORD_VERSION = 1


@dataclass(frozen=True)
class HotRecord:
    """A hot image's record (``.torpor.json``): its job, its files' sizes and hashes, its way to durable."""

    id: str
    job: str
    created_at: float
    files: dict[str, list[Any]]  # name -> [size, blake3 hex]
    state: str = STAGED  # an ImageState's value (the record is JSON)
    done_bytes: int = 0
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    stored_bytes: int | None = None

    @property
    def size(self) -> int:
        return sum(int(size) for size, _ in self.files.values())


def as_copy(record: HotRecord, size: int = 0) -> hot_policy.HotCopy:
    """The hot-tier policy's view of ``record``, which takes ``size`` bytes in the tier."""
    kind = record.meta.get("kind")
    return hot_policy.HotCopy(
        record.id, record.job, record.state, record.created_at, str(kind) if kind else None, size
    )


def hash_file(path: Path) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(path)
    return str(hasher.hexdigest())


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    private.write_private(tmp, json.dumps(data).encode())
    os.replace(tmp, path)  # RAM: nothing to fsync, a crash loses the tier anyway


def write_owner(partial: Path, pids: Sequence[int] = (), kind: str | None = None) -> None:
    """Mark a new ``.partial`` folder as this process's dump, of ``pids`` (for :func:`dumped_pids`),
    a checkpoint of ``kind`` (for :func:`dumped_kind`)."""
    if pids:
        private.write_private(partial / PIDS, "".join(f"{pid}\n" for pid in pids).encode())
    if kind:
        private.write_private(partial / KIND, kind.encode())
    private.write_private(partial / OWNER, str(os.getpid()).encode())


def dumped_pids(partial: Path) -> list[int]:
    """The processes a dump in progress into ``partial`` is of (none if it did not say)."""
    try:
        return [int(line) for line in (partial / PIDS).read_text().split()]
    except (OSError, ValueError):
        return []


def dumped_kind(partial: Path) -> str | None:
    """The kind of the checkpoint being dumped into ``partial`` (``None`` if it did not say)."""
    try:
        return (partial / KIND).read_text() or None
    except OSError:
        return None


def owner_alive(partial: Path) -> bool:
    """Whether the process that made a ``.partial`` folder (its ``.owner`` file) still runs."""
    try:
        pid = int((partial / OWNER).read_text())
    except (OSError, ValueError):
        return time.time() - partial.stat().st_mtime < 3600  # unknown owner: only very old ones go
    return procfs.is_alive(pid)


class HotTier:
    """Images in RAM: staged by dumps, committed by a rename, read back linked, dropped once durable."""

    def __init__(
        self, root: Path, capacity: int | None = None, own_mount: bool = False, home: Path | None = None
    ) -> None:
        self.root = root
        self._capacity = capacity
        #: the folder itself; ``own_mount``: torpor's tmpfs on it (only for the default place in /dev/shm);
        #: ``home``: the state directory it belongs to, written into it
        self.folder = HotFolder(root, own_mount, home)

    @property
    def capacity(self) -> int:
        if self._capacity is not None:
            return self._capacity
        try:
            stat = os.statvfs(self.root if self.root.exists() else self.root.parent)
        except OSError:
            return 0
        return stat.f_blocks * stat.f_frsize // 2

    def _dir(self, checkpoint_id: str) -> Path:
        if not safe_file_name(checkpoint_id) or checkpoint_id.startswith(".") or "." in checkpoint_id:
            raise CheckpointNotFound(f"'{checkpoint_id}' is not a checkpoint id")
        return self.root / checkpoint_id

    def ensure(self) -> None:
        """Make the hot tier, or check that the one there is torpor's own (see :mod:`.hotfolder`)."""
        self.folder.ensure()

    def exists(self) -> bool:
        """Whether the hot tier is there; raises :class:`~torpor.errors.UnsafePath` if it is not ours."""
        return self.folder.exists()

    def remove_all(self) -> None:
        """Delete the whole hot tier, images included, and unmount torpor's tmpfs if it has one."""
        self.folder.remove_all()

    # -- staging ------------------------------------------------------------------------------------

    def staging_dir(
        self, checkpoint_id: str, size_hint: int | None, pids: Sequence[int] = (), kind: str | None = None
    ) -> Path | None:
        """A folder to dump into, or ``None`` when the hint says the image will not fit."""
        self.ensure()
        need = size_hint or 0
        if need and not self.make_room(need):
            return None
        partial = self.root / f"{self._dir(checkpoint_id).name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(mode=0o700)
            write_owner(partial, pids, kind)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            return None if exc.errno == 28 else _raise(exc, self.root)
        return partial

    def dumps_in_progress(self) -> list[Path]:
        """The folders a process that is alive (its ``.owner`` says so) is dumping into now."""
        if not self.exists():
            return []
        found = []
        for entry in self.root.iterdir():
            if entry.name.endswith(".partial"):
                with contextlib.suppress(OSError, ValueError):
                    if procfs.is_alive(int((entry / OWNER).read_text())):
                        found.append(entry)
        return found

    def owns(self, image_dir: Path) -> bool:
        return image_dir.parent == self.root and image_dir.name.endswith(".partial")

    def commit(self, checkpoint_id: str, job: str, partial: Path, meta: dict[str, Any]) -> HotRecord:
        """Make the dumped image visible (rename: all or nothing).

        Its files are hashed later, by the destager (chunk by chunk, into the manifest) or by the first
        restore (:meth:`hash_files`), so that the checkpoint returns as soon as the dump is done.
        """
        final = self._dir(checkpoint_id)
        files: dict[str, list[Any]] = {}
        for path in sorted(partial.iterdir()):
            if path.name.startswith(".") or not path.is_file() or path.is_symlink():
                continue
            files[path.name] = [path.stat().st_size, None]
        record = HotRecord(checkpoint_id, job, float(meta.get("created_at") or time.time()), files, meta=meta)
        try:
            self._write(partial, record)
            (partial / PIDS).unlink(missing_ok=True)
            (partial / KIND).unlink(missing_ok=True)
            (partial / OWNER).unlink(missing_ok=True)
            os.rename(partial, final)
        except OSError as exc:
            _raise(exc, self.root)
        return record

    # -- records ------------------------------------------------------------------------------------

    def _write(self, folder: Path, record: HotRecord) -> None:
        _write_json_atomic(
            folder / RECORD, {"format": RECORD_FORMAT, "version": RECORD_VERSION, **asdict(record)}
        )

    def record(self, checkpoint_id: str) -> HotRecord | None:
        folder = self._dir(checkpoint_id)
        if not self.exists():
            return None
        try:
            data = json.loads((folder / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            return None
        if data.get("version") != RECORD_VERSION:
            return None
        data.pop("format")
        data.pop("version")
        try:
            return HotRecord(**data)
        except TypeError:
            return None

    def records(self) -> list[HotRecord]:
        if not self.exists():
            return []
        found = []
        for entry in self.root.iterdir():
            if "." in entry.name or entry.name.startswith("restore-") or not entry.is_dir():
                continue
            record = self.record(entry.name)
            if record is not None:
                found.append(record)
        return sorted(found, key=lambda r: r.created_at)

    @contextlib.contextmanager
    def _locked(self, checkpoint_id: str) -> Iterator[None]:
        """Serialises read-modify-write of one record (the destager and a restore may both update it)."""
        folder = self._dir(checkpoint_id)
        try:
            if not self.exists():
                raise FileNotFoundError(errno.ENOENT, "no hot tier", str(self.root))
            fd = private.open_private(folder / ".lock", os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:
            yield  # the image is gone: nothing to protect
            return
        except OSError as exc:
            raise tier_error(exc, self.root) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def update(self, checkpoint_id: str, **changes: Any) -> HotRecord | None:
        with self._locked(checkpoint_id):
            record = self.record(checkpoint_id)
            if record is None:
                return None
            record = replace(record, **changes)
            with contextlib.suppress(OSError):
                self._write(self._dir(checkpoint_id), record)
            return record

    def hash_files(self, checkpoint_id: str) -> HotRecord | None:
        """Record the BLAKE3 hash of each file that has none yet (hashes once recorded are kept)."""
        record = self.record(checkpoint_id)
        if record is None or all(digest for _, digest in record.files.values()):
            return record
        source = self._dir(checkpoint_id)
        hashed = {name: digest or hash_file(source / name) for name, (_, digest) in record.files.items()}
        with self._locked(checkpoint_id):
            current = self.record(checkpoint_id)
            if current is None:
                return None
            files = {name: [size, digest or hashed[name]] for name, (size, digest) in current.files.items()}
            return self._rewrite(checkpoint_id, current, files=files)

    def _rewrite(self, checkpoint_id: str, record: HotRecord, **changes: Any) -> HotRecord:
        record = replace(record, **changes)
        with contextlib.suppress(OSError):
            self._write(self._dir(checkpoint_id), record)
        return record

    def image_dir(self, checkpoint_id: str) -> Path:
        return self._dir(checkpoint_id)

    def remove(self, checkpoint_id: str) -> None:
        if self.exists() and (doomed := self._away(checkpoint_id)) is not None:
            shutil.rmtree(doomed, ignore_errors=True)

    def _away(self, checkpoint_id: str) -> Path | None:
        """Rename an image's folder out of sight before it is deleted, so that a half-deleted image is
        never listed nor linked by a restore; where it went, or None when it was gone already."""
        doomed = self.root / f".{checkpoint_id}.{uuid.uuid4().hex[:6]}.deleting"
        try:
            os.rename(self._dir(checkpoint_id), doomed)
        except FileNotFoundError:
            return None
        return doomed

    def take_over(self, checkpoint_id: str, dest: Path) -> dict[int, Path]:
        """Drop the durable copy ``checkpoint_id``, its pages files moved into ``dest`` first (as
        ``.memory-PID``, PID as its pagemap names the process); those files by PID.

        Its memory is then there for a new dump of the same job to write over (see
        :func:`torpor.policy.hot.to_take_over`). Renamed away first, as :meth:`remove` does, so that no
        restore links it from now on; a file a restore linked before (more than one link) stays with that
        restore.
        """
        try:
            doomed = self._away(checkpoint_id)
        except OSError as exc:
            raise tier_error(exc, self.root) from exc
        if doomed is None:
            return {}  # dropped meanwhile
        taken: dict[int, Path] = {}
        try:
            for path in doomed.glob("pagemap-*.img"):
                pid = path.name.removeprefix("pagemap-").removesuffix(".img")
                try:
                    pages = doomed / read_pagemap(path).pages_file
                    if not pid.isdigit() or os.lstat(pages).st_nlink != 1:
                        continue
                    os.rename(pages, dest / f".memory-{pid}")
                except (OSError, ValueError, IndexError):
                    continue  # not taken: its memory is freed with the rest
                taken[int(pid)] = dest / f".memory-{pid}"
        finally:
            shutil.rmtree(doomed, ignore_errors=True)
        return taken

    # -- capacity -----------------------------------------------------------------------------------

    def used(self) -> int:
        return sum(self._used_by_entry().values())

    def _used_by_entry(self) -> dict[str, int]:
        return used_by_entry(self.root) if self.exists() else {}

    def free_bytes(self) -> int:
        """Room left on the hot tier's file system (others may use it too, e.g. all of /dev/shm)."""
        try:
            stat = os.statvfs(self.root if self.root.exists() else self.root.parent)
        except OSError:
            return 0
        return stat.f_bavail * stat.f_frsize

    def make_room(self, need: int) -> bool:
        """Drop durable hot copies, oldest first, until ``need`` more bytes fit; whether they do.

        Which copies go is :func:`torpor.policy.hot.make_room`'s decision, on the tier measured once here.
        """
        records = self.records()
        sizes = self._used_by_entry()
        tier = hot_policy.Tier(
            copies=[as_copy(record, sizes.get(record.id, 0)) for record in records],
            used=sum(sizes.values()),
            capacity=self.capacity,
            free=self.free_bytes(),
        )
        room = hot_policy.make_room(tier, need)
        for checkpoint_id in room.drop:
            self.remove(checkpoint_id)
        return room.fits

    # -- reading back -------------------------------------------------------------------------------

    def restore_dir(self, checkpoint_id: str) -> Path:
        self.ensure()
        return self.root / f"restore-{self._dir(checkpoint_id).name}-{uuid.uuid4().hex[:6]}"

    def link_out(self, record: HotRecord, dest: Path) -> bool:
        """Link (or copy) the files of the hot image ``record`` into ``dest``, unverified; False if gone.

        The caller verifies them (:class:`~torpor.core.store.tiered.TieredStore`), against the
        manifest once the image is durable, else against the hashes of :meth:`hash_files`.
        """
        checkpoint_id = record.id
        source = self._dir(checkpoint_id)
        if not self.exists():
            return False
        private.make_private_dirs(dest)
        try:
            for name, (size, _digest) in record.files.items():
                if not safe_file_name(name) or name.startswith("."):
                    raise CorruptImage(
                        f"checkpoint {checkpoint_id}: its hot record names a bad file {name!r}"
                    )
                target = dest / name
                try:
                    os.link(source / name, target)
                except OSError as exc:
                    if exc.errno == 2:
                        raise
                    shutil.copyfile(source / name, target)
                if target.stat().st_size != size:
                    raise CorruptImage(
                        f"checkpoint {checkpoint_id} is corrupt in the hot tier: {name} has the wrong size"
                    )
        except FileNotFoundError:
            # dropped from the hot tier while we read it (it was durable): the caller reads the cold copy
            for child in dest.iterdir():
                child.unlink(missing_ok=True)
            return False
        return True

    # -- recovery -----------------------------------------------------------------------------------

    def leftovers(self) -> Iterator[Path]:
        """Dumps whose process died, deletions and restores that a crash interrupted."""
        if not self.exists():
            return
        now = time.time()
        for entry in self.root.iterdir():
            try:
                leftover = self._is_leftover(entry, now)
            except FileNotFoundError:
                continue  # gone meanwhile (renamed, deleted): nothing left over
            if leftover:
                yield entry

    def _is_leftover(self, entry: Path, now: float) -> bool:
        name = entry.name
        if name.endswith(".partial"):
            return entry.is_dir() and not owner_alive(entry)
        if name.endswith(".deleting"):
            return True
        if name.startswith("restore-"):
            return now - entry.stat().st_mtime > 3600
        return (
            entry.is_dir()
            and "." not in name
            and self.record(name) is None
            and now - entry.stat().st_mtime > 60
        )


def used_by_entry(root: Path) -> dict[str, int]:
    """Bytes taken in the folder ``root`` by each of its entries (an image's folder counts as one), in one
    walk; ``root`` is not checked to be torpor's (:meth:`HotTier.exists` does that)."""
    found: dict[str, int] = {}
    for dirpath, _dirs, filenames in os.walk(root):
        top = os.path.relpath(dirpath, root).split(os.sep)[0]
        for name in filenames:
            with contextlib.suppress(OSError):
                entry = name if top == os.curdir else top
                blocks = os.lstat(os.path.join(dirpath, name)).st_blocks
                found[entry] = found.get(entry, 0) + blocks * 512
    return found


def tier_error(exc: OSError, root: Path) -> TorporError:
    """The torpor error for a failure to write in the hot tier ``root``."""
    if exc.errno == errno.ENOSPC:
        return StorageFull(f"the hot tier {root} is full: lower TORPOR_HOT_CAPACITY or free memory")
    if exc.errno == errno.ELOOP:
        return UnsafePath(
            f"hot tier {root}: {exc.filename} is a symbolic link where torpor writes a file of its own; "
            "torpor does not write through it: remove it (and see who put it there)"
        )
    return StoreError(f"hot tier {root}: {exc.strerror or exc}")


def _raise(exc: OSError, root: Path) -> Any:
    raise tier_error(exc, root) from exc
