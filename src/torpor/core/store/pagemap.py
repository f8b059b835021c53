"""Where each page of a CRIU ``pages-N.img`` belongs in the process's address space.

CRIU writes a process's memory as raw pages (``pages-N.img``) and, beside it, ``pagemap-P.img``: a
``PagemapHead{pages_id}`` then one ``PagemapEntry{vaddr, nr_pages, flags}`` per run of pages (CRIU
4.x keeps ``nr_pages`` as a u64 in field 5 and leaves the old u32 field 2 as zero). Entries
marked present hold their pages in the pages file, one after the other, in entry order. The chunker uses
this to cut memory along virtual addresses instead of file offsets, so an unchanged memory region yields
the same chunks even when the regions before it grew, shrank or moved in the file.

Only the few fields the store needs are read, with CRIU's image reader (:mod:`torpor.adapters.criuimage`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torpor.adapters.criuimage import fields, records

PAGE_SIZE = 4096

# pagemap flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2


@dataclass(frozen=True)
class PageRun:
    """``nr_pages`` consecutive pages at ``vaddr``, stored at ``offset`` of the pages file."""

    vaddr: int
    nr_pages: int
    offset: int
    #: PE_* flags: PE_LAZY marks pages ``criu lazy-pages`` serves (restore itself reads the others)
    flags: int = PE_PRESENT


@dataclass(frozen=True)
class Pagemap:
    """A pages file's runs of pages and the addresses they belong at."""

    pages_id: int
    runs: tuple[PageRun, ...]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    @property
    def size(self) -> int:
        """Bytes of the pages file this pagemap accounts for."""
        return sum(run.nr_pages for run in self.runs) * PAGE_SIZE


def read_pagemap(path: Path, partial: bool = False) -> Pagemap:
    """Parse one ``pagemap-*.img``; raises ValueError if it is not one we understand.

    ``partial``: CRIU is still writing it (it flushes whole entries, a few KiB at a time); the entries
    written so far.
    """
    messages = records(path.read_bytes(), partial)
    if not messages:
        raise ValueError(f"{path.name} has no pagemap head")
    head = fields(messages[0])
    pages_id = head.get(1)
    if not isinstance(pages_id, int):
        raise ValueError(f"{path.name} has no pages_id")
    runs, offset = [], 0
    for record in messages[1:]:
        entry = fields(record)
        vaddr, nr_pages, flags = entry.get(1), entry.get(5, entry.get(2)), entry.get(4)
        if not isinstance(vaddr, int) or not isinstance(nr_pages, int):
            raise ValueError(f"{path.name} has an entry without vaddr or nr_pages")
        if flags is None:  # images from before the flags field: present unless in the parent
            flags = 0 if entry.get(3) else PE_PRESENT
        if not isinstance(flags, int) or not flags & PE_PRESENT:
            continue
        runs.append(PageRun(vaddr, nr_pages, offset, flags))
        offset += nr_pages * PAGE_SIZE
    return Pagemap(pages_id, tuple(runs))


def read_pagemaps(image_dir: Path) -> dict[str, Pagemap]:
    """Every pagemap of an image folder, by the name of the pages file it describes.

    A pages file whose pagemap cannot be read, or does not add up to its size, is left out: the chunker
    then cuts it by file offset, which is always correct, only less deduplicated.
    """
    found: dict[str, Pagemap] = {}
    for path in sorted(image_dir.glob("pagemap-*.img")):
        try:
            pagemap = read_pagemap(path)
            size = (image_dir / pagemap.pages_file).stat().st_size
        except (OSError, ValueError, IndexError):
            continue
        if size == pagemap.size:
            found[pagemap.pages_file] = pagemap
    return found


def cuts(pagemap: Pagemap, chunk_size: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of the pages file: all pages whose address lies in one window.

    Windows are ``chunk_size``-aligned ranges of virtual addresses. Pages of one window are contiguous in
    the pages file (entries are sorted by address), so each window is one piece, even when it spans
    several entries.
    """
    out: list[tuple[int, int]] = []
    last_window = -1
    for run in pagemap.runs:
        start, end = run.vaddr, run.vaddr + run.nr_pages * PAGE_SIZE
        addr = start
        while addr < end:
            window = addr // chunk_size
            boundary = min(end, (window + 1) * chunk_size)
            offset = run.offset + addr - start
            if window == last_window and out and out[-1][0] + out[-1][1] == offset:
                out[-1] = (out[-1][0], out[-1][1] + boundary - addr)
            else:
                out.append((offset, boundary - addr))
            last_window = window
            addr = boundary
    return out
