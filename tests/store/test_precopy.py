"""Storing memory while CRIU holds the process frozen: which pages CRIU dumps, read from outside.

``adapters/procmem.py`` reads a stopped process's pages the way CRIU selects them; the store hashes and
stores them before CRIU writes its pages file (``Repository.prestore(memory_of=...)``). Checked here
against a scripted process whose pages are known, and against real CRIU: the windows read from a
stopped job are the chunks of its checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest

from conftest import Torpor
from torpor.adapters import procmem
from torpor.adapters.folder import FolderBackend
from torpor.core.store.base import is_bulk
from torpor.core.store.prestore import Prestored
from torpor.core.store.repository import Repository

MiB = 1 << 20
PAGE = procmem.PAGE_SIZE

# maps 4 MiB of anonymous memory at a 1 MiB boundary: pages 0-99 written (page n holds n), pages 200-209
# only read (the zero page), the rest untouched; and a private mapping of a 16-page file, page 3 written
CHILD = textwrap.dedent(
    """
    import mmap, sys, time
    anon = mmap.mmap(-1, 5 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anon.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages: a huge page would make all 512 present
    import ctypes
    base = ctypes.addressof(ctypes.c_char.from_buffer(anon))
    skip = (-base) % (1 << 20)
    for page in range(100):
        anon[skip + page * 4096 : skip + (page + 1) * 4096] = bytes([page]) * 4096
    for page in range(200, 210):
        anon[skip + page * 4096]
    f = open(sys.argv[1], "r+b")
    backed = mmap.mmap(f.fileno(), 16 * 4096, flags=mmap.MAP_PRIVATE)
    backed[3 * 4096 : 4 * 4096] = b"w" * 4096
    for page in (5, 6):
        backed[page * 4096]
    file_base = ctypes.addressof(ctypes.c_char.from_buffer(backed))
    print(base + skip, file_base, flush=True)
    time.sleep(3600)
    """
)


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[int, int, int]]:
    """A stopped process holding the mappings of CHILD: (pid, anonymous base, file mapping base)."""
    backing = tmp_path / "backing"
    backing.write_bytes(b"f" * 16 * PAGE)
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(backing)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        anon, backed = (int(x) for x in process.stdout.readline().split())
        os.kill(process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not procmem.stopped(process.pid):
            assert time.monotonic() < deadline, "the child did not stop"
            time.sleep(0.01)
        yield process.pid, anon, backed
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.root("page frame numbers in /proc/PID/pagemap are shown to root only")
def test_the_pages_criu_dumps_are_found_and_read(child: tuple[int, int, int]) -> None:
    pid, anon, backed = child
    zero = procmem.zero_page_frame()
    assert zero is not None  # tests run as root: page frames are visible
    found = {window.index: window for window in procmem.windows(pid, MiB, zero)}
    # the written anonymous pages; not those only read (pages 200-209, the zero page) or untouched
    assert found[anon // MiB].runs == ((anon, 100 * PAGE),)
    # of the private file mapping only the page written (copied on write)
    in_file = [run for run in found[backed // MiB].runs if backed <= run[0] < backed + 16 * PAGE]
    assert in_file == [(backed + 3 * PAGE, PAGE)]
    buffer = memoryview(bytearray(MiB))
    assert procmem.read(pid, found[anon // MiB].runs, buffer) == 100 * PAGE
    assert bytes(buffer[: 100 * PAGE]) == b"".join(bytes([page]) * PAGE for page in range(100))
    assert procmem.read(pid, ((backed + 3 * PAGE, PAGE),), buffer) == PAGE and buffer[:PAGE] == b"w" * PAGE


def test_a_running_process_is_not_stopped(child: tuple[int, int, int]) -> None:
    pid, _, _ = child
    assert procmem.stopped(pid)
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while procmem.stopped(pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not procmem.stopped(99999999)


@pytest.mark.root("page frame numbers in /proc/PID/pagemap are shown to root only")
def test_prestore_stores_the_memory_of_stopped_processes(child: tuple[int, int, int], tmp_path: Path) -> None:
    pid, _, _ = child
    repo = Repository(FolderBackend(tmp_path / "store"))
    dumping = tmp_path / "dumping"
    dumping.mkdir()  # nothing written by CRIU yet
    windows = list(procmem.windows(pid, MiB, procmem.zero_page_frame()))
    prestored = Prestored()
    deadline = time.monotonic() + 60

    def done() -> bool:  # the dump is over once all the memory was read (if it never is, in a minute)
        return prestored.memory_read >= sum(w.size for w in windows) or time.monotonic() > deadline

    repo.prestore(dumping, prestored, done, memory_of=[pid])
    assert prestored.memory_read == sum(window.size for window in windows)
    expected = blake3.blake3(b"".join(bytes([page]) * PAGE for page in range(100))).hexdigest()
    assert expected in repo.stored_chunks()
    assert prestored.memory[expected] > 0  # new: the checkpoint will count it as what it stored
    assert not prestored.pieces


@pytest.mark.criu
@pytest.mark.timeout(180)
def test_the_windows_of_a_stopped_job_are_the_chunks_of_its_checkpoint(torpor: Torpor) -> None:
    job = str(Path(__file__).parent / "jobs" / "memory_check.py")
    torpor.run("run", "--name", "w", "--", sys.executable, "-u", job, "48")
    torpor.wait_log("w", "digest")
    pid = int(torpor.job("w")["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        zero = procmem.zero_page_frame()
        buffer = memoryview(bytearray(MiB))
        read = set()
        for window in procmem.windows(pid, MiB, zero):
            size = procmem.read(pid, window.runs, buffer)
            read.add(blake3.blake3(buffer[:size]).hexdigest())
    finally:
        os.kill(pid, signal.SIGCONT)
    torpor.run("checkpoint", "w", "--wait")
    checkpoint = torpor.json("checkpoints", "w")[0]["id"]
    manifest = Repository(FolderBackend(torpor.home / "images")).manifest(checkpoint)
    chunks = [c for f in manifest.files if is_bulk(f.name) for _, _, c in f.extents if c]
    same = [c for c in chunks if c in read]
    # the 48 MiB the job only reads are the same; what the interpreter changed since may differ
    assert len(same) >= 46 and len(same) >= 0.8 * len(chunks)
