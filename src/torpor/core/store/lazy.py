"""Lazy restore from the cold tier: a checkpoint's memory fetched chunk by chunk while the job already runs.

``criu dump`` marks private anonymous memory (almost all of a big process) ``PE_LAZY`` in
``pagemap-N.img``. Restored with ``criu restore --lazy-pages``, those pages are left to the
``criu lazy-pages`` daemon, which fills them through userfaultfd as the tree touches them, and copies the
rest in the background; every other page ``criu restore`` reads itself from ``pages-N.img``.

:class:`LazyImage` makes that work straight from the store, without rebuilding the image first:

- :meth:`LazyImage.prepare` writes a restore folder holding every file of the checkpoint but its memory,
  and :meth:`LazyImage.attach`, where the page server runs, the parts of the processes' ``pages-N.img``
  that are not lazy: those files are created sparse, at full size, with only those runs written in (CRIU
  reads them at their offsets, and never reads the holes). The chunks they came from stay in the cache:
  the pages the job touches first often lie beside them (its stack, its heap).
- :meth:`LazyImage.read_pages` answers the daemon's requests — given to it by the page server of
  :mod:`torpor.adapters.pageserver` — by mapping (pid, address) → ``pagemap-PID.img`` → offset in the
  pages file → extents of the manifest → chunks. Each chunk is fetched when first needed and verified
  against its hash before a byte of it is used (invariant 4); verified chunks stay in a bounded LRU, and
  the chunks that follow a request are fetched ahead in the background. Before the job runs,
  :meth:`LazyImage.warm` fetches its small regions of lazy memory (its heap, its interpreter's objects)
  into that cache, on other cores while ``criu restore`` runs: its first page faults then wait for no fetch.

What this module leaves to others: running the page server and the two CRIU commands, and killing the
restored tree when a read fails (see :mod:`torpor.adapters.pageserver` for why that matters).
"""

from __future__ import annotations

import bisect
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from torpor.adapters.system import private
from torpor.core.store import pagemap
from torpor.core.store.base import is_bulk
from torpor.core.store.manifest import ChunkId, Extent, FileEntry, Manifest, safe_file_name
from torpor.core.store.pagemap import PAGE_SIZE, PE_LAZY, Pagemap
from torpor.core.store.repository import Repository
from torpor.errors import CorruptImage, RestoreFailed, StoreError
from torpor.policy import readahead

#: verified chunks kept in memory for the requests that follow
DEFAULT_CACHE_BYTES = 256 << 20
#: chunks fetched ahead of the last one a request used, when it went on from the one before
#: (:func:`torpor.policy.readahead.chunks_ahead`)
DEFAULT_PREFETCH = 8

_PROCESS_PAGEMAP = re.compile(r"^pagemap-(\d+)\.img$")

Chunk = bytes | memoryview


# -- where a page lives ------------------------------------------------------------------------------


def file_ranges(pages: Pagemap, vaddr: int, nr_pages: int) -> list[tuple[int, int]]:
    """(offset, length) ranges of the pages file holding ``nr_pages`` pages from ``vaddr``, in order.

    A request may span several runs of the pagemap; ranges that follow each other in the file are
    merged. Raises ValueError if any of the pages is not in the image.
    """
    end = vaddr + nr_pages * PAGE_SIZE
    index = bisect.bisect_right(pages.runs, vaddr, key=lambda run: run.vaddr) - 1
    out: list[tuple[int, int]] = []
    address = vaddr
    while address < end:
        run = pages.runs[index] if 0 <= index < len(pages.runs) else None
        if run is None or not run.vaddr <= address < run.vaddr + run.nr_pages * PAGE_SIZE:
            raise ValueError(f"page {address:#x} is not in the image")
        stop = min(end, run.vaddr + run.nr_pages * PAGE_SIZE)
        offset = run.offset + address - run.vaddr
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + stop - address)
        else:
            out.append((offset, stop - address))
        address = stop
        index += 1
    return out


def lazy_regions(pages: Pagemap) -> list[tuple[int, int]]:
    """(vaddr, bytes) of each stretch of lazy pages, runs that follow each other in memory joined (CRIU
    cuts a region into many runs as it dumps)."""
    out: list[tuple[int, int]] = []
    for run in pages.runs:
        if not run.flags & PE_LAZY:
            continue
        size = run.nr_pages * PAGE_SIZE
        if out and out[-1][0] + out[-1][1] == run.vaddr:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((run.vaddr, size))
    return out


def extent_slices(extents: Sequence[Extent], offset: int, length: int) -> list[tuple[int, int, int]]:
    """(extent index, start within that extent, length) pieces of the file range ``offset``..+``length``.

    ``extents`` are a manifest's: contiguous from 0. Raises ValueError past the end of the file.
    """
    out: list[tuple[int, int, int]] = []
    index = bisect.bisect_right(extents, offset, key=lambda extent: extent[0]) - 1
    position, end = offset, offset + length
    while position < end:
        if not 0 <= index < len(extents):
            raise ValueError(f"offset {position} is past the end of the file")
        start, size, _ = extents[index]
        stop = min(end, start + size)
        out.append((index, position - start, stop - position))
        position = stop
        index += 1
    return out


@dataclass(frozen=True)
class _Process:
    """One process of the image: its pagemap and the manifest entry of its pages file."""

    pid: int
    pages: Pagemap
    entry: FileEntry


# -- the page source ---------------------------------------------------------------------------------


class LazyImage:
    """The memory of one checkpoint, served from the cold tier page by page (thread-safe)."""

    def __init__(
        self,
        repo: Repository,
        manifest: Manifest,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        prefetch: int = DEFAULT_PREFETCH,
    ) -> None:
        self.repo = repo
        self.manifest = manifest
        self.cache_bytes = cache_bytes
        self.prefetch = prefetch
        self._files = {entry.name: entry for entry in manifest.files}
        self._processes: dict[int, _Process] = {}
        #: where each process's last request ended: one that begins there is a stream, fetched ahead
        self._ends: dict[int, int] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[ChunkId, Chunk] = OrderedDict()
        self._cached_bytes = 0
        self._pending: dict[ChunkId, Future[Chunk]] = {}
        self._pool = ThreadPoolExecutor(max(2, repo.workers), thread_name_prefix="lazy-fetch")
        self._closed = False
        #: counters: chunks fetched and verified, their bytes, bytes handed out by read_pages
        self.fetched_chunks = 0
        self.fetched_bytes = 0
        self.served_bytes = 0

    @classmethod
    def open(cls, repo: Repository, checkpoint_id: str, **options: int) -> LazyImage:
        return cls(repo, repo.manifest(checkpoint_id), **options)

    def __enter__(self) -> LazyImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop fetching ahead and drop the cache (read_pages must not be called any more)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(RestoreFailed("the lazy restore was closed"))
            self._pending.clear()
            self._cache.clear()
            self._cached_bytes = 0

    @property
    def lazy_bytes(self) -> int:
        """Bytes of memory left out of the restore folder, for the page server to serve."""
        return sum(
            run.nr_pages * PAGE_SIZE
            for process in self._processes.values()
            for run in process.pages.runs
            if run.flags & PE_LAZY
        )

    # -- the restore folder -------------------------------------------------------------------------

    def prepare(self, dest: Path) -> None:
        """Write the restore folder ``dest``: every file of the checkpoint but its memory, verified.

        What CRIU reads itself of the memory, :meth:`attach` writes, where the page server runs: it reads
        the pagemaps anyway, and the chunks it fetches for that stay in its cache for the daemon.
        """
        private.make_private_dirs(dest)
        try:
            self._write_files(dest, [e for e in self.manifest.files if not is_bulk(e.name)])
        except OSError as exc:
            raise self._unwritable(dest, exc) from exc

    def attach(self, dest: Path) -> None:
        """Serve the restore folder :meth:`prepare` wrote (perhaps in another process, e.g. the CLI), and
        write into it first the memory ``criu restore`` reads itself, verified.

        Each process's ``pages-N.img`` is created sparse, at full size, with only the runs that are not lazy
        written in (CRIU reads those at their offsets, and never reads the holes); pages files that are no
        process's memory (e.g. shared memory) are written whole.
        """
        processes = self._read_processes(dest)
        try:
            whole: list[FileEntry] = []
            for entry in self.manifest.files:
                if not is_bulk(entry.name):
                    continue
                process = processes.get(entry.name)
                if process is None:  # not a process's memory (e.g. shared memory): CRIU reads it all
                    whole.append(entry)
                else:
                    self._write_eager_runs(dest, process)
            self._write_files(dest, whole)
        except OSError as exc:
            raise self._unwritable(dest, exc) from exc
        with self._lock:
            self._processes = {process.pid: process for process in processes.values()}

    def _unwritable(self, dest: Path, exc: OSError) -> StoreError:
        return StoreError(f"cannot write checkpoint {self.manifest.id} into {dest}: {exc.strerror}")

    def _read_processes(self, dest: Path) -> dict[str, _Process]:
        """The processes of the image, by the name of their pages file."""
        found: dict[str, _Process] = {}
        for entry in self.manifest.files:
            match = _PROCESS_PAGEMAP.match(entry.name)
            if not match:
                continue
            try:
                pages = pagemap.read_pagemap(dest / entry.name)
            except (ValueError, IndexError) as exc:
                raise CorruptImage(
                    f"checkpoint {self.manifest.id} has an unreadable {entry.name} ({exc})"
                ) from exc
            pages_entry = self._files.get(pages.pages_file)
            if pages_entry is None or pages_entry.size != pages.size:
                raise CorruptImage(
                    f"checkpoint {self.manifest.id}: {entry.name} does not describe {pages.pages_file}"
                )
            found[pages.pages_file] = _Process(int(match.group(1)), pages, pages_entry)
        return found

    def _write_files(self, dest: Path, entries: Sequence[FileEntry]) -> None:
        """Write whole files (every extent fetched and verified), in parallel."""
        fds: list[int] = []
        try:
            futures = []
            for entry in entries:
                fd = self._create(dest, entry)
                fds.append(fd)
                for index, (_, length, chunk) in enumerate(entry.extents):
                    if chunk is not None:
                        futures.append(self._pool.submit(self._write_piece, fd, entry, index, 0, length))
            self._wait_all(futures)
        finally:
            for fd in fds:
                os.close(fd)

    def _write_eager_runs(self, dest: Path, process: _Process) -> None:
        """Create a process's pages file sparse, and write in the runs ``criu restore`` reads itself."""
        fd = self._create(dest, process.entry)
        try:
            pieces: list[tuple[int, int, int]] = []
            for run in process.pages.runs:
                if not run.flags & PE_LAZY:
                    pieces += extent_slices(process.entry.extents, run.offset, run.nr_pages * PAGE_SIZE)
            futures = [
                self._pool.submit(self._write_piece, fd, process.entry, index, start, length)
                for index, start, length in pieces
                if process.entry.extents[index][2] is not None
            ]
            self._wait_all(futures)
        finally:
            os.close(fd)

    def _create(self, dest: Path, entry: FileEntry) -> int:
        if not safe_file_name(entry.name):  # validated already; never write outside dest
            raise CorruptImage(f"checkpoint {self.manifest.id} names a bad file {entry.name!r}")
        fd = os.open(dest / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, entry.size)  # zeros and lazy pages stay holes
        except OSError:
            os.close(fd)
            raise
        return fd

    def _write_piece(self, fd: int, entry: FileEntry, index: int, start: int, length: int) -> None:
        offset, size, chunk = entry.extents[index]
        assert chunk is not None
        data = self._chunk(chunk, size, keep=is_bulk(entry.name))
        os.pwrite(fd, data[start : start + length], offset + start)

    @staticmethod
    def _wait_all(futures: Sequence[Future[None]]) -> None:
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()

    # -- serving pages ------------------------------------------------------------------------------

    def read_pages(self, pid: int, vaddr: int, nr_pages: int) -> bytearray:
        """``nr_pages`` pages of process ``pid`` (its pid in the image) from ``vaddr``, every byte verified.

        Raises :class:`CorruptImage` for a chunk that is missing or does not match its hash, and
        :class:`RestoreFailed` for pages the image does not have; never returns other memory.
        """
        process = self._processes.get(pid)
        if process is None:
            raise RestoreFailed(
                f"criu asked for memory of process {pid}, which checkpoint {self.manifest.id} does not "
                "hold (was attach() called?)"
            )
        try:
            ranges = file_ranges(process.pages, vaddr, nr_pages)
            pieces = [
                piece for off, size in ranges for piece in extent_slices(process.entry.extents, off, size)
            ]
        except ValueError as exc:
            raise RestoreFailed(
                f"criu asked for memory of process {pid} that is not in the image: {exc}"
            ) from exc
        out = bytearray(nr_pages * PAGE_SIZE)  # zero extents need no copy
        position = 0
        for index, start, length in pieces:
            _, size, chunk = process.entry.extents[index]
            if chunk is not None:
                out[position : position + length] = self._chunk(chunk, size)[start : start + length]
            position += length
        with self._lock:
            self.served_bytes += len(out)
            ahead = readahead.chunks_ahead(self._ends.get(pid), vaddr, self.prefetch)
            self._ends[pid] = vaddr + nr_pages * PAGE_SIZE
        if pieces and ahead:
            self._fetch_ahead(process.entry, pieces[-1][0] + 1, ahead)
        return out

    def warm(self, budget: int = readahead.WARM_BYTES, limit: int = readahead.WARM_REGION_LIMIT) -> int:
        """Fetch and verify in the background, into the cache, the lazy memory the job is likely to touch
        first (:func:`torpor.policy.readahead.warm_first`); returns how many bytes of memory that is."""
        with self._lock:
            processes = list(self._processes.values())
        regions = [
            (process, vaddr, size) for process in processes for vaddr, size in lazy_regions(process.pages)
        ]
        warmed = 0
        for index in readahead.warm_first([size for _, _, size in regions], budget, limit):
            process, vaddr, size = regions[index]
            for offset, length in file_ranges(process.pages, vaddr, size // PAGE_SIZE):
                slices = extent_slices(process.entry.extents, offset, length)
                if not self._fetch_extents(process.entry, [extent for extent, _, _ in slices]):
                    return warmed
            warmed += size
        return warmed

    def _fetch_ahead(self, entry: FileEntry, first: int, count: int) -> None:
        self._fetch_extents(entry, range(first, min(first + count, len(entry.extents))))

    def _fetch_extents(self, entry: FileEntry, indexes: Iterable[int]) -> bool:
        """Fetch the chunks of ``entry``'s extents at ``indexes`` into the cache, in the background;
        False if the image was closed meanwhile."""
        for index in indexes:
            _, size, chunk = entry.extents[index]
            if chunk is None:
                continue
            future, owner = self._claim(chunk)
            if owner and future is not None:
                try:
                    self._pool.submit(self._fill, chunk, size, future, True)
                except RuntimeError:  # closed meanwhile
                    self._fail_pending(chunk, future, RestoreFailed("the lazy restore was closed"))
                    return False
        return True

    # -- chunks ---------------------------------------------------------------------------------------

    def _claim(self, chunk: ChunkId) -> tuple[Future[Chunk] | None, bool]:
        """(the future that will hold ``chunk``, whether the caller must fetch it); (None, False): cached."""
        with self._lock:
            if chunk in self._cache:
                return None, False
            future = self._pending.get(chunk)
            if future is not None:
                return future, False
            future = Future()
            self._pending[chunk] = future
            return future, True

    def _chunk(self, chunk: ChunkId, size: int, keep: bool = True) -> Chunk:
        """The verified plaintext of ``chunk`` (``size`` bytes): from the cache, a fetch under way, or fetched."""
        with self._lock:
            data = self._cache.get(chunk)
            if data is not None:
                self._cache.move_to_end(chunk)
                return data
        future, owner = self._claim(chunk)
        if future is None:  # cached between the two looks
            return self._chunk(chunk, size, keep)
        if owner:
            self._fill(chunk, size, future, keep)
        return future.result()

    def _fill(self, chunk: ChunkId, size: int, future: Future[Chunk], keep: bool) -> None:
        """Fetch and verify ``chunk`` into ``future`` (errors go there too: the reader raises them)."""
        try:
            data = self._fetch(chunk, size)
        except BaseException as exc:  # handed to whoever waits for the chunk
            self._fail_pending(chunk, future, exc)
            return
        with self._lock:
            self._pending.pop(chunk, None)
            self.fetched_chunks += 1
            self.fetched_bytes += size
            if keep and not self._closed:
                self._cache[chunk] = data
                self._cached_bytes += size
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_bytes -= len(dropped)
        if not future.done():
            future.set_result(data)

    def _fail_pending(self, chunk: ChunkId, future: Future[Chunk], exc: BaseException) -> None:
        with self._lock:
            if self._pending.get(chunk) is future:
                del self._pending[chunk]  # the next reader tries again (and fails on its own if it must)
        if not future.done():
            future.set_exception(exc)

    def _fetch(self, chunk: ChunkId, size: int) -> Chunk:
        return self.repo.chunk_data(self.manifest.id, chunk, size)
