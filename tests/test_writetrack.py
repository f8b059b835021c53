"""adapters/writetrack: the pages a real running process writes, tracked from outside it (userfaultfd
write-protection in asynchronous mode, read with PAGEMAP_SCAN; Linux >= 6.7). No fake: a real Python
process, made to create its userfaultfd through ptrace while it waits in a system call."""

from __future__ import annotations

import mmap
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from conftest import Torpor, python_job
from torpor.adapters import writetrack
from torpor.adapters.system import procfs
from torpor.adapters.writetrack import Range

PAGE = mmap.PAGESIZE
GETPID = 39  # x86-64
PAGES = 4096  # 16 MiB

# writes one byte into each page named on a line of its stdin ("3 10 11"), then answers "ok"; blocked
# in read() on its stdin in between, the system call a tracer interrupts
CHILD = textwrap.dedent(
    f"""
    import ctypes, mmap, sys
    area = mmap.mmap(-1, {PAGES} * {PAGE}, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.write(b"x" * len(area))
    print(ctypes.addressof(ctypes.c_char.from_buffer(area)), flush=True)
    for line in sys.stdin:
        for page in line.split():
            area[int(page) * {PAGE}] = 7
        print("ok", flush=True)
    """
)


class Child:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.base = int(self.process.stdout.readline())

    def write(self, *pages: int) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(" ".join(map(str, pages)) + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == "ok\n"  # it answers: its read() went on right

    def pages(self, ranges: list[Range]) -> list[int]:
        """The pages of its area among ``ranges``."""
        end = self.base + PAGES * PAGE
        return [
            (at - self.base) // PAGE
            for each in ranges
            for at in range(max(each.start, self.base), min(each.start + each.length, end), PAGE)
        ]


@pytest.fixture
def child() -> Iterator[Child]:
    found = Child()
    yield found
    found.process.kill()
    found.process.communicate()


def tracker_of(child: Child) -> writetrack.Tracker:
    try:
        return writetrack.track(child.process.pid)
    except writetrack.NotTrackable as exc:
        if "Linux 6.7" in str(exc) or "x86-64" in str(exc):  # a kernel before 6.7, another architecture
            pytest.skip(str(exc))
        raise


@pytest.mark.root("to trace another process")
def test_the_pages_a_process_wrote_are_exactly_those_and_each_scan_starts_a_new_period(child: Child) -> None:
    with tracker_of(child) as tracker:
        assert child.pages(tracker.written()) == []
        child.write(3, 10, 11, 4000)
        assert child.pages(tracker.written()) == [3, 10, 11, 4000]
        assert child.pages(tracker.written()) == []  # protected again by the scan
        child.write(10)
        child.write(2, 10)
        assert child.pages(tracker.written()) == [2, 10]
        # the process keeps no userfaultfd of its own (CRIU could not dump one)
        fds = os.listdir(f"/proc/{child.process.pid}/fd")
        assert not any("userfaultfd" in os.readlink(f"/proc/{child.process.pid}/fd/{fd}") for fd in fds)
    child.write(5)  # no longer tracked: it runs on as before


@pytest.mark.root("to trace another process")
def test_memory_mapped_after_the_first_protection_is_tracked_once_protected_again(child: Child) -> None:
    with tracker_of(child) as tracker:
        before = {(r.start, r.length) for r in writetrack._writable_mappings(child.process.pid)}
        child.write(1)
        assert tracker.protect() == []  # nothing new mapped; every page protected again
        assert child.pages(tracker.written()) == []
        assert {(r.start, r.length) for r in writetrack._writable_mappings(child.process.pid)} == before


# two threads: the main one asleep (clock_nanosleep, restarted through restart_syscall when a tracer
# interrupts it), the other writing a page every millisecond and counting its rounds
SLEEPER = textwrap.dedent(
    f"""
    import mmap, threading, time
    area = mmap.mmap(-1, {PAGES} * {PAGE}, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    rounds = 0
    def write():
        global rounds
        while True:
            area[(rounds % 64) * {PAGE}] = 1
            rounds += 1
            time.sleep(0.001)
    threading.Thread(target=write, daemon=True).start()
    while True:
        time.sleep(0.2)
        print(rounds, flush=True)
    """
)


@pytest.mark.root("to trace another process")
def test_a_process_with_threads_and_a_sleep_runs_on_unharmed_and_its_writes_are_seen() -> None:
    process = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        first = int(process.stdout.readline())
        with writetrack.track(process.pid) as tracker:
            counts = [int(process.stdout.readline()) for _ in range(3)]
            assert tracker.written(), "the writing thread's pages"
        assert first < counts[0] < counts[1] < counts[2]  # both threads went on, and its sleeps ended
        assert process.poll() is None
    finally:
        process.kill()
        process.communicate()


@pytest.mark.root("to trace another process")
def test_a_stopped_process_is_refused_and_stays_stopped(child: Child) -> None:
    os.kill(child.process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while procfs.process_state(child.process.pid) != "T":  # the signal is taken in a moment
        assert time.monotonic() < deadline, "the child did not stop"
        time.sleep(0.01)
    try:
        with pytest.raises(writetrack.NotTrackable, match="is stopped"):
            writetrack.track(child.process.pid)
        assert procfs.process_state(child.process.pid) == "T"
        # stopped after the check, before the call is made (the injection sees a group stop): refused,
        # or (closing its copy of the descriptor) made and stopped again
        with pytest.raises(writetrack.NotTrackable, match="is stopped"):
            writetrack._inject(child.process.pid, GETPID)
        # detached with its stop signal given back, it runs for a moment before it takes it again
        deadline = time.monotonic() + 10
        while procfs.process_state(child.process.pid) != "T":
            assert time.monotonic() < deadline, "the child did not stay stopped"
            time.sleep(0.01)
        assert writetrack._inject(child.process.pid, GETPID, if_stopped=True) == child.process.pid
        time.sleep(0.1)
        assert procfs.process_state(child.process.pid) == "T"
    finally:
        os.kill(child.process.pid, signal.SIGCONT)
    child.write(1)


def test_a_process_that_is_gone_cannot_be_tracked_said_in_one_line() -> None:
    process = subprocess.Popen(["true"])
    process.wait()
    with pytest.raises(writetrack.NotTrackable) as refused:
        writetrack.track(process.pid)
    assert "\n" not in str(refused.value)


@pytest.mark.criu
@pytest.mark.root("to trace another process")
def test_a_tracked_job_is_checkpointed_hibernated_and_resumed_as_any_other(torpor: Torpor) -> None:
    torpor.run("run", "--name", "c", *python_job("counter.py"))
    try:
        torpor.wait_log("c", "step 2")
        with writetrack.track(int(torpor.job("c")["pid"])) as tracker:
            torpor.wait_log("c", "step 4")
            assert tracker.written()  # its heap and stack, at least
            torpor.run("checkpoint", "c")
            torpor.run("hibernate", "c")
        before = torpor.log("c").count("step ")
        torpor.run("resume", "c")
        torpor.wait_for(lambda: torpor.log("c").count("step ") > before + 2, 30, "c to count on")
        counted = re.findall(r"^step (\d+)$", torpor.log("c"), re.M)
        assert counted == [str(n) for n in range(len(counted))]  # each step once, none lost
    finally:
        torpor.run("rm", "--force", "c", check=False)


@pytest.mark.criu
@pytest.mark.root("to trace another process")
def test_doctor_says_whether_this_machine_tracks_a_running_jobs_writes(torpor: Torpor) -> None:
    said = torpor.json("doctor")["criu"]["write_tracking"]
    assert said == {"uffd_wp_async": writetrack.probe() is None, "problem": writetrack.probe()}
    line = [x for x in torpor.run("doctor").stdout.splitlines() if "tracking a running job's writes" in x]
    assert len(line) == 1 and ("yes" in line[0]) == said["uffd_wp_async"]
