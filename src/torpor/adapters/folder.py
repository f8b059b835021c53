"""A local or network file system as a store backend: objects as files, written atomically.

Keeps the backend contract of :mod:`torpor.core.store.backend` (one contract test suite checks it and the
S3 backend alike): temp file then rename, so a reader never sees part of an object, and one ``syncfs``
per :meth:`FolderBackend.sync` to make them durable. ``OSError`` becomes a torpor error here, with the
original as the cause (:class:`~torpor.errors.StorageFull` for a full disk). What the objects mean is the
store's business; the folder only keeps them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

from torpor.adapters.objectstore import check_name
from torpor.adapters.system import disk, private
from torpor.errors import ObjectNotFound, StorageFull, StoreError

#: a direct writer's staging buffer: bytes gathered before one write that bypasses the page cache
_DIRECT_BUFFER = 4 << 20
#: what O_DIRECT asks of a write's memory, length and file offset (the largest logical block size)
_DIRECT_ALIGN = 4096


def _error(exc: OSError, what: str) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"{what}: no space left on device; free space in the store or point it elsewhere")
    return StoreError(f"{what}: {exc.strerror or exc}")


class FolderBackend:
    """Objects as files under ``root``, written the borgstore way: temp file, then rename.

    Each object's data starts on its way to the disk as soon as it is written (``sync_file_range``), and
    :meth:`sync` makes everything stored so far durable with one ``syncfs`` of the file system: one
    journal commit for a thousand chunks instead of a thousand fsyncs, which cost more than the writing
    itself here. Where ``syncfs`` fails, :meth:`sync` fsyncs each object and each folder that gained one.
    """

    remote = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"
        self._dirty: set[Path] = set()  # folders that gained or lost an entry since the last sync
        self._unsynced: set[Path] = set()  # objects stored since the last sync
        self._lock = threading.Lock()
        self._buffers: list[mmap.mmap] = []  # direct writers' staging buffers, lent again

    def _path(self, name: str) -> Path:
        return self.root / check_name(name)

    def create(self) -> None:
        try:
            private.make_private_dirs(self.root)  # its folders 0700, its objects 0600: private
        except OSError as exc:
            raise _error(exc, f"cannot create the store folder {self.root}") from exc

    def store(self, name: str, *parts: bytes | memoryview) -> None:
        writer = self.writer(name)
        try:
            writer.write(*parts)
            writer.commit()
        finally:
            writer.abort()

    def writer(self, name: str, cache: bool = True) -> _FileWriter:
        return _FileWriter(self, name) if cache else _DirectWriter(self, name)

    def _staging(self) -> mmap.mmap:
        """A page-aligned buffer for a direct writer: one used before (its memory is there), or a new one."""
        with self._lock:
            if self._buffers:
                return self._buffers.pop()
        return mmap.mmap(-1, _DIRECT_BUFFER)

    def _give_back(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._buffers.append(buffer)

    def load(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.url} has no object {name}") from exc
        except OSError as exc:
            raise _error(exc, f"cannot read {name} from {self.root}") from exc

    def load_into(
        self, name: str, buffer: memoryview, offset: int = 0, length: int = -1
    ) -> memoryview | bytes:
        """Read into ``buffer`` (no new memory to touch) when the bytes fit in it."""
        try:
            fd = os.open(self._path(name), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{self.url} has no object {name}") from exc
        except OSError as exc:
            raise _error(exc, f"cannot read {name} from {self.root}") from exc
        try:
            size = max(0, os.fstat(fd).st_size - offset)
            if length >= 0:
                size = min(size, length)
            if size > len(buffer):
                return os.pread(fd, size, offset)
            done = 0
            while done < size:
                got = os.preadv(fd, [buffer[done:size]], offset + done)
                if not got:
                    raise OSError(errno.EIO, "the object got shorter while it was read")
                done += got
            return buffer[:size]
        except OSError as exc:
            raise _error(exc, f"cannot read {name} from {self.root}") from exc
        finally:
            os.close(fd)

    def in_memory(self, name: str, offset: int, length: int) -> float:
        """The share of the range's pages in the page cache (``mincore``: asking reads nothing)."""
        try:
            fd = os.open(self._path(name), os.O_RDONLY)
        except (OSError, ValueError):  # missing, or a bad name
            return 0.0
        try:
            cached, pages = disk.cached_pages(fd, offset, length)
            return cached / pages if pages else 0.0
        except OSError:
            return 0.0
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as exc:
            raise _error(exc, f"cannot delete {name} from {self.root}") from exc
        with self._lock:
            self._dirty.add(self._path(name).parent)

    def list(self, folder: str) -> Iterator[str]:
        base = self._path(folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for filename in filenames:
                if not filename.startswith("."):
                    yield f"{rel}/{filename}"

    def sync(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            unsynced, self._unsynced = self._unsynced, set()
        if not dirty and not unsynced:
            return
        try:
            disk.syncfs(self.root)
            return
        except OSError:
            pass  # e.g. a file system without syncfs: one fsync per object, then per folder
        for path in [*sorted(unsynced), *sorted(dirty)]:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # deleted since (gc, or a retention that raced us): nothing to keep
            except OSError as exc:
                raise _error(exc, f"cannot sync {path}") from exc
            try:
                os.fsync(fd)
            except OSError as exc:
                raise _error(exc, f"cannot sync {path}") from exc
            finally:
                os.close(fd)

    def remove_leftovers(self, min_age_s: float = 3600.0, idle: Collection[str] = ()) -> int:
        """Delete temp files a crash left behind mid-``store`` (for gc); returns how many.

        Under the top folders named in ``idle`` (nobody writes there now: gc holds the store), all of
        them; elsewhere only old ones, since a young temp file may be a ``store`` in progress (lock
        objects are written even while gc holds the store).
        """
        removed = 0
        cutoff = time.time() - min_age_s
        for dirpath, _dirnames, filenames in os.walk(self.root):
            top = Path(dirpath).relative_to(self.root).parts[:1]
            any_age = bool(top) and top[0] in idle
            for filename in filenames:
                if filename.startswith(".") and filename.endswith(".tmp"):
                    path = Path(dirpath) / filename
                    with contextlib.suppress(FileNotFoundError):
                        if any_age or path.stat().st_mtime < cutoff:
                            path.unlink()
                            removed += 1
        return removed

    def close(self) -> None:
        self.sync()


class _FileWriter:
    """An object of a :class:`FolderBackend` written in parts: a temp file, renamed at ``commit``.

    Each part's writeback starts as soon as it is written, so a big object (a pack) streams to the disk
    while it is being built.
    """

    def __init__(self, backend: FolderBackend, name: str) -> None:
        self._backend = backend
        self._name = name
        self._path = backend._path(name)
        self._tmp = self._path.with_name(f".{self._path.name}.{uuid.uuid4().hex[:8]}.tmp")
        self._size = 0
        try:
            try:
                self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileNotFoundError:
                private.make_private_dirs(self._path.parent)
                root = backend.root
                with backend._lock:  # the new folders' entries must reach the disk too
                    backend._dirty.update(p for p in self._path.parents if p == root or root in p.parents)
                self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise _error(exc, f"cannot write {name} in {backend.root}") from exc
        self._open = True

    def write(self, *parts: bytes | memoryview) -> None:
        began = self._size
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
                    self._size += written
            disk.start_writeback(self._fd, began, self._size - began)
        except OSError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: OSError) -> StoreError:
        """Drop the object; returns the error to raise for ``exc``."""
        self.abort()
        return _error(exc, f"cannot write {self._name} in {self._backend.root}")

    def commit(self) -> None:
        if not self._open:
            raise StoreError(f"{self._name} was dropped before it was complete")
        self._open = False
        try:
            os.close(self._fd)
            os.rename(self._tmp, self._path)
        except OSError as exc:
            self._tmp.unlink(missing_ok=True)
            raise _error(exc, f"cannot write {self._name} in {self._backend.root}") from exc
        with self._backend._lock:
            self._backend._dirty.add(self._path.parent)
            self._backend._unsynced.add(self._path)

    def abort(self) -> None:
        if self._open:
            self._open = False
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._tmp.unlink(missing_ok=True)


class _DirectWriter(_FileWriter):
    """A :class:`_FileWriter` whose bytes go to the disk around the page cache (``O_DIRECT``).

    For an object nothing will read soon: the page cache would hold a second copy of bytes that are
    in RAM already (a checkpoint's image stays in the hot tier), pushing out pages others use, and
    filling it means memory allocated for it (on a virtual machine, memory the host may first have to
    fault in). The parts are gathered into a page-aligned buffer, written a buffer at a time; the last
    one padded to a whole block, the file then cut to its size. On a file system that refuses
    ``O_DIRECT`` it writes through the page cache, as :class:`_FileWriter` does.
    """

    def __init__(self, backend: FolderBackend, name: str) -> None:
        super().__init__(backend, name)
        self._buffer: mmap.mmap | None = None
        self._fill = 0
        self._direct = False
        try:
            _direct_io(self._fd, True)
        except OSError:
            return  # no O_DIRECT here: a plain writer
        self._direct = True
        self._buffer = backend._staging()

    def write(self, *parts: bytes | memoryview) -> None:
        if self._buffer is None:
            super().write(*parts)
            return
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    take = min(len(view), _DIRECT_BUFFER - self._fill)
                    self._buffer[self._fill : self._fill + take] = view[:take]
                    self._fill += take
                    self._size += take
                    view = view[take:]
                    if self._fill == _DIRECT_BUFFER:
                        self._flush(_DIRECT_BUFFER)
        except OSError as exc:
            raise self._failed(exc) from exc

    def _flush(self, length: int) -> None:
        assert self._buffer is not None
        with memoryview(self._buffer) as whole:
            done = 0
            while done < length:
                try:
                    done += os.write(self._fd, whole[done:length])
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self._direct:
                        raise
                    # the file system took O_DIRECT, then refused this write (its alignment is not
                    # ours): the rest goes through the page cache
                    _direct_io(self._fd, False)
                    self._direct = False
        self._fill = 0

    def commit(self) -> None:
        if self._buffer is not None and self._open:
            try:
                if self._fill:
                    padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
                    self._buffer[self._fill : padded] = bytes(padded - self._fill)
                    self._flush(padded)
                os.ftruncate(self._fd, self._size)
            except OSError as exc:
                raise self._failed(exc) from exc
            finally:
                self._release()
        super().commit()

    def abort(self) -> None:
        self._release()
        super().abort()

    def _release(self) -> None:
        if self._buffer is not None:
            self._backend._give_back(self._buffer)
            self._buffer = None


def _direct_io(fd: int, on: bool) -> None:
    """Turn ``O_DIRECT`` on or off for the open file ``fd``."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
