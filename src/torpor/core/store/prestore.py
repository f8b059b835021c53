"""Storing a dump while CRIU is still writing it, and memory read from the stopped processes (precopy).

A dump's bytes reach the cold tier sooner when they are hashed and stored as CRIU writes them, and
sooner still when they are read from the processes CRIU holds stopped before its parasite dumps them.
Both are a head start only: :meth:`Repository.write <torpor.core.store.repository.Repository.write>`
hashes every piece of the complete image again and uses what was stored here only where it is the very
same chunk. Which dumps get a head start is the caller's decision.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torpor.adapters import procmem
from torpor.core.store import pagemap
from torpor.core.store.lock import SHARED
from torpor.core.store.manifest import ChunkId
from torpor.errors import StoreError

if TYPE_CHECKING:
    from torpor.core.store.repository import Repository

#: a piece of an image file: (file name, offset, length)
Piece = tuple[str, int, int]


@dataclass
class Prestored:
    """What :func:`prestore` stored of a dump before it was complete."""

    #: pieces of the image as CRIU wrote them: piece -> (chunk, or None for zeros; bytes newly stored)
    pieces: dict[Piece, tuple[ChunkId | None, int]] = field(default_factory=dict)
    #: chunks read from the stopped processes that were new to the store -> bytes newly stored
    memory: dict[ChunkId, int] = field(default_factory=dict)
    #: bytes of memory read from the stopped processes
    memory_read: int = 0


#: a dot file of an image folder naming, one per line, the files torpor wrote again after CRIU (a
#: pre-copied dump made whole, :mod:`torpor.core.precopy`): what was stored of them while CRIU wrote
#: them is not theirs any more
REWRITTEN = ".rewritten"


def still_valid(prestored: Prestored, image_dir: Path) -> Prestored:
    """``prestored`` less the pieces of files the folder's :data:`REWRITTEN` names."""
    try:
        names = set((image_dir / REWRITTEN).read_text().split())
    except FileNotFoundError:
        return prestored
    pieces = {piece: found for piece, found in prestored.pieces.items() if piece[0] not in names}
    return Prestored(pieces, prestored.memory, prestored.memory_read)


def prestore(
    repo: Repository,
    image_dir: Path,
    prestored: Prestored,
    finished: Callable[[], bool],
    workers: int = 1,
    memory_of: Sequence[int] = (),
    cache: bool = True,
) -> None:
    """Store the chunks of a dump still in progress that CRIU has written already (best effort).

    CRIU writes a process's pages file front to back and flushes its pagemap in blocks of a few KiB,
    a little behind. Each scan takes the pieces of every pages file that its pagemap so far places
    (all but the last one, which may still grow) and whose bytes are in the file, and hashes and
    stores them in ``workers`` threads of the lowest CPU priority (CRIU is freezing the job: it
    must not wait for a core).
    ``prestored.pieces`` notes each piece's chunk for ``Repository.write``, which uses a note only for
    the very same piece of the same file, and only if the chunk is still in the store then. Returns once
    ``finished()`` (the dump is complete or gone); pieces not begun by then are left to ``write``.

    ``memory_of``: the processes being dumped. CRIU holds them stopped for a while before its
    parasite gathers their pages (on this machine mostly its network lock: ~0.4 s of the 0.7 s
    freeze of 1 GiB), and writes the pages only after that. Meanwhile one more idle-priority thread
    reads the pages CRIU will dump from the stopped processes themselves and stores them as the
    chunks they will be (adapters/procmem.py), until the parasite runs. Nothing read there is
    trusted: ``Repository.write`` still hashes every piece of the image, and finds these chunks stored
    (``prestored.memory`` says which were new, for the checkpoint's count of bytes it added).

    ``cache``: whether the chunks' packs go through the backend's cache (a page cache), as
    ``Repository.write``'s do for the same image (``policy.hot.read_back_soon``).
    """
    repo.open()
    fds: dict[str, int] = {}
    stop = threading.Event()
    pending: dict[Piece, Future[tuple[ChunkId | None, int]]] = {}
    local = threading.local()

    def one(fd: int, offset: int, length: int) -> tuple[ChunkId | None, int]:
        buffer = getattr(local, "buffer", None)
        if buffer is None or len(buffer) < length:
            buffer = local.buffer = bytearray(max(length, repo.chunk_size))
        view = memoryview(buffer)[:length]
        if os.preadv(fd, [view], offset) != length:
            raise StoreError("a pages file shrank while it was being written")
        return storer.store(view)

    def collect() -> None:
        for piece, future in list(pending.items()):
            if future.done():
                del pending[piece]
                if not future.cancelled() and future.exception() is None:
                    prestored.pieces[piece] = future.result()

    def copy_memory() -> None:
        idle_priority()
        with contextlib.suppress(OSError, ValueError, StoreError):  # only a head start
            while not all(procmem.stopped(pid) for pid in memory_of):  # CRIU has not frozen them yet
                if stop.wait(0.002):
                    return
            zero = procmem.zero_page_frame()
            buffer = bytearray(repo.chunk_size)
            for pid in memory_of:
                for n, window in enumerate(procmem.windows(pid, repo.chunk_size, zero, stop.is_set)):
                    if stop.is_set() or (n % 8 == 0 and not procmem.stopped(pid)):
                        return  # CRIU's parasite runs in it now, or the dump is over
                    try:
                        size = procmem.read(pid, window.runs, memoryview(buffer))
                    except OSError:
                        continue  # e.g. a mapping CRIU does not let us read: only that window
                    chunk, new = storer.store(memoryview(buffer)[:size])
                    prestored.memory_read += size
                    if chunk is not None and new:
                        prestored.memory[chunk] = new

    with repo.lock.hold(SHARED, timeout=600) as held, repo.storer(cache) as storer:
        pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="prestore", initializer=idle_priority)
        copier = threading.Thread(target=copy_memory, name="precopy", daemon=True)
        if memory_of:
            copier.start()
        try:
            while True:
                over = finished()  # before the scan: a scan after the end sees everything
                for name, pieces in written_pieces(image_dir, repo.chunk_size, fds):
                    for offset, length in pieces:
                        piece = (name, offset, length)
                        if piece not in prestored.pieces and piece not in pending:
                            pending[piece] = pool.submit(one, fds[name], offset, length)
                collect()
                if over or not image_dir.is_dir():
                    break
                held.refresh()
                time.sleep(0.01)
        finally:
            stop.set()
            if copier.is_alive():
                copier.join()
            pool.shutdown(wait=True, cancel_futures=True)
            collect()
            for fd in fds.values():
                os.close(fd)


def written_pieces(
    image_dir: Path, chunk_size: int, fds: dict[str, int]
) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """For a dump in progress: each pages file's pieces, as far as they are written (see :func:`prestore`).

    The pagemap lags behind the pages file, so the pages written past what it accounts for are taken
    to go on from its last run (as they do within one mapping: most of a big process's memory). A
    wrong guess costs only work: :meth:`Repository.write` uses what was stored for a piece only if the
    complete pagemap cuts the very same piece of the file. The last piece is left out (it may grow).
    Opens each pages file once into ``fds`` (it is read from there, even after the folder is renamed).
    """
    for path in sorted(image_dir.glob("pagemap-*.img")):
        try:
            so_far = pagemap.read_pagemap(path, partial=True)
            name = so_far.pages_file
            if name not in fds:
                fds[name] = os.open(image_dir / name, os.O_RDONLY)
            written = os.fstat(fds[name]).st_size
        except (OSError, ValueError, IndexError):
            continue  # not begun yet, or gone: the next scan (or write) sees it
        runs = list(so_far.runs)
        if runs and written > so_far.size:
            last = runs[-1]
            guess = (written - so_far.size) // pagemap.PAGE_SIZE
            runs.append(
                pagemap.PageRun(
                    last.vaddr + last.nr_pages * pagemap.PAGE_SIZE, guess, so_far.size, last.flags
                )
            )
        pieces = pagemap.cuts(pagemap.Pagemap(so_far.pages_id, tuple(runs)), chunk_size)[:-1]
        yield name, [(offset, length) for offset, length in pieces if offset + length <= written]


def idle_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; Linux sets it per thread)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
