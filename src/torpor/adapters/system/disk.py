"""The page cache and the disk under the store's files: writeback started early (``sync_file_range``),
one journal commit (``syncfs``), which pages are cached (``mincore``), tmpfs pages touched ahead, free
space.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

from torpor.adapters.system.libc import check, libc

SYNC_FILE_RANGE_WRITE = 2
_PAGE = os.sysconf("SC_PAGE_SIZE")


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Start writing ``fd``'s dirty pages to its disk now, without waiting (``sync_file_range``).

    ``length`` bytes from ``offset`` (0: to the end of the file). A later :func:`syncfs` then finds most
    of the data already written. Best effort: does nothing where the call is missing or refused (e.g. on
    tmpfs it has nothing to do).
    """
    libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), SYNC_FILE_RANGE_WRITE)


libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached_pages(fd: int, offset: int = 0, length: int = -1) -> tuple[int, int]:
    """(pages in the page cache, pages) of ``length`` bytes of the file ``fd`` from ``offset`` (-1: to
    its end), clipped to the file: ``mincore`` of a mapping that is never touched, so nothing is read."""
    size = os.fstat(fd).st_size
    start = offset // _PAGE * _PAGE
    end = size if length < 0 else min(size, offset + length)
    if end <= start:
        return 0, 0
    address = libc.mmap(None, end - start, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    try:
        vector = (ctypes.c_ubyte * (-(-(end - start) // _PAGE)))()
        check(libc.mincore(address, end - start, vector), "mincore")
        return sum(byte & 1 for byte in vector), len(vector)
    finally:
        libc.munmap(address, end - start)


def syncfs(path: Path) -> None:
    """Make everything written to the file system holding ``path`` durable (one journal commit)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        check(libc.syncfs(fd), f"syncfs {path}")
    finally:
        os.close(fd)


_ZEROS = bytes(1 << 20)


def fill_with_zeros(fd: int, length: int) -> None:
    """Write ``length`` zero bytes at the start of the file ``fd``: on tmpfs, pages allocated and touched
    now, so that what is written there later is a plain copy. (``fallocate`` allocates tmpfs pages without
    touching them: on a virtual machine whose host took free memory back, the first write to each still
    waits for the host.)"""
    for offset in range(0, length, len(_ZEROS)):
        os.pwrite(fd, _ZEROS[: min(len(_ZEROS), length - offset)], offset)


def disk_free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize
