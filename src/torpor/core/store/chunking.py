"""How an image folder is cut into chunks, and how the chunks of one file are worked on in parallel.

A ``pages-N.img`` is cut along virtual addresses (:mod:`.pagemap`), so that unchanged memory gives the
same chunks from one checkpoint to the next; any other file along its offsets. The write path
(:mod:`.writing`) and verification (:mod:`.verify`) both hash the pieces of a file straight from a
read-only mapping of it (:func:`over_mapping`), and both take all-zero pieces for holes
(:func:`all_zero`). What becomes of a chunk (stored, deduplicated, compared) is theirs to say.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from torpor.core.store import pagemap
from torpor.core.store.manifest import Extent

T = TypeVar("T")

#: (bytes done, bytes in all)
ProgressFn = Callable[[int, int], None]


def no_progress(done: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class FilePlan:
    """How one file of an image is cut: contiguous (offset, length) pieces covering it."""

    name: str
    size: int
    pieces: tuple[tuple[int, int], ...]  # (offset, length), contiguous, covering the file


def plan_image(
    image_dir: Path, chunk_size: int, skip: Callable[[str], bool] = lambda _: False
) -> list[FilePlan]:
    """How each file of a CRIU image folder is cut into chunks."""
    pagemaps = pagemap.read_pagemaps(image_dir)
    plans = []
    for path in sorted(image_dir.iterdir()):
        if path.name.startswith(".") or skip(path.name) or not path.is_file() or path.is_symlink():
            continue
        size = path.stat().st_size
        if path.name in pagemaps:
            pieces = tuple(pagemap.cuts(pagemaps[path.name], chunk_size))
        else:
            pieces = tuple((off, min(chunk_size, size - off)) for off in range(0, size, chunk_size))
        plans.append(FilePlan(path.name, size, pieces))
    return plans


def over_mapping(
    pool: ThreadPoolExecutor,
    path: Path,
    size: int,
    task: Callable[..., T],
    calls: Iterable[tuple[Any, ...]],
) -> Generator[T, None, None]:
    """``task(view, *args)`` for each ``args`` of ``calls``, in ``pool``, on a read-only mapping of ``path``.

    Yields the results in order. The mapping is unmapped once every task has finished or been
    cancelled, whether they all succeeded or one raised (close the generator to stop early).
    """
    mapping = _map(path, size)
    view = memoryview(mapping)
    futures: list[Future[T]] = []
    try:
        futures = [pool.submit(task, view, *args) for args in calls]
        for future in futures:
            yield future.result()
    finally:
        for future in futures:
            future.cancel()
        wait(futures)
        if isinstance(mapping, mmap.mmap):
            # a failed task's traceback may still hold a slice: then the GC unmaps it
            with contextlib.suppress(BufferError):
                view.release()
                mapping.close()


def all_zero(data: memoryview | bytes, zero: bytes) -> bool:
    """Whether ``data`` (at most ``len(zero)`` bytes) is all zeros; most memory fails on its first bytes."""
    head = min(len(data), 64)
    return data[:head] == zero[:head] and data == zero[: len(data)]


def _map(path: Path, size: int) -> mmap.mmap | bytes:
    if size == 0:
        return b""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def merge_zeros(extents: list[Extent]) -> list[Extent]:
    """``extents`` with each run of zero extents merged into one."""
    out: list[Extent] = []
    for extent in extents:
        if extent[2] is None and out and out[-1][2] is None:
            out[-1] = (out[-1][0], out[-1][1] + extent[1], None)
        else:
            out.append(extent)
    return out
