"""Writes a running sequence into its memory while torpor pre-copies it: ``precopy_job.py MIB RATE RESULT``.

Its main region (MIB MiB of private anonymous memory) takes RATE writes a second: step k writes k into
the first and last 8 bytes of page k mod N. What each page must hold is kept in the process's own
memory (a model), so a restored process can tell a page of another moment from the right one. Between
the writes it changes its memory the ways a real job does, one change every 0.1 s in turn:

- maps a new region and fills it; unmaps the oldest such region;
- drops a stretch of the main region (``MADV_DONTNEED``): it must read as zeros until written again;
- starts a thread that writes a region of its own, the same way;
- forks a child (once) that does the same in its copy of the memory.

On SIGUSR1 each of them checks every page it owns against its model, at a point where the model is
up to date, and RESULT (RESULT.thread-N, RESULT.child) gets ``ok`` or the first page that is wrong. It
prints ``ready`` once the first changes are made.
"""

import ctypes
import mmap
import os
import signal
import sys
import threading
import time
from array import array
from pathlib import Path

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

mib, rate, result = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
asked = threading.Event()


class Sequence:
    """A private anonymous region whose pages hold a running count, and the model of it."""

    def __init__(self, pages: int) -> None:
        self.map = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.pages = pages
        self.model = array("Q", bytes(8 * pages))
        self.step = 0

    def write(self, count: int) -> None:
        for _ in range(count):
            self.step += 1
            page = self.step % self.pages
            value = self.step.to_bytes(8, "little")
            self.map[page * PAGE : page * PAGE + 8] = value
            self.map[page * PAGE + PAGE - 8 : page * PAGE + PAGE] = value
            self.model[page] = self.step

    def drop(self, first: int, count: int) -> None:
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.map)) + first * PAGE
        if libc.madvise(address, count * PAGE, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise")
        for page in range(first, first + count):
            self.model[page] = 0

    def check(self) -> str:
        for page in range(self.pages):
            want = self.model[page]
            head = int.from_bytes(self.map[page * PAGE : page * PAGE + 8], "little")
            tail = int.from_bytes(self.map[page * PAGE + PAGE - 8 : page * PAGE + PAGE], "little")
            if head != want or tail != want:
                return f"page {page}: holds {head}/{tail}, should hold {want}"
            if want == 0 and self.map[page * PAGE : page * PAGE + PAGE] != bytes(PAGE):
                return f"page {page}: was dropped but is not zeros"
        return "ok"


class Filled:
    """A region mapped anew, filled with a pattern of its own."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.map = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for page in range(64):
            self.map[page * PAGE : page * PAGE + 16] = (seed * 1000 + page).to_bytes(16, "little")

    def check(self) -> str:
        for page in range(64):
            if self.map[page * PAGE : page * PAGE + 16] != (self.seed * 1000 + page).to_bytes(16, "little"):
                return f"region {self.seed}, page {page}: wrong"
        return "ok"


def answer(path: Path, text: str) -> None:
    path.with_name(path.name + ".new").write_text(text)
    path.with_name(path.name + ".new").rename(path)


def thread_main(number: int, done: threading.Event) -> None:
    own = Sequence(256)
    while True:
        if asked.is_set() and not done.is_set():
            answer(result.with_name(f"{result.name}.thread-{number}"), own.check())
            done.set()
        own.write(20)
        time.sleep(0.005)


def child_main(main: Sequence) -> None:
    """The forked child: its copy of the main region goes on with a count of its own."""
    signal.signal(signal.SIGUSR1, lambda *_: asked.set())
    main.step += 10**9
    while True:
        if asked.is_set():
            answer(result.with_name(result.name + ".child"), main.check())
            asked.clear()
        main.write(50)
        time.sleep(0.01)


def main() -> None:
    signal.signal(signal.SIGUSR1, lambda *_: asked.set())
    region = Sequence(mib * 256)
    region.write(region.pages)  # every page holds something
    filled: list[Filled] = []
    threads: list[threading.Event] = []
    child = 0
    change, seed, ready = 0, 0, False
    tick = time.monotonic()
    while True:
        if asked.is_set():
            for done in threads:
                done.wait(10)
            report = [region.check(), *(each.check() for each in filled)]
            if child:
                os.kill(child, signal.SIGUSR1)
            bad = [line for line in report if line != "ok"]
            answer(result, bad[0] if bad else "ok")
            asked.clear()
            for done in threads:
                done.clear()
        region.write(max(1, rate // 100))
        now = time.monotonic()
        if now - tick >= 0.1:
            tick = now
            kind = change % 5
            change += 1
            if kind == 0:
                seed += 1
                filled.append(Filled(seed))
            elif kind == 1 and len(filled) > 2:
                filled.pop(0).map.close()
            elif kind == 2:
                first = (change * 97) % (region.pages - 64)
                region.drop(first, 64)
            elif kind == 3 and len(threads) < 4:
                done = threading.Event()
                threads.append(done)
                threading.Thread(target=thread_main, args=(len(threads), done), daemon=True).start()
            elif kind == 4 and not child:
                child = os.fork()
                if child == 0:
                    child_main(region)
            if change == 10 and not ready:
                ready = True
                print("ready", flush=True)
        time.sleep(0.01)


main()
