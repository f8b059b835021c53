"""Dump by streaming: torpor as the image capture of ``criu dump --stream``.

Covers the capture's protocol against a scripted client speaking CRIU's side of it (files written under
their names, a process's pages written over the memory reserved for it and named only once complete, the
post-dump question answered only once every pipe is read to its end, a pipe left open or a bad name
failing the answer), the post-dump script's answers, and with real CRIU: a job dumped this way restores
with exactly its memory, stays frozen until torpor has read its pages, and runs on when the capture fails.
Every other test that checkpoints a job goes through the streamed dump too (it is the default).
"""

from __future__ import annotations

import array
import os
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Torpor
from torpor.adapters.imagestreamer import (
    ASK_NAME,
    CAPTURE_SCRIPT,
    CAPTURE_SOCKET_NAME,
    RESERVE_PREFIX,
    VERDICT_NAME,
    ImageCapture,
)
from torpor.adapters.system import private, procfs
from torpor.core import checkpoint
from torpor.errors import CheckpointFailed

from .test_lazy_pageserver import JOB, digests

MiB = 1 << 20


# -- the protocol, against a scripted CRIU -----------------------------------------------------------


class ScriptedCriu:
    """CRIU's side of a streamed dump: a request and a pipe per file, then the post-dump question."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = os.open(folder, os.O_PATH)
        try:
            self.conn.connect(f"/proc/self/fd/{fd}/{CAPTURE_SOCKET_NAME}")
        finally:
            os.close(fd)

    def open(self, name: str) -> int:
        """Ask for file ``name``; returns the write end of its pipe."""
        raw = name.encode()
        body = b"\x0a" + bytes([len(raw)]) + raw
        self.conn.sendall(struct.pack("<I", len(body)) + body)
        read_end, write_end = os.pipe()
        self.conn.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [read_end]))])
        os.close(read_end)
        return write_end

    def send(self, name: str, data: bytes) -> None:
        fd = self.open(name)
        write_all(fd, data)
        os.close(fd)

    def ask(self) -> None:
        """What CAPTURE_SCRIPT does at post-dump: a line into the FIFO, which never blocks."""
        fd = os.open(self.folder / ASK_NAME, os.O_RDWR)
        os.write(fd, b"ask\n")
        os.close(fd)

    def verdict(self, timeout: float = 10) -> str:
        path = self.folder / VERDICT_NAME
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, "no verdict"
            time.sleep(0.005)
        return path.read_text().strip()

    def close(self) -> None:
        self.conn.close()


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "dump"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def capture(folder: Path) -> Iterator[ImageCapture]:
    with ImageCapture(folder, reserve={7: 3 * MiB}, drain_timeout=1.0) as started:
        yield started


def test_each_file_is_written_under_its_name_and_a_process_s_pages_over_its_reserved_memory(
    folder: Path, capture: ImageCapture
) -> None:
    reserve = folder / f"{RESERVE_PREFIX}7"
    assert reserve.stat().st_size == 3 * MiB  # set aside before the dump: written, not only allocated
    criu = ScriptedCriu(folder)
    pages = os.urandom(2 * MiB + 4096)
    criu.send("inventory.img", b"inventory")
    pagemap = criu.open("pagemap-7.img")
    write_all(pagemap, b"pagemap of 7")
    pages_fd = criu.open("pages-1.img")
    write_all(pages_fd, pages[: MiB + 5])
    # not named until it is complete: nothing reads a pages file being written over zeros
    time.sleep(0.1)
    assert not (folder / "pages-1.img").exists()
    write_all(pages_fd, pages[MiB + 5 :])
    os.close(pages_fd)
    os.close(pagemap)
    criu.send("pagemap-8.img", b"pagemap of 8")  # a process without a reservation
    criu.send("pages-2.img", b"p" * 8192)
    criu.ask()
    assert criu.verdict() == "complete"
    criu.close()
    capture.stop()
    assert (folder / "pages-1.img").read_bytes() == pages
    assert (folder / "pages-1.img").stat().st_size == len(pages)  # the zeros past its end are gone
    assert (folder / "pages-2.img").read_bytes() == b"p" * 8192
    assert (folder / "inventory.img").read_bytes() == b"inventory"
    assert capture.captured == [
        "inventory.img",
        "pagemap-7.img",
        "pages-1.img",
        "pagemap-8.img",
        "pages-2.img",
    ]
    assert capture.problem is None
    # torpor's own files are gone: the socket, the FIFO, the verdict, the reservation
    assert sorted(p.name for p in folder.iterdir()) == [
        "inventory.img",
        "pagemap-7.img",
        "pagemap-8.img",
        "pages-1.img",
        "pages-2.img",
    ]


def test_pages_that_outgrow_their_reserved_memory_go_on_past_it(folder: Path) -> None:
    """A process whose pages outgrew the memory set aside for it (measured before the dump) loses none."""
    with ImageCapture(folder, reserve={7: MiB}, drain_timeout=1.0) as capture:
        criu = ScriptedCriu(folder)
        pages = os.urandom(2 * MiB + 12345)  # the job grew since its memory was measured
        criu.send("pagemap-7.img", b"pagemap of 7")
        criu.send("pages-1.img", pages)
        criu.ask()
        assert criu.verdict() == "complete"
        criu.close()
    assert (folder / "pages-1.img").read_bytes() == pages
    assert capture.problem is None and not list(folder.glob(f"{RESERVE_PREFIX}*"))


def resident(path: Path) -> int | None:
    """Bytes of file ``path`` mapped into this process and resident in it (None: not mapped)."""
    mapped, ours = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line, its file's path at the end
            ours = line.endswith(f" {path}")
            mapped = 0 if ours and mapped is None else mapped
        elif ours and line.startswith("Rss:"):
            mapped = (mapped or 0) + int(line.split()[1]) * 1024
    return mapped


def test_memory_set_aside_is_mapped_with_every_page_in_place_before_the_dump(folder: Path) -> None:
    """The pages are read from the pipe into memory mapped before the freeze (a copy with no fault and
    no page lookup while the job is frozen): the reservation, and an older copy's file taken over, which
    is written over in place."""
    older = folder / "older-pages.img"
    older.write_bytes(os.urandom(2 * MiB))
    inode = older.stat().st_ino
    with ImageCapture(folder, reserve={8: MiB}, taken={7: older}, drain_timeout=1.0) as capture:
        assert resident(older) == 2 * MiB
        assert resident(folder / f"{RESERVE_PREFIX}8") == MiB
        criu = ScriptedCriu(folder)
        pages = {1: os.urandom(MiB + 4096), 2: os.urandom(MiB // 2)}
        for pid, number in ((7, 1), (8, 2)):
            criu.send(f"pagemap-{pid}.img", b"pagemap")
            criu.send(f"pages-{number}.img", pages[number])
        criu.ask()
        assert criu.verdict() == "complete"
        criu.close()
    assert capture.problem is None
    for number, data in pages.items():
        assert (folder / f"pages-{number}.img").read_bytes() == data
        assert resident(folder / f"pages-{number}.img") is None  # unmapped once the dump is over
    assert (folder / "pages-1.img").stat().st_ino == inode
    assert sorted(p.name for p in folder.iterdir()) == [
        "pagemap-7.img",
        "pagemap-8.img",
        "pages-1.img",
        "pages-2.img",
    ]


def test_the_question_is_answered_only_once_every_pipe_is_read_to_its_end(
    folder: Path, capture: ImageCapture
) -> None:
    criu = ScriptedCriu(folder)
    pages = criu.open("pages-1.img")
    write_all(pages, b"x" * 4096)
    criu.ask()
    time.sleep(0.3)
    assert not (folder / VERDICT_NAME).exists()  # the job's pages may still be in the pipe: no answer yet
    os.close(pages)
    assert criu.verdict() == "complete"
    criu.close()


def test_a_pipe_left_open_fails_the_answer_after_the_drain_timeout(
    folder: Path, capture: ImageCapture
) -> None:
    criu = ScriptedCriu(folder)
    pages = criu.open("pages-1.img")
    criu.ask()
    assert criu.verdict() == "failed: pages-1.img not read to the end within 1 s"
    assert capture.problem == "failed: pages-1.img not read to the end within 1 s"
    os.close(pages)
    criu.close()


def test_a_file_name_that_is_not_criu_s_fails_the_answer(folder: Path, capture: ImageCapture) -> None:
    criu = ScriptedCriu(folder)
    planted = criu.open("../planted.img")
    criu.ask()
    assert criu.verdict() == "failed: criu sent a file named '../planted.img'"
    with pytest.raises(BrokenPipeError):  # the capture closed its end: CRIU's write fails, and its dump
        os.write(planted, b"x")
    os.close(planted)
    assert not (folder.parent / "planted.img").exists()
    criu.close()


def test_stop_without_a_dump_leaves_nothing_behind(folder: Path) -> None:
    capture = ImageCapture(folder, reserve={1: MiB})
    capture.start()
    capture.stop()
    assert list(folder.iterdir()) == []


# -- the post-dump script ----------------------------------------------------------------------------


def _script(folder: Path, verdict: str | None, action: str, pid: int) -> int:
    """Run CAPTURE_SCRIPT as CRIU would at step ``action``, with ``verdict`` answered (None: none)."""
    folder.mkdir()
    script = private.install_script(folder / "capture.sh", CAPTURE_SCRIPT)
    os.mkfifo(folder / ASK_NAME)
    if verdict is not None:
        (folder / VERDICT_NAME).write_text(verdict + "\n")
    env = {
        "CRTOOLS_SCRIPT_ACTION": action,
        "TORPOR_CAPTURE_ASK": str(folder / ASK_NAME),
        "TORPOR_CAPTURE_VERDICT": str(folder / VERDICT_NAME),
        "TORPOR_CAPTURE_PID": str(pid),
        "PATH": os.environ["PATH"],
    }
    return subprocess.run([str(script)], env=env, timeout=10, check=False).returncode


def test_the_script_lets_criu_go_on_only_on_a_complete_capture(tmp_path: Path) -> None:
    assert _script(tmp_path / "complete", "complete", "post-dump", os.getpid()) == 0
    assert _script(tmp_path / "failed", "failed: disk full", "post-dump", os.getpid()) == 1
    # the capturing process is gone and answered nothing: fail (CRIU lets the tree run on)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _script(tmp_path / "gone", None, "post-dump", gone.pid) == 1
    # every other step of the dump passes at once
    assert _script(tmp_path / "other", None, "network-lock", os.getpid()) == 0


# -- with real CRIU ----------------------------------------------------------------------------------


def _job(torpor: Torpor, name: str, mib: int) -> tuple[int, str]:
    torpor.run("run", "--name", name, "--", sys.executable, "-u", JOB, str(mib))
    torpor.wait_log(name, "digest")
    (digest,) = set(digests(torpor.log(name)))
    return int(torpor.job(name)["pid"]), digest


def _dump_streamed(torpor: Torpor, pid: int, tmp_path: Path, *, leave_running: bool) -> Any:
    """One streamed dump of ``pid`` into a new folder, as the launcher makes it (no memory set aside)."""
    engine = torpor.engine()
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    return checkpoint.dump(
        engine.ctx.criu,
        pid,
        images,
        tmp_path / "dump.log",
        leave_running=leave_running,
        tcp=False,
        capture_script=engine.ctx.capture_script(),
    )


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_a_job_dumped_by_streaming_comes_back_with_exactly_its_memory(torpor: Torpor) -> None:
    """A checkpoint's pages go over memory set aside for them, a hibernation's over its older copy's.
    Whole dumps: a pre-copied one writes its pages from the copies it made while the job ran."""
    torpor.env["TORPOR_PRECOPY"] = "0"
    pid, digest = _job(torpor, "exact", 64)
    reserve = checkpoint.reservations(procfs.memory_use(procfs.namespace_members(pid)))
    assert sum(reserve.values()) >= 64 * MiB  # its pages, set aside by its PID in its own namespace
    hot = Path(torpor.env["TORPOR_HOT_DIR"])
    torpor.run("checkpoint", "exact", "--wait")
    (first,) = [c["id"] for c in torpor.json("checkpoints", "exact")]
    (pages,) = hot.glob(f"*/{first}/pages-*.img")
    inode = pages.stat().st_ino
    # the next checkpoint's pages go over the memory of this one's copy in RAM: the very same file
    torpor.run("checkpoint", "exact", "--wait")
    (second,) = [c["id"] for c in torpor.json("checkpoints", "exact") if c["id"] != first]
    (written,) = hot.glob(f"*/{second}/pages-*.img")
    assert written.stat().st_ino == inode
    assert not list(hot.glob(f"*/{first}")) and not list(hot.glob("*/*/.memory-*"))
    # the hibernation takes that copy's memory too (and writes no zeros: its job stops anyway)
    torpor.run("hibernate", "exact", "--wait")
    assert not list(hot.glob(f"*/{second}")) and not list(hot.glob("*/*/.memory-*"))
    logs = list((torpor.home / "jobs" / "exact" / "criu").glob("dump-*.log"))
    assert len(logs) == 3 and all("Running pre-stream scripts" in log.read_text() for log in logs)
    for how in (("resume", "exact"), ("restore", "exact", "--from", second)):  # the hibernation, the second
        before = len(digests(torpor.log("exact")))
        torpor.run(*how)
        torpor.wait_for(
            lambda seen=before: len(digests(torpor.log("exact"))) > seen + 1, what=f"digests after {how}"
        )
        assert set(digests(torpor.log("exact"))) == {digest}
        if how[0] == "resume":
            torpor.run("stop", "exact")


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_the_job_stays_frozen_until_the_capture_answers(
    torpor: Torpor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid, _ = _job(torpor, "held", 16)
    answer = ImageCapture._answer
    seen: list[str] = []

    def slow_answer(self: ImageCapture) -> None:
        time.sleep(1.5)
        seen.append(procfs.process_state(pid) or "?")  # CRIU waits at post-dump: the job is still frozen
        answer(self)

    monkeypatch.setattr(ImageCapture, "_answer", slow_answer)
    stats = _dump_streamed(torpor, pid, tmp_path, leave_running=True)
    assert seen == ["t"]  # stopped by CRIU (ptrace) while the capture took its time
    assert stats.frozen_s >= 1.5
    assert procfs.process_state(pid) in ("S", "R")


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_a_failed_capture_fails_the_dump_and_the_job_runs_on(
    torpor: Torpor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid, digest = _job(torpor, "runs", 16)

    def failing_read(self: ImageCapture, name: str, pipe: int, reserve: Any) -> None:
        os.close(pipe)  # as a reader that met a full disk does
        with self._cond:
            self._errors.append(f"writing {name}: No space left on device")
            self._open.discard(name)
            self._cond.notify_all()

    monkeypatch.setattr(ImageCapture, "_read", failing_read)
    with pytest.raises(CheckpointFailed) as failed:
        # even a hibernation: the job is not killed for an image torpor lost
        _dump_streamed(torpor, pid, tmp_path, leave_running=False)
    assert any("No space left on device" in line for line in failed.value.details), failed.value.details
    assert procfs.is_alive(pid) and procfs.process_state(pid) != "T"
    lines = len(digests(torpor.log("runs")))
    torpor.wait_for(lambda: len(digests(torpor.log("runs"))) > lines, what="the job to go on")
    assert set(digests(torpor.log("runs"))) == {digest}
