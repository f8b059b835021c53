"""Reading a checkpoint back out of the cold tier: into a folder, file by file, or into a pipe.

Chunks are fetched in parallel and each is verified before its bytes are used (:mod:`.verify`), unless
the caller defers that for files it verifies itself. A whole image goes into a folder (:func:`read`); one
file goes front to back to a consumer (:func:`file_data`), or into a pipe CRIU reads from
(:func:`pipe_file`), for streamed and lazy restores. Where each chunk lies is :mod:`.packs`'s business.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from torpor.adapters.pipefeed import PipeFeed
from torpor.adapters.system import private
from torpor.core.store.chunking import ProgressFn, no_progress
from torpor.core.store.format import DEFAULT_CHUNK_SIZE
from torpor.core.store.manifest import FileEntry, Manifest, safe_file_name
from torpor.errors import CorruptImage, StoreError

if TYPE_CHECKING:
    from torpor.core.store.repository import Repository

#: the zeros :func:`file_data` yields for zero extents (one chunk size of them)
ZEROS = bytes(DEFAULT_CHUNK_SIZE)


def read(
    repo: Repository,
    checkpoint_id: str,
    dest: Path,
    progress: ProgressFn = no_progress,
    defer: Callable[[str], bool] = lambda _: False,
    skip: Callable[[str], bool] = lambda _: False,
) -> Manifest:
    """Rebuild checkpoint ``checkpoint_id`` in ``dest``, fetching and verifying chunks in parallel.

    The chunks of files ``defer`` names are written unverified: the caller must run
    :func:`~torpor.core.store.verify.verify_extents` on those files before it trusts them. Files ``skip`` names are not
    written at all (see :func:`file_data`).
    """
    manifest = repo.manifest(checkpoint_id)
    private.make_private_dirs(dest)
    total = manifest.size
    done = [0]
    guard = threading.Lock()

    def one(fd: int, offset: int, length: int, chunk: str, verify: bool) -> None:
        os.pwrite(fd, repo.chunk_data(checkpoint_id, chunk, length, verify), offset)
        with guard:
            done[0] += length

    fds: list[int] = []
    try:
        with ThreadPoolExecutor(repo.workers, thread_name_prefix="fetch") as pool:
            futures = []
            for entry in manifest.files:
                if skip(entry.name):
                    done[0] += entry.size
                    continue
                if not safe_file_name(entry.name):  # validated already; never write outside dest
                    raise CorruptImage(f"checkpoint {checkpoint_id} names a bad file {entry.name!r}")
                fd = os.open(dest / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                fds.append(fd)
                os.ftruncate(fd, entry.size)  # zero extents stay holes
                verify = not defer(entry.name)
                for offset, length, chunk in entry.extents:
                    if chunk is None:
                        done[0] += length
                    else:
                        futures.append(pool.submit(one, fd, offset, length, chunk, verify))
            try:
                last = 0.0
                for future in futures:
                    future.result()
                    if time.monotonic() - last > 0.2:
                        last = time.monotonic()
                        progress(done[0], total)
            finally:
                for future in futures:
                    future.cancel()
    except OSError as exc:
        raise StoreError(f"cannot write checkpoint {checkpoint_id} into {dest}: {exc.strerror}") from exc
    finally:
        for fd in fds:
            os.close(fd)
    progress(total, total)
    return manifest


def file_data(
    repo: Repository,
    checkpoint_id: str,
    entry: FileEntry,
    pool: ThreadPoolExecutor | None,
    ahead: int = 8,
    buffers: Callable[[], memoryview] | None = None,
) -> Generator[bytes | memoryview, None, None]:
    """The content of one file of a checkpoint, front to back, every piece verified before it is yielded.

    Chunks are fetched and verified in ``pool``, at most ``ahead`` of them before the one being
    yielded, or (``pool`` None) in the caller's thread, each when its turn comes; zero extents come as
    pieces of :data:`ZEROS` (``piece.obj is ZEROS``), at most one chunk size each. ``buffers``: where
    each chunk goes (:meth:`Repository.chunk_into`; one buffer asked for per chunk, in order), instead
    of new memory. Raises CorruptImage at the first chunk that is missing or does not match its hash.
    """

    def load(offset: int, length: int, chunk: str, buffer: memoryview | None) -> bytes | memoryview:
        place = f"{entry.name} at offset {offset}"
        if buffer is None:
            return repo.chunk_data(checkpoint_id, chunk, length, True, place)
        return repo.chunk_into(checkpoint_id, chunk, length, buffer, place)

    if pool is None:
        for offset, length, chunk in entry.extents:
            if chunk is None:
                yield from _zeros(length)
            else:
                yield load(offset, length, chunk, buffers() if buffers is not None else None)
        return
    pending: deque[tuple[int, Future[bytes | memoryview] | None]] = deque()
    extents = iter(entry.extents)
    try:
        while True:
            while len(pending) < max(1, ahead):
                extent = next(extents, None)
                if extent is None:
                    break
                offset, length, chunk = extent
                future: Future[bytes | memoryview] | None = None
                if chunk is not None:  # each buffer asked for here, in order, as the chunks come
                    future = pool.submit(
                        load, offset, length, chunk, buffers() if buffers is not None else None
                    )
                pending.append((length, future))
            if not pending:
                return
            length, future = pending.popleft()
            if future is not None:
                yield future.result()
                continue
            yield from _zeros(length)
    finally:
        for _, future in pending:
            if future is not None:
                future.cancel()


def _zeros(length: int) -> Generator[memoryview, None, None]:
    """``length`` zero bytes, as pieces of :data:`ZEROS`."""
    for at in range(0, length, len(ZEROS)):
        yield memoryview(ZEROS)[: min(len(ZEROS), length - at)]


def pipe_file(
    repo: Repository,
    checkpoint_id: str,
    entry: FileEntry,
    fd: int,
    pool: ThreadPoolExecutor | None,
    ahead: int = 8,
) -> None:
    """Write one file of a checkpoint into the pipe ``fd`` (its write end), every chunk verified first.

    Each chunk is read into a buffer of a :class:`PipeFeed` (``ahead`` of them at once, in ``pool``;
    without one, in this thread while the reader empties the pipe) and verified there; the pipe then
    takes the buffer's pages by reference, so the reader copies each byte once. Returns when the
    reader has read it all; raises CorruptImage (see :func:`file_data`) with nothing of the bad chunk
    in the pipe.
    """
    # a buffer holds a chunk from its second page on, and a page more for an encrypted one's header
    feed = PipeFeed(fd, repo.chunk_size + 2 * mmap.PAGESIZE, spare=ahead + 1 if pool is not None else 1)
    for piece in file_data(repo, checkpoint_id, entry, pool, ahead, feed.buffer):
        if isinstance(piece, memoryview) and piece.obj is ZEROS:
            feed.put_zeros(len(piece))
        else:
            feed.put(memoryview(piece))
    feed.finish()  # the buffers must outlive every byte of theirs in the pipe
