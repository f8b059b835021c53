"""Looking at a starting job with real things: a port that listens or not (torpor.adapters.readiness
.port_accepts), a log file appended to in pieces (LogFollower), the CPU time of real busy, idle and
reaped processes (procfs.cpu_seconds_with_children), and torpor.core.readiness.watch on real jobs until
each rule says ready, the job exits, the timeout passes or the caller stops it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import free_port
from torpor.adapters.readiness import MAX_LINE, MAX_READ, LogFollower, port_accepts
from torpor.adapters.system import procfs
from torpor.core.readiness import read_ready_when, watch
from torpor.errors import UsageError
from torpor.policy.ready import Outcome, ReadyWhen

#: burns ``argv[1]`` seconds of its own CPU time, says so, then sleeps
BUSY_THEN_SLEEP = (
    "import sys, time\n"
    "while time.process_time() < float(sys.argv[1]):\n"
    "    pass\n"
    "print('done', flush=True)\n"
    "time.sleep(30)\n"
)

Spawn = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start a process (its output piped); every one is killed and reaped after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(*argv: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        child.wait(timeout=5)
        if child.stdout is not None:
            child.stdout.close()


def itself(pid: int) -> list[int]:
    """The job's processes, for a job that is one process (a test's child has no PID namespace)."""
    return [pid]


# -- a port --------------------------------------------------------------------------------------------


def test_a_port_nothing_listens_on_does_not_accept() -> None:
    assert port_accepts("127.0.0.1", free_port(), timeout=1) is False


def test_a_listening_port_accepts_before_anyone_calls_accept_and_no_longer_once_closed() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_accepts("127.0.0.1", port, timeout=1) is True
        assert port_accepts("localhost", port, timeout=1) is True
    assert port_accepts("127.0.0.1", port, timeout=1) is False


def test_an_ipv6_port_accepts() -> None:
    try:
        server = socket.socket(socket.AF_INET6)
        server.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with server:
        server.listen()
        port = server.getsockname()[1]
        assert port_accepts("::1", port, timeout=1) is True
        assert port_accepts("127.0.0.1", port, timeout=1) is False


def test_an_address_that_does_not_answer_is_false_within_the_timeout() -> None:
    began = time.monotonic()
    assert port_accepts("192.0.2.1", 9, timeout=0.2) is False  # TEST-NET-1: routed nowhere
    assert time.monotonic() - began < 1


# -- a log ---------------------------------------------------------------------------------------------


def test_a_log_not_written_yet_has_no_lines_then_complete_lines_come_as_they_end(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    follower = LogFollower(log)
    assert follower.new_lines() == []
    log.write_bytes(b"first\nsec")
    assert follower.new_lines() == ["first"]
    assert follower.new_lines() == []
    with log.open("ab") as out:
        out.write(b"ond\r\nthird\n")
    assert follower.new_lines() == ["second", "third"]
    assert follower.offset == log.stat().st_size


def test_what_was_there_before_the_offset_is_not_read(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"Listening on 8080 (the last run)\n")
    follower = LogFollower(log, offset=log.stat().st_size)
    assert follower.new_lines() == []
    with log.open("ab") as out:
        out.write(b"starting\n")
    assert follower.new_lines() == ["starting"]


def test_bytes_that_are_not_utf8_are_replaced_and_a_character_split_between_writes_is_kept(
    tmp_path: Path,
) -> None:
    log = tmp_path / "job.log"
    follower = LogFollower(log)
    log.write_bytes(b"\xff\xfeok\x00\ncaf\xc3")
    assert follower.new_lines() == ["\ufffd\ufffdok\x00"]
    with log.open("ab") as out:
        out.write(b"\xa9\n")
    assert follower.new_lines() == ["café"]


def test_a_log_that_became_shorter_is_read_again_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"a long first line\nand a half")
    follower = LogFollower(log)
    assert follower.new_lines() == ["a long first line"]
    log.write_bytes(b"new\n")  # truncated and written again
    assert follower.new_lines() == ["new"]


def test_a_line_that_never_ends_is_cut_at_max_line(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"x" * (3 * MAX_LINE + 10))
    follower = LogFollower(log)
    assert follower.new_lines() == ["x" * MAX_LINE] * 3
    with log.open("ab") as out:
        out.write(b"\n")
    assert follower.new_lines() == ["x" * 10]


def test_a_big_write_is_read_over_several_calls(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    count = MAX_READ // 100 + 100
    log.write_bytes((b"y" * 99 + b"\n") * count)
    follower = LogFollower(log)
    first = follower.new_lines()
    assert len(first) == MAX_READ // 100  # the first MiB's complete lines
    assert first + follower.new_lines() == ["y" * 99] * count


# -- CPU time ------------------------------------------------------------------------------------------


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_a_busy_process_counts_its_cpu_time_and_an_idle_one_almost_none(spawn: Spawn) -> None:
    busy = spawn(sys.executable, "-c", BUSY_THEN_SLEEP, "0.3")
    idle = spawn("sleep", "30")
    assert busy.stdout is not None and busy.stdout.readline() == "done\n"
    assert procfs.cpu_seconds_with_children([busy.pid]) >= 0.25
    assert procfs.cpu_seconds_with_children([idle.pid]) < 0.05


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_a_child_that_came_and_went_counts_through_its_parent(spawn: Spawn) -> None:
    script = f'{sys.executable} -c "$0" 0.3 >/dev/null; echo reaped; exec sleep 30'
    parent = spawn("sh", "-c", script, BUSY_THEN_SLEEP.replace("time.sleep(30)", "pass"))
    assert parent.stdout is not None and parent.stdout.readline() == "reaped\n"
    assert procfs.cpu_seconds_with_children([parent.pid]) >= 0.25
    assert procfs.cpu_seconds([parent.pid]) < 0.05  # its own time only


def test_processes_gone_count_nothing() -> None:
    child = subprocess.Popen(["true"])
    child.wait(timeout=5)
    assert procfs.cpu_seconds_with_children([child.pid]) == 0.0


# -- watching a job ------------------------------------------------------------------------------------


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_watch_sees_a_port_ready_once_the_job_listens(spawn: Spawn, tmp_path: Path) -> None:
    job = spawn("sleep", "30")
    port = free_port()
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    began = time.monotonic()
    opener = threading.Thread(target=listen_later)
    opener.start()
    try:
        verdict = watch(ReadyWhen.port_open(port), job.pid, tmp_path / "job.log", 0, started_at=began)
    finally:
        opener.join()
        server.close()
    assert verdict.outcome == Outcome.READY
    assert 0.3 <= verdict.at < 1.5


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_watch_sees_a_log_line_the_job_writes_and_not_the_ones_before_it(
    spawn: Spawn, tmp_path: Path
) -> None:
    log = tmp_path / "job.log"
    log.write_text("Listening on 8080 (the last run)\n")
    writes = f"sleep 0.3; echo loading >> {log}; echo 'Listening on 8080' >> {log}; exec sleep 30"
    began = time.monotonic()
    job = spawn("sh", "-c", writes)
    verdict = watch(
        read_ready_when(r"log:Listening on \d+"), job.pid, log, log.stat().st_size, started_at=began
    )
    assert verdict.outcome == Outcome.READY
    assert 0.3 <= verdict.at < 1.5


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_watch_sees_an_idle_job_ready_after_its_window(spawn: Spawn, tmp_path: Path) -> None:
    job = spawn("sleep", "30")
    verdict = watch(ReadyWhen.cpu_idle(0.3), job.pid, tmp_path / "job.log", 0, members=itself)
    assert verdict.outcome == Outcome.READY
    assert 0.3 <= verdict.at < 1.5
    assert "of one core" in verdict.reason


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_watch_gives_up_on_a_busy_job_at_the_timeout(spawn: Spawn, tmp_path: Path) -> None:
    job = spawn(sys.executable, "-c", BUSY_THEN_SLEEP, "30")
    verdict = watch(ReadyWhen.cpu_idle(0.3), job.pid, tmp_path / "job.log", 0, timeout_s=0.8, members=itself)
    assert verdict.outcome == Outcome.GIVE_UP
    assert verdict.reason.startswith("not ready after 800ms: CPU use")
    assert 0.8 <= verdict.at < 1.5


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_watch_gives_up_when_the_job_exits(spawn: Spawn, tmp_path: Path) -> None:
    began = time.monotonic()
    job = spawn("sleep", "0.2")
    verdict = watch(ReadyWhen.port_open(free_port()), job.pid, tmp_path / "job.log", 0, started_at=began)
    assert verdict.outcome == Outcome.GIVE_UP
    assert "exited" in verdict.reason
    assert 0.2 <= verdict.at < 1.5


@pytest.mark.slow  # real processes, watched for a fraction of a second or more
def test_watch_returns_wait_soon_after_it_is_stopped(spawn: Spawn, tmp_path: Path) -> None:
    job = spawn("sleep", "30")
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    began = time.monotonic()
    verdict = watch(read_ready_when("log:never"), job.pid, tmp_path / "job.log", 0, stop=stop)
    assert verdict.outcome == Outcome.WAIT
    assert time.monotonic() - began < 0.2 + 0.5 + 0.3


def test_watch_counts_from_the_job_start_it_is_given(spawn: Spawn, tmp_path: Path) -> None:
    job = spawn("sleep", "30")
    verdict = watch(
        ReadyWhen.cpu_idle(0.3),
        job.pid,
        tmp_path / "job.log",
        0,
        started_at=time.monotonic() - 5,
        members=itself,
    )
    assert verdict.outcome == Outcome.READY
    assert verdict.at >= 5


def test_a_bad_spec_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--ready-when 'port:0': a TCP port is 1 to 65535") as refused:
        read_ready_when("port:0")
    assert refused.value.exit_code == 2
