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
once a newer checkpoint of the job is durable, and :meth:`HotTier.make_room` oldest first when the tier
is over capacity — which copies go is :mod:`torpor.policy.hot`'s decision, the I/O is here). A hot image
is verified when read back like any other: once durable, against its manifest's chunk hashes (the
destager's one pass over the image both stores and hashes it); before that, against file hashes taken by
the first restore — so that ``put`` costs only a rename.

Whose folder it is. The default place, ``/dev/shm/torpor-<hash of home>``, is predictable, in a folder
everyone may write, and holds a job's memory: another user who made it first could read images, swap
them, or plant links where torpor writes. So the hot tier is torpor's only when it is a real folder (not a
link), owned by torpor's user and private to it (no group or other bits), in a folder where nobody else
can rename what it holds (not writable by others, or sticky like ``/dev/shm``). :meth:`HotTier.ensure`
makes it so (``mkdir`` 0700, then torpor's tmpfs with ``mode=0700``) and checks it through an
``O_DIRECTORY|O_NOFOLLOW`` descriptor, before and after mounting; anything else is refused with
:class:`~torpor.errors.UnsafePath`, never ``chmod``-ed or ``chown``-ed, since someone else may have made
it. Readers check it too: fully once per folder (its device and inode are remembered), and with one
``lstat`` per call, which tells a folder replaced since (removed, then made again by someone else, even
on the same inode number: its owner or mode differ).

Files inside are not checked one by one: once the folder is verified nobody else can add an entry to it.
Every file torpor writes there is still opened with ``O_NOFOLLOW`` (:func:`torpor.adapters.system.
open_private`), so a link left there by anything (root itself, an older torpor's folder) redirects no
write, and CRIU's images are private because torpor's processes run with umask 0o077.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import blake3

from torpor.adapters import system
from torpor.core.store.manifest import safe_file_name
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
RECORD_FORMAT = "torpor-hot-image"
RECORD_VERSION = 1

STAGED = "staged"
DESTAGING = "destaging"
DURABLE = "durable"


@dataclass(frozen=True)
class HotRecord:
    id: str
    job: str
    created_at: float
    files: dict[str, list[Any]]  # name -> [size, blake3 hex]
    state: str = STAGED
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
    system.write_private(tmp, json.dumps(data).encode())
    os.replace(tmp, path)  # RAM: nothing to fsync, a crash loses the tier anyway


def write_owner(partial: Path, pids: Sequence[int] = ()) -> None:
    """Mark a new ``.partial`` folder as this process's dump, of ``pids`` (for :func:`dumped_pids`)."""
    if pids:
        system.write_private(partial / PIDS, "".join(f"{pid}\n" for pid in pids).encode())
    system.write_private(partial / OWNER, str(os.getpid()).encode())


def dumped_pids(partial: Path) -> list[int]:
    """The processes a dump in progress into ``partial`` is of (none if it did not say)."""
    try:
        return [int(line) for line in (partial / PIDS).read_text().split()]
    except (OSError, ValueError):
        return []


def owner_alive(partial: Path) -> bool:
    """Whether the process that made a ``.partial`` folder (its ``.owner`` file) still runs."""
    try:
        pid = int((partial / OWNER).read_text())
    except (OSError, ValueError):
        return time.time() - partial.stat().st_mtime < 3600  # unknown owner: only very old ones go
    return system.is_alive(pid)


#: CRIU writes a dump into a tmpfs mounted with this about 1.4x faster than into plain /dev/shm
#: (4 KiB pages) and faster than into a disk's page cache (docs/benchmarks.md); ``huge=always`` is slower
#: and erratic (it compacts memory for every 2 MiB page)
OWN_MOUNT_OPTIONS = "huge=within_size,mode=0700"


def _folder_problem(st: os.stat_result) -> str | None:
    """What makes a folder (``lstat``-ed) not one torpor may keep images in; ``None``: nothing."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by torpor's user (uid {uid})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users (torpor makes it 0700)"
    return None


class HotTier:
    def __init__(self, root: Path, capacity: int | None = None, own_mount: bool = False) -> None:
        self.root = root
        self._capacity = capacity
        #: mount a tmpfs of our own (huge pages) on ``root``: only for the default place in /dev/shm
        self.own_mount = own_mount
        #: (device, inode) of the root folder once it was checked to be torpor's own
        self._verified: tuple[int, int] | None = None

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
        """Make the hot tier (0700, torpor's tmpfs on the default place) or check the one there is ours.

        Raises :class:`~torpor.errors.UnsafePath` for a folder torpor did not make as it makes them.
        """
        try:
            system.make_private_dirs(self.root.parent)  # a TORPOR_HOT_DIR may be missing still
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.root, 0o700)
        except OSError as exc:
            raise StoreError(f"cannot create the hot tier {self.root}: {exc.strerror}") from exc
        fd, _ = self._open_root()
        try:
            if self.own_mount and not os.path.ismount(self.root):
                self._mount(fd)
        finally:
            os.close(fd)
        fd, checked = self._open_root()  # what is there now: torpor's tmpfs, or the folder it was made on
        os.close(fd)
        self._verified = (checked.st_dev, checked.st_ino)

    def exists(self) -> bool:
        """Whether the hot tier is there; raises :class:`~torpor.errors.UnsafePath` if it is not ours."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot look at the hot tier {self.root}: {exc.strerror}") from exc
        # a new inode, or the same one reused by a folder made since (its owner or mode then tells)
        if self._verified != (st.st_dev, st.st_ino) or _folder_problem(st) is not None:
            fd, checked = self._open_root()
            os.close(fd)
            self._verified = (checked.st_dev, checked.st_ino)
        return True

    def _open_root(self) -> tuple[int, os.stat_result]:
        """A descriptor of the root folder, checked (with its parent) to be torpor's own, and its stat."""
        problem = system.replaceable_by_others(self.root.parent)
        if problem is not None:
            raise UnsafePath(
                f"the hot tier {self.root} is not safe: {problem}; set TORPOR_HOT_DIR to a folder only "
                "torpor's user can change"
            )
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise StoreError(f"cannot open the hot tier {self.root}: {exc.strerror}") from exc
            try:
                st = os.lstat(self.root)
            except OSError:
                raise StoreError(f"cannot open the hot tier {self.root}: {exc.strerror}") from exc
            raise self._unsafe(_folder_problem(st) or "is not a folder") from exc
        st = os.fstat(fd)
        problem = _folder_problem(st)
        if problem is not None:
            os.close(fd)
            raise self._unsafe(problem)
        return fd, st

    def _unsafe(self, problem: str) -> UnsafePath:
        return UnsafePath(
            f"the hot tier {self.root} {problem}: another user may have made it to read or change "
            "checkpoints; torpor leaves it alone: remove it, or set TORPOR_HOT_DIR to a folder of your own"
        )

    def remove_all(self) -> None:
        """Delete the whole hot tier, images included, and unmount torpor's tmpfs if it has one.

        A link, or a folder of another user's, at the hot tier's place is not torpor's: it is left alone.
        """
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(self.root, ignore_errors=True)  # empties a mount point, cannot remove it
            with contextlib.suppress(OSError):
                system.unmount(self.root)
            shutil.rmtree(self.root, ignore_errors=True)
        self._verified = None
        # the lock file an older torpor made beside the hot tier (unlink follows no link)
        with contextlib.suppress(OSError):
            (self.root.parent / f".{self.root.name}.mount-lock").unlink(missing_ok=True)

    def _mount(self, fd: int) -> None:
        """Mount our tmpfs on the (empty) hot folder ``fd``, once, even with several processes racing.

        The lock is the checked folder itself (flock on its descriptor): a lock file beside it, in
        world-writable /dev/shm, would be one more name another user could make first.
        """
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.ismount(self.root) or os.listdir(fd):
            return  # mounted by another process meanwhile, or an older plain hot tier in use
        parent = os.statvfs(self.root.parent)
        size = parent.f_blocks * parent.f_frsize  # the same limit as the file system it replaces
        with contextlib.suppress(OSError):  # not root, or no tmpfs: a plain folder works, slower
            system.mount_tmpfs(self.root, f"{OWN_MOUNT_OPTIONS},size={size}")

    # -- staging ------------------------------------------------------------------------------------

    def staging_dir(self, checkpoint_id: str, size_hint: int | None, pids: Sequence[int] = ()) -> Path | None:
        """A folder to dump into, or ``None`` when the hint says the image will not fit."""
        self.ensure()
        need = size_hint or 0
        if need and not self.make_room(need):
            return None
        partial = self.root / f"{self._dir(checkpoint_id).name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(mode=0o700)
            write_owner(partial, pids)
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
                    if system.is_alive(int((entry / OWNER).read_text())):
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
            fd = system.open_private(folder / ".lock", os.O_RDWR | os.O_CREAT)
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
        folder = self._dir(checkpoint_id)
        if self.exists() and folder.exists():
            doomed = self.root / f".{checkpoint_id}.{uuid.uuid4().hex[:6]}.deleting"
            with contextlib.suppress(FileNotFoundError):
                os.rename(folder, doomed)  # first, so a half-deleted image is never listed
                shutil.rmtree(doomed, ignore_errors=True)

    # -- capacity -----------------------------------------------------------------------------------

    def used(self) -> int:
        return sum(self._used_by_entry().values())

    def _used_by_entry(self) -> dict[str, int]:
        """Bytes taken in the tier by each of its entries (an image's folder counts as one), in one walk."""
        found: dict[str, int] = {}
        if not self.exists():
            return found
        for dirpath, _dirs, filenames in os.walk(self.root):
            top = os.path.relpath(dirpath, self.root).split(os.sep)[0]
            for name in filenames:
                with contextlib.suppress(OSError):
                    entry = name if top == os.curdir else top
                    blocks = os.lstat(os.path.join(dirpath, name)).st_blocks
                    found[entry] = found.get(entry, 0) + blocks * 512
        return found

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
        system.make_private_dirs(dest)
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
