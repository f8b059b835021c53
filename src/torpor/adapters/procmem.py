"""The memory of a stopped process, read from outside it: which pages CRIU will dump, and their bytes.

CRIU holds a process it dumps stopped for a while (seizing it, locking the network, collecting its
namespaces and mappings) before its parasite gathers the pages, and writes the pages file only after
that. A store that reads the same pages meanwhile (``process_vm_readv``) can hash and store them before
the file exists; what CRIU then writes dedups against them. It is only a guess at CRIU's pages:
nothing read here is trusted, the pages file is still hashed, and a page read wrong (the process ran
again, or CRIU dumped it differently) costs only the work.

Which pages CRIU dumps (``should_dump_page`` in CRIU's ``mem.c``): in private mappings, pages present
or swapped out, except pages mapped to the kernel's shared zero page and, in private file mappings,
pages not yet copied on write; every page of the vDSO. Shared mappings go to other image files.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from torpor.adapters.system import procfs

PAGE_SIZE = mmap.PAGESIZE
_PFN_MASK = (1 << 55) - 1
_FILE = 1 << 61
_SWAP = 1 << 62
_PRESENT = 1 << 63

_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.POINTER(_Iovec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_libc.process_vm_readv.restype = ctypes.c_ssize_t
#: iovecs one process_vm_readv takes at most (IOV_MAX)
_IOV_MAX = 1024


@dataclass(frozen=True)
class Window:
    """The pages CRIU would dump from one ``size``-aligned range of addresses: (address, bytes) runs."""

    index: int
    runs: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(length for _, length in self.runs)


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (by a tracer such as CRIU, or by a signal)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    # a thread's /proc/TID holds its own state, as a process's does
    return bool(tasks) and all(procfs.process_state(int(tid)) in ("t", "T") for tid in tasks)


def zero_page_frame() -> int | None:
    """The page frame of the kernel's shared zero page (None where page frames are hidden: not root)."""
    area = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        anchor = ctypes.c_char.from_buffer(area)
        address = ctypes.addressof(anchor)
        _ = area[0]  # reading an untouched private page maps the zero page there
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // PAGE_SIZE * 8)
            entry = int.from_bytes(f.read(8), "little")
        del anchor
    finally:
        area.close()
    frame = entry & _PFN_MASK
    return frame if entry & _PRESENT and frame else None


def windows(
    pid: int, size: int, zero_frame: int | None, until: Callable[[], bool] = lambda: False
) -> Iterator[Window]:
    """The pages of ``pid`` CRIU would dump, by ``size``-aligned windows of addresses, lowest first.

    Lazy: a mapping's page table is read a slice at a time (a process may map terabytes it never
    touches); it stops early once ``until()``.
    """
    with open(f"/proc/{pid}/maps", "rb") as f:
        maps = f.read().decode(errors="replace").splitlines()
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
        yield from _by_window(_runs(maps, pagemap, zero_frame, until), size)


#: address space whose page table entries are read at once (512 KiB of them)
_SLICE = 64 << 10 << 12


def _runs(
    maps: list[str], pagemap: BinaryIO, zero_frame: int | None, until: Callable[[], bool]
) -> Iterator[tuple[int, int]]:
    for line in maps:
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        perms, name = fields[1], fields[5] if len(fields) > 5 else ""
        if perms[3] != "p" or name in ("[vvar]", "[vvar_vclock]", "[vsyscall]"):
            continue  # shared mappings go to other images; these are the kernel's
        if name == "[vdso]":
            yield start, end - start
            continue
        if perms[0] != "r":
            continue  # unreadable from outside as well (CRIU dumps such pages, if any: a miss here)
        file_backed = bool(name) and not name.startswith("[")
        for at in range(start, end, _SLICE):
            if until():
                return
            stop = min(end, at + _SLICE)
            pagemap.seek(at // PAGE_SIZE * 8)
            entries = pagemap.read((stop - at) // PAGE_SIZE * 8)
            yield from _dumped_runs(at, entries, file_backed, zero_frame)


#: by the top byte of a pagemap entry (bits 56-63): whether CRIU dumps the page, in an anonymous and in
#: a file-backed private mapping (present and not the zero page, or swapped; not a file page)
_ANON = bytes(b"1"[0] if top & 0xC0 else b"0"[0] for top in range(256))
_FILE_BACKED = bytes(b"1"[0] if (top & 0x40 or top & 0xA0 == 0x80) else b"0"[0] for top in range(256))
_DUMPED = re.compile(b"1+")


def _dumped_runs(
    start: int, entries: bytes, file_backed: bool, zero_frame: int | None
) -> list[tuple[int, int]]:
    """(address, bytes) runs of the pages CRIU dumps of a private mapping at ``start``, by its pagemap."""
    marks = bytearray(entries[7::8].translate(_FILE_BACKED if file_backed else _ANON))
    if zero_frame is not None and zero_frame.to_bytes(7, "little")[:6] in entries:
        # pages mapped to the zero page are left out: find them entry by entry (rare: only read memory)
        for page, (entry,) in enumerate(struct.iter_unpack("<Q", entries)):
            if entry & _PRESENT and entry & _PFN_MASK == zero_frame:
                marks[page] = b"0"[0]
    return [
        (start + match.start() * PAGE_SIZE, (match.end() - match.start()) * PAGE_SIZE)
        for match in _DUMPED.finditer(marks)
    ]


def _by_window(runs: Iterator[tuple[int, int]], size: int) -> Iterator[Window]:
    current: list[tuple[int, int]] = []
    index = -1
    for address, length in runs:
        end = address + length
        while address < end:
            here = address // size
            stop = min(end, (here + 1) * size)
            if here != index:
                if current:
                    yield Window(index, tuple(current))
                current, index = [], here
            if current and current[-1][0] + current[-1][1] == address:
                current[-1] = (current[-1][0], current[-1][1] + stop - address)
            else:
                current.append((address, stop - address))
            address = stop
    if current:
        yield Window(index, tuple(current))


def read(pid: int, runs: tuple[tuple[int, int], ...], buffer: memoryview) -> int:
    """Copy ``runs`` of ``pid``'s memory, one after the other, into ``buffer``; returns the bytes copied."""
    total = sum(length for _, length in runs)
    if total > len(buffer):
        raise ValueError("the buffer is too small for these runs")
    done = 0
    for at in range(0, len(runs), _IOV_MAX):
        part = runs[at : at + _IOV_MAX]
        remote = (_Iovec * len(part))(*(_Iovec(address, length) for address, length in part))
        want = sum(length for _, length in part)
        local = _Iovec(ctypes.addressof(ctypes.c_char.from_buffer(buffer, done)), want)
        got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, remote, len(part), 0)
        if got != want:
            err = ctypes.get_errno()
            raise OSError(
                err, f"process_vm_readv of process {pid}: {os.strerror(err) if got < 0 else 'short'}"
            )
        done += got
    return done
