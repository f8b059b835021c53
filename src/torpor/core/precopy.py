"""Pre-copied checkpoints (issue 31): the job's memory copied while it runs, so that the freeze dumps only
what it wrote since.

Order of a pre-copied checkpoint, inside :func:`torpor.core.checkpoint.checkpoint_in_launcher`::

    track each process's writes            adapters.writetrack (userfaultfd, asynchronous write-protect)
    round 1: copy every page it holds      into .precopy/copy-PID in the staging folder (RAM), one after
                                           another in address order, as a pages file lays them out
    round k: copy the pages written since  each where round 1 put it (or, new, in .precopy/extra-PID),
                                           as long as policy.precopy says another round is worth it
    criu dump, told what torpor holds      criu-rlimits.c's "pages since": CRIU dumps the pages written
                                           since the last round, and lists every page it found
    make the image whole (complete())      the copy file becomes pages-N.img in place: pages move where
                                           pages before them came or went, the dump's are written in, a
                                           copied page no longer there stays out; pagemap-N.img is
                                           written again, so the image needs nothing else

Correct by construction: a page is left out of CRIU's dump only if the kernel says it was not written
since it was protected, and it was protected before torpor copied it (the copy is at least as new as the
protection; a write after it marks the page). Memory mapped after tracking began is not protected, so
CRIU dumps it; so is a child forked since (another address space, not tracked). A page the dump found
that torpor has no copy of fails the checkpoint's completion (:class:`Incomplete`), and the caller
dumps again, whole.

Only for jobs that run on (a checkpoint, not a hibernation) whose image is staged in RAM, on a machine
where :func:`torpor.adapters.writetrack.probe` passes and with CRIU started through torpor's wrapper
(the shim). Memory a device writes by DMA (a GPU's pinned host buffers) is not seen by write-protection:
jobs that use a GPU are not pre-copied.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import os
import shutil
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torpor.adapters import writetrack
from torpor.adapters.criuimage import fields, records
from torpor.adapters.system import procfs
from torpor.core.context import Progress
from torpor.core.store import prestore
from torpor.core.store.pagemap import PAGE_SIZE, PE_PRESENT
from torpor.errors import NotTrackable
from torpor.errors import PreCopyIncomplete as Incomplete
from torpor.policy import precopy as policy
from torpor.policy.scheduler.sizes import format_size

#: the folder, inside the staging folder, holding the copies and what the shim writes
FOLDER = ".precopy"

#: the processes of one job that are tracked at most (the shim keeps a list of this many)
MOST_PROCESSES = 512

#: the environment variable the shim reads (scripts/criu-rlimits.c)
ENV = "TORPOR_PAGES_SINCE"

# what the shim records: u64 start, end, categories; PAGE_IS_* of <linux/fs.h>
_FOUND = struct.Struct("<QQQ")
_PAGE_IS_WRITTEN = 1 << 1
_PAGE_IS_PRESENT = 1 << 3

_CHUNK = 8 << 20
_SEEK_DATA, _SEEK_HOLE = 3, 4


@dataclass(frozen=True)
class Summary:
    """What a pre-copied checkpoint did, for its progress line, its record and the benchmarks."""

    rounds: tuple[policy.Round, ...]
    why: str  # why the rounds stopped
    #: pages the freeze dumped, and pages the image took from the copies
    dumped_pages: int = 0
    copied_pages: int = 0
    #: bytes that making the image whole moved in the copy file or wrote into it
    moved: int = 0
    complete_s: float = 0.0

    @property
    def copied(self) -> int:
        """Bytes the rounds copied in all."""
        return sum(each.copied for each in self.rounds)

    def line(self) -> str:
        rounds = ", ".join(f"{format_size(r.copied)} in {r.seconds:.2f} s" for r in self.rounds)
        return f"pre-copied in {len(self.rounds)} round(s) ({rounds}): {self.why}"


@dataclass
class _Process:
    pid: int  # on this machine
    inner: int  # in the job's PID namespace, as CRIU names its images
    tracker: writetrack.Tracker
    copy: int  # descriptor of .precopy/copy-PID: round 1's pages one after another, in address order
    extra: int  # descriptor of .precopy/extra-PID: pages copied later that round 1 had no place for
    mem: int  # descriptor of /proc/PID/mem
    layout: _Layout = field(default_factory=lambda: _Layout())


@dataclass
class PreCopy:
    """The tracked processes of one job and the copies of their memory (:func:`start`)."""

    folder: Path
    processes: list[_Process]
    #: processes not tracked, with why (dumped whole)
    untracked: dict[int, str] = field(default_factory=dict)
    rounds: list[policy.Round] = field(default_factory=list)
    why: str = ""
    #: bytes each tracked process wrote since the last round (by PID on this machine): what its dump holds
    pending: dict[int, int] = field(default_factory=dict)

    def close(self) -> None:
        """Stop tracking (the job's memory is no longer write-protected) and close the copies."""
        for each in self.processes:
            each.tracker.close()
            for fd in (each.copy, each.extra, each.mem):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.processes = []

    def copy_rounds(self, progress: Progress, limits: policy.Limits | None = None) -> None:
        """Copy the memory in rounds while the job runs, until :func:`torpor.policy.precopy.next_step`
        says to freeze. Round 1 copies every page the processes hold (protected already, by
        :func:`start`), each later round what the scan before it found written and protected again.
        What the last look found is not protected again: it stays written, for the dump."""
        limits = limits or policy.Limits()
        swapped = procfs.swap_in_use()
        ranges = {each.pid: each.tracker.present(swapped) for each in self.processes}
        decision = policy.next_step(self.rounds, _size(ranges), limits)
        while decision.again:
            started = time.monotonic()
            first = not self.rounds
            copied = sum(self._copy(each, ranges[each.pid], first) for each in self.processes)
            self.rounds.append(policy.Round(copied, time.monotonic() - started))
            progress(f"pre-copy {decision.why}: copied in {self.rounds[-1].seconds:.2f} s")
            looked = {each.pid: each.tracker.written(protect=False) for each in self.processes}
            decision = policy.next_step(self.rounds, _size(looked), limits)
            if decision.again:  # protected again only now: a page written meanwhile is in this scan
                ranges = {each.pid: each.tracker.written() for each in self.processes}
            else:
                self.pending = {pid: sum(r.length for r in found) for pid, found in looked.items()}
        self.why = decision.why

    def reservations(self, whole: dict[int, int]) -> dict[int, int]:
        """The memory to set aside for each process's pages in the dump (by PID in the job's namespace),
        given ``whole``, what a whole dump would set aside: a tracked process's pages written since the
        last round (more, if it writes on until the freeze: those come from fresh memory), an untracked
        one's whole memory."""
        tracked = {each.inner: self.pending.get(each.pid, 0) for each in self.processes}
        return {inner: tracked.get(inner, size) for inner, size in whole.items()}

    def env(self) -> dict[str, str]:
        """CRIU's environment for the dump: the shim's folder, with the ranges whose copies torpor holds."""
        lines = [
            f"{each.pid} {span.start} {span.start + span.length}\n"
            for each in self.processes
            for span in each.tracker.spans()
        ]
        ranges = self.folder / "ranges"
        ranges.write_text("".join(lines))
        for found in self.folder.glob("found-*"):
            found.unlink()
        return {ENV: str(self.folder)}

    def complete(self, images_dir: Path) -> Summary:
        """Make the image CRIU dumped into ``images_dir`` whole: each tracked process's pages file and
        pagemap hold every page the dump found, from the dump or from the copies. Raises
        :class:`Incomplete` when a page found has no copy (the image is then as CRIU left it: partial)."""
        started = time.monotonic()
        dumped = copied = moved = 0
        for each in self.processes:
            found_file = self.folder / f"found-{each.pid}"
            if not found_file.exists():
                continue  # the shim did not filter this process's scans: CRIU dumped all of it
            pagemap = images_dir / f"pagemap-{each.inner}.img"
            d, c, m = _make_whole(pagemap, found_file, each, images_dir, self.folder / f"copy-{each.pid}")
            dumped += d
            copied += c
            moved += m
        return Summary(tuple(self.rounds), self.why, dumped, copied, moved, time.monotonic() - started)

    def _copy(self, process: _Process, ranges: Sequence[writetrack.Range], first: bool) -> int:
        """Copy ``ranges`` of the process's memory; bytes copied. The ``first`` round lays its pages one after
        another in the copy file (in address order: the pages file the image will have); later rounds
        write a page where round 1 put it, or at its address in the extra file. A range unmapped
        meanwhile is skipped (its pages, if mapped again, are new: CRIU dumps them)."""
        done = 0
        buffer = memoryview(bytearray(_CHUNK))  # one buffer for all: fresh memory for each piece costs 4×
        for each in writetrack.merged(ranges):  # in address order, a range given twice copied once
            for start, length in _pieces(each.start, each.length, _CHUNK):
                for at, data in _read_piece(process.mem, start, buffer[:length]):
                    done += len(data)
                    if first:
                        os.pwrite(process.copy, data, process.layout.add(at, len(data)))
                        continue
                    for a, b, offset in process.layout.split(at, at + len(data)):
                        piece = data[a - at : b - at]
                        os.pwrite(
                            process.extra if offset is None else process.copy,
                            piece,
                            a if offset is None else offset,
                        )
        return done


def _size(ranges: dict[int, list[writetrack.Range]]) -> int:
    return sum(each.length for found in ranges.values() for each in found)


def start(images_dir: Path, pids: Sequence[int], progress: Progress) -> PreCopy:
    """Track the writes of the processes ``pids`` (one job) and make their copy files in
    ``images_dir``/.precopy. Raises NotTrackable, saying why, when none of them can be tracked."""
    folder = images_dir / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700)
    job = PreCopy(folder, [])
    for pid in pids:
        if len(job.processes) >= MOST_PROCESSES:
            job.untracked[pid] = f"more than {MOST_PROCESSES} processes are tracked"
            continue
        try:
            job.processes.append(_track(folder, pid))
        except NotTrackable as exc:
            job.untracked[pid] = exc.message
    if not job.processes:
        job.close()
        shutil.rmtree(folder, ignore_errors=True)
        reason = next(iter(job.untracked.values()), "the job has no process")
        raise NotTrackable(reason)
    if job.untracked:
        progress(
            f"pre-copy: {len(job.untracked)} process(es) dumped whole: {next(iter(job.untracked.values()))}"
        )
    return job


def _track(folder: Path, pid: int) -> _Process:
    inner = procfs.namespace_pid(pid)
    if inner is None:
        raise NotTrackable(f"process {pid} ended")
    tracker = writetrack.track(pid)
    try:
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        tracker.close()
        raise NotTrackable(f"cannot read the memory of process {pid}: {exc.strerror}") from None
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    copy = os.open(folder / f"copy-{pid}", flags, 0o600)
    extra = os.open(folder / f"extra-{pid}", flags, 0o600)
    return _Process(pid, inner, tracker, copy, extra, mem)


def _pieces(start: int, length: int, most: int) -> Iterator[tuple[int, int]]:
    end = start + length
    while start < end:
        yield start, min(most, end - start)
        start += most


def _read_piece(mem: int, start: int, buffer: memoryview) -> Iterator[tuple[int, memoryview]]:
    """Read ``len(buffer)`` bytes at ``start`` from /proc/PID/mem into ``buffer``: (address, bytes) of what
    could be read, all at once or page by page (pages unmapped meanwhile are skipped). Each answer is
    valid until the next is asked for."""
    length = len(buffer)
    try:
        read = os.preadv(mem, [buffer], start)
    except OSError:
        read = 0
    if read == length:
        yield start, buffer
        return
    page = buffer[:PAGE_SIZE]
    for at in range(start, start + length, PAGE_SIZE):
        try:
            read = os.preadv(mem, [page], at)
        except OSError:
            continue
        if read == PAGE_SIZE:
            yield at, page


@dataclass
class _Layout:
    """Where round 1 put each page in the copy file: runs of (address, end, offset), in address order,
    one after another in the file."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    size: int = 0

    def add(self, vaddr: int, length: int) -> int:
        """Place ``length`` bytes at ``vaddr`` after the pages placed so far; their offset in the file."""
        if self.ends and vaddr < self.ends[-1]:
            raise ValueError("round 1 copies in address order")
        offset = self.size
        if self.ends and self.ends[-1] == vaddr:
            self.ends[-1] = vaddr + length
        else:
            self.starts.append(vaddr)
            self.ends.append(vaddr + length)
            self.offsets.append(offset)
        self.size += length
        return offset

    def split(self, lo: int, hi: int) -> Iterator[tuple[int, int, int | None]]:
        """[lo, hi) cut into pieces round 1 placed, with their offset, and pieces it did not (None)."""
        index = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while lo < hi:
            if index >= len(self.starts) or hi <= self.starts[index]:
                yield lo, hi, None
                return
            start, end = self.starts[index], self.ends[index]
            if lo >= end:
                index += 1
                continue
            if lo < start:
                yield lo, start, None
                lo = start
            top = min(hi, end)
            yield lo, top, self.offsets[index] + lo - start
            lo = top
            index += 1


# -- making the image whole -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    vaddr: int
    pages: int
    source: int  # descriptor to read from
    offset: int  # where in it
    flags: int


def _make_whole(
    pagemap: Path, found_file: Path, process: _Process, images_dir: Path, copy_path: Path
) -> tuple[int, int, int]:
    """Make one process's pages file and pagemap hold the pages found and not dumped too: the copy file,
    its pages moved into place and the dump's written in, becomes the pages file. (Pages dumped, pages
    taken from the copies, bytes moved or written in.)"""
    raw = pagemap.read_bytes()
    messages = records(raw)
    head = fields(messages[0])
    pages_id = head.get(1)
    if not isinstance(pages_id, int):
        raise Incomplete(f"{pagemap.name} has no pages_id")
    pages_path = images_dir / f"pages-{pages_id}.img"
    dumped: list[tuple[int, int, int, int]] = []  # vaddr, pages, offset in the pages file, flags
    offset = 0
    for record in messages[1:]:
        entry = fields(record)
        vaddr, count, flags = entry.get(1), entry.get(5, entry.get(2)), entry.get(4, PE_PRESENT)
        if not isinstance(vaddr, int) or not isinstance(count, int) or not isinstance(flags, int):
            raise Incomplete(f"{pagemap.name} has an entry torpor cannot read")
        if not flags & PE_PRESENT:
            raise Incomplete(f"{pagemap.name} has pages that are not in it (flags {flags})")
        dumped.append((vaddr, count, offset, flags))
        offset += count * PAGE_SIZE
    spans = [(r.start, r.start + r.length) for r in process.tracker.spans()]
    found = _read_found(found_file)
    extra = _extents(process.extra)
    pages = os.open(pages_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        runs = [_Run(v, n, pages, o, f) for v, n, o, f in dumped]
        taken = 0
        for start, end, categories in found:
            if categories & _PAGE_IS_WRITTEN:
                continue  # written since the last round: the dump's, if CRIU dumps it at all
            for lo, hi in _subtract(
                _clip(start, end, spans), [(v, v + n * PAGE_SIZE) for v, n, _, _ in dumped]
            ):
                for a, b, have in _held(lo, hi, process, extra):
                    if have is None:
                        if categories & _PAGE_IS_PRESENT:
                            raise Incomplete(
                                f"process {process.pid}: a page at {a:#x} was neither dumped nor copied"
                            )
                        continue  # a page never touched: its protection's marker reads as swapped
                    runs.append(_Run(a, (b - a) // PAGE_SIZE, *have, PE_PRESENT))
                    taken += (b - a) // PAGE_SIZE
        runs.sort(key=lambda run: run.vaddr)
        _check_disjoint(runs, process.pid)
        moved = _assemble(runs, process.copy)
        with open(pagemap.parent / prestore.REWRITTEN, "a") as rewritten:  # before the files change
            rewritten.write(f"{pages_path.name}\n{pagemap.name}\n")
        os.rename(copy_path, pages_path)
        _write_pagemap(pagemap, raw[:8], pages_id, runs)
    finally:
        os.close(pages)
    return sum(n for _, n, _, _ in dumped), taken, moved


def _held(
    lo: int, hi: int, process: _Process, extra: Sequence[tuple[int, int]]
) -> Iterator[tuple[int, int, tuple[int, int] | None]]:
    """[lo, hi) cut into pieces with where the copies hold them, (descriptor, offset), or None."""
    for a, b, offset in process.layout.split(lo, hi):
        if offset is not None:
            yield a, b, (process.copy, offset)
            continue
        for c, d, have in _split_held(a, b, extra):
            yield c, d, (process.extra, c) if have else None


def _read_found(path: Path) -> list[tuple[int, int, int]]:
    data = path.read_bytes()
    if len(data) % _FOUND.size:
        raise Incomplete(f"{path.name} is cut short")
    regions = sorted(_FOUND.iter_unpack(data))
    merged: list[tuple[int, int, int]] = []
    for start, end, categories in regions:  # a range scanned twice (a retried fill) is found twice
        if merged and start < merged[-1][1]:
            last = merged[-1]
            if end > last[1]:
                merged[-1] = (last[0], end, last[2] | categories)
            continue
        merged.append((start, end, categories))
    return merged


def _clip(start: int, end: int, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) within ``spans`` (sorted, disjoint)."""
    return [(max(start, lo), min(end, hi)) for lo, hi in spans if lo < end and hi > start]


def _subtract(pieces: list[tuple[int, int]], taken: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """``pieces`` less the sorted, disjoint ranges ``taken``."""
    for lo, hi in pieces:
        for t_lo, t_hi in taken:
            if t_hi <= lo or t_lo >= hi:
                continue
            if t_lo > lo:
                yield lo, t_lo
            lo = max(lo, t_hi)
            if lo >= hi:
                break
        if lo < hi:
            yield lo, hi


def _extents(fd: int) -> list[tuple[int, int]]:
    """The ranges of a sparse file that hold data (the extra file: what later rounds copied at their
    addresses), by SEEK_DATA/SEEK_HOLE."""
    found: list[tuple[int, int]] = []
    position = 0
    while True:
        try:
            data = os.lseek(fd, position, _SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return found
            raise
        hole = os.lseek(fd, data, _SEEK_HOLE)
        found.append((data, hole))
        position = hole


def _split_held(lo: int, hi: int, held: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, bool]]:
    """[lo, hi) cut into pieces ``held`` covers (True) or not (False)."""
    for h_lo, h_hi in held:
        if h_hi <= lo:
            continue
        if h_lo >= hi:
            break
        if h_lo > lo:
            yield lo, h_lo, False
            lo = h_lo
        end = min(hi, h_hi)
        yield lo, end, True
        lo = end
        if lo >= hi:
            return
    if lo < hi:
        yield lo, hi, False


def _check_disjoint(runs: Sequence[_Run], pid: int) -> None:
    for before, after in itertools.pairwise(runs):
        if before.vaddr + before.pages * PAGE_SIZE > after.vaddr:
            raise Incomplete(f"process {pid}: pages at {after.vaddr:#x} would be in the image twice")


def _assemble(runs: Sequence[_Run], copy: int) -> int:
    """Turn the copy file into the pages file of ``runs`` (in address order), in place; bytes moved.

    Round 1 laid its pages out in address order, so a page of the image sits either where round 1 put
    it or, where pages before it came or went since, a little before or after. Pages moving towards the
    start are moved first, in address order, then those moving towards the end, in reverse: as the
    order of the pages is kept, neither ever writes over a page not yet moved. Pages from elsewhere
    (the dump, the extra file) are written last, into the places left for them."""
    placed: list[tuple[_Run, int]] = []
    position = 0
    for run in runs:
        placed.append((run, position))
        position += run.pages * PAGE_SIZE
    buffer = memoryview(bytearray(_CHUNK))
    moved = 0
    ours = [(run, to) for run, to in placed if run.source == copy and run.offset != to]
    for run, to in ours:
        if to < run.offset:
            moved += _move(copy, run.offset, copy, to, run.pages * PAGE_SIZE, buffer)
    for run, to in reversed(ours):
        if to > run.offset:
            moved += _move(copy, run.offset, copy, to, run.pages * PAGE_SIZE, buffer, backwards=True)
    for run, to in placed:
        if run.source != copy:
            moved += _move(run.source, run.offset, copy, to, run.pages * PAGE_SIZE, buffer)
    os.ftruncate(copy, position)
    return moved


def _move(
    source: int, offset: int, out: int, to: int, length: int, buffer: memoryview, backwards: bool = False
) -> int:
    """Copy ``length`` bytes at ``offset`` of ``source`` to ``to`` of ``out`` through ``buffer``; overlapping
    ranges of one file are safe forwards when ``to < offset``, backwards when ``to > offset``."""
    pieces = list(_pieces(0, length, len(buffer)))
    for at, size in reversed(pieces) if backwards else pieces:
        view = buffer[:size]
        if os.preadv(source, [view], offset + at) != size:
            raise Incomplete("the copy of the job's memory ended early")
        os.pwrite(out, view, to + at)
    return length


def _write_pagemap(pagemap: Path, magic: bytes, pages_id: int, runs: Sequence[_Run]) -> None:
    """Write the pagemap of ``runs`` beside the old one and rename it over: runs that meet with the same
    flags make one entry."""
    entries: list[bytes] = [_message([(1, pages_id)])]
    last: list[int] | None = None  # vaddr, pages, flags of the entry being built
    for run in runs:
        if last is not None and last[0] + last[1] * PAGE_SIZE == run.vaddr and last[2] == run.flags:
            last[1] += run.pages
        else:
            if last is not None:
                entries.append(_entry(*last))
            last = [run.vaddr, run.pages, run.flags]
    if last is not None:
        entries.append(_entry(*last))
    new_map = pagemap.with_name(pagemap.name + ".whole")
    new_map.write_bytes(magic + b"".join(struct.pack("<I", len(e)) + e for e in entries))
    os.chmod(new_map, 0o600)
    os.rename(new_map, pagemap)


def _entry(vaddr: int, pages: int, flags: int) -> bytes:
    # CRIU 4.x: nr_pages in field 5, the old u32 field 2 (required) as zero
    return _message([(1, vaddr), (2, 0), (4, flags), (5, pages)])


def _message(values: Sequence[tuple[int, int]]) -> bytes:
    out = bytearray()
    for number, value in values:
        out += _varint(number << 3) + _varint(value)
    return bytes(out)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def remove(images_dir: Path) -> None:
    """Remove the pre-copy's folder from ``images_dir`` (before it is stored)."""
    shutil.rmtree(images_dir / FOLDER, ignore_errors=True)
