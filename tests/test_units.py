"""Small pieces without CRIU: SQLite records and their state machine, CRIU image and log parsing, error
round trips across the launcher boundary, and the CLI's help and rendering.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TORPOR, holders
from torpor.adapters import criu, criuimage, criulog
from torpor.adapters.system import ownprocess
from torpor.apps import cli, render
from torpor.apps.agent import wire
from torpor.core import checkpoint as checkpointing
from torpor.core.records import Records
from torpor.core.recordtypes import Checkpoint, CheckpointId, JobName, JobState, rounds_from
from torpor.core.rewind import written_sizes
from torpor.errors import (
    CheckpointFailed,
    CheckpointNotFound,
    JobNotFound,
    RestoreFailed,
    UsageError,
    WrongState,
    from_dict,
)
from torpor.policy import retry

# -- records ------------------------------------------------------------------------------------------


def make_records(tmp_path: Path) -> Records:
    records = Records(tmp_path / "torpor.db")
    records.create_job(JobName("a"), ["sleep", "1"], "/", str(tmp_path / "a.log"))
    return records


def test_transition_checks_the_expected_state(tmp_path: Path) -> None:
    records = make_records(tmp_path)
    before = records.transition("a", {JobState.STARTING}, JobState.RUNNING, pid=42)
    assert before.state == JobState.STARTING
    job = records.job("a")
    assert job.state == JobState.RUNNING and job.pid == 42
    with pytest.raises(WrongState, match="is running"):
        records.transition("a", {JobState.HIBERNATED}, JobState.RESTORING)
    with pytest.raises(JobNotFound):
        records.transition("b", {JobState.RUNNING}, JobState.EXITED)
    with pytest.raises(UsageError, match="already exists"):
        records.create_job(JobName("a"), ["true"], "/", "x")


def _claim(path: str, results: multiprocessing.Queue[str]) -> None:
    try:
        Records(Path(path)).transition("a", {JobState.HIBERNATED}, JobState.RESTORING)
        results.put("won")
    except WrongState:
        results.put("lost")


def test_only_one_of_many_concurrent_claims_wins(tmp_path: Path) -> None:
    records = make_records(tmp_path)
    records.transition("a", {JobState.STARTING}, JobState.HIBERNATED)
    ctx = multiprocessing.get_context("fork")
    results: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(records.path), results)) for _ in range(6)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in procs)
    results.close()
    results.join_thread()
    assert outcomes == ["lost"] * 5 + ["won"]


def test_checkpoint_lookup_by_prefix(tmp_path: Path) -> None:
    records = make_records(tmp_path)
    for n, cid in enumerate(["abc111", "abc222", "def333"]):
        records.add_checkpoint(
            Checkpoint(CheckpointId(cid), JobName("a"), "checkpoint", float(n), 0.1, 0.2, 10, "4.2.1", None)
        )
    assert records.find_checkpoint("a", "def").id == "def333"
    assert records.latest_checkpoint("a").id == "def333"  # type: ignore[union-attr]
    with pytest.raises(CheckpointNotFound, match="matches 2"):
        records.find_checkpoint("a", "abc")
    with pytest.raises(CheckpointNotFound, match="no checkpoint"):
        records.find_checkpoint("a", "zzz")
    records.delete_job("a")
    assert records.checkpoints() == []


def test_a_pre_copied_checkpoints_rounds_are_kept_with_it(tmp_path: Path) -> None:
    """Its rounds come back from the records and over the agent's wire; deleted with the checkpoint."""
    records = make_records(tmp_path)
    rounds = ((64 << 20, 0.25), (4096, 0.001))
    for cid, kept in (("abc111", rounds), ("abc222", ())):
        records.add_checkpoint(
            Checkpoint(CheckpointId(cid), JobName("a"), "checkpoint", 1.0, 0.1, 0.2, 10, "4.2.1", None, kept)
        )
    pre, plain = records.checkpoints("a")
    assert pre.rounds == rounds and pre.precopied_bytes == (64 << 20) + 4096
    assert plain.rounds == () and plain.precopied_bytes == 0
    over_the_wire = json.loads(json.dumps(wire.checkpoint_to_dict(pre)))
    assert wire.checkpoint_from_dict(over_the_wire) == pre
    with pytest.raises(ValueError, match="pair expected"):
        rounds_from([[1, 2, 3]])
    records.delete_checkpoint(CheckpointId("abc111"))
    with records.transaction() as db:
        assert db.execute("SELECT COUNT(*) FROM precopies").fetchone()[0] == 0


# -- CRIU images and logs -------------------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def image(*records: bytes) -> bytes:
    return b"\x00" * 8 + b"".join(len(r).to_bytes(4, "little") + r for r in records)


def test_dump_stats_are_read_from_stats_dump(tmp_path: Path) -> None:
    dump = field(1, 1500) + field(2, 250_000) + field(3, 1000) + field(4, 2000) + field(7, 4096)
    (tmp_path / "stats-dump").write_bytes(image(field(1, dump)))
    stats = criuimage.read_dump_stats(tmp_path)
    assert stats.frozen_s == pytest.approx(0.25) and stats.freezing_s == pytest.approx(0.0015)
    assert stats.pages_written == 4096
    assert criuimage.read_dump_stats(tmp_path / "missing").frozen_s == 0.0


def test_open_files_and_socket_paths_are_read_from_files_img(tmp_path: Path) -> None:
    reg_written = field(1, 7) + field(2, 0o100001) + field(6, b"/data/metrics.csv") + field(8, 123)
    reg_library = field(1, 8) + field(2, 0) + field(6, b"/usr/lib/libc.so.6") + field(8, 999)
    reg_log = field(1, 9) + field(2, 0o102001) + field(3, 4567) + field(6, b"/var/log/job.log")
    unix = field(1, 10) + field(11, b"/tmp/pymp-x/listener\x00")
    (tmp_path / "files.img").write_bytes(
        image(
            field(1, 1) + field(2, 7) + field(3, reg_written),
            field(1, 1) + field(2, 8) + field(3, reg_library),
            field(1, 1) + field(2, 9) + field(3, reg_log),
            field(1, 5) + field(2, 10) + field(16, unix),
        )
    )
    files = {f.path: f for f in criuimage.open_files(tmp_path)}
    assert files["/data/metrics.csv"] == criuimage.OpenFile("/data/metrics.csv", True, 123)
    assert not files["/usr/lib/libc.so.6"].writable
    assert files["/var/log/job.log"].size is None
    assert files["/var/log/job.log"].append and files["/var/log/job.log"].pos == 4567
    assert not files["/data/metrics.csv"].append
    assert criuimage.unix_socket_paths(tmp_path) == ["/tmp/pymp-x/listener"]


def test_the_size_at_the_checkpoint_of_appended_files_is_the_furthest_offset_that_wrote() -> None:
    def opened(
        path: str, size: int | None, append: bool = False, pos: int = 0, writable: bool = True
    ) -> criuimage.OpenFile:
        return criuimage.OpenFile(path, writable, size, append, pos)

    sizes = written_sizes(
        [
            opened("/w.csv", 100),
            opened("/log", None, append=True, pos=40),
            opened("/log", None, append=True, pos=70),  # another process of the job appended later
            opened("/log", None, append=True, pos=0),  # opened, never written: says nothing
            opened("data/rel", 5),
            opened("/never", None, append=True, pos=0),
            opened("/lib.so", 900, writable=False),
            opened("/both", None, append=True, pos=9),
            opened("/both", 12),  # CRIU's own size wins: it is what it checks
        ]
    )
    assert sizes == {
        Path("/w.csv"): (100, True),
        Path("/log"): (70, False),
        Path("/data/rel"): (5, True),
        Path("/both"): (12, True),
    }


def test_log_excerpt_keeps_errors_once_and_drops_noise(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.000001) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self\n"
        "(00.1) some info\n"
        "(00.2) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device\n"
        "(00.3) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device\n"
        "(00.4) Error (criu/cr-dump.c:1975): Dumping FAILED.\n"
    )
    assert criulog.log_excerpt(log) == [
        "(00.2) Error (criu/bfd.c:131): bfd: Error flushing image: No space left on device",
        "(00.4) Error (criu/cr-dump.c:1975): Dumping FAILED.",
    ]


def test_criu_version_is_checked(tmp_path: Path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 4.2.1'\n")
    fake.chmod(0o755)
    assert criu.Criu(fake).require().version_tuple == (4, 2, 1)


# -- errors and CLI -----------------------------------------------------------------------------------------


def test_a_private_error_crosses_the_launcher_boundary_as_its_nearest_public_class() -> None:
    class _Private(CheckpointFailed):
        pass

    back = from_dict(_Private("it broke").to_dict())
    assert type(back) is CheckpointFailed and back.exit_code == 4 and back.message == "it broke"


def test_errors_cross_the_launcher_boundary() -> None:
    error = RestoreFailed("it broke", details=["line 1"])
    again = from_dict(error.to_dict())
    assert type(again) is RestoreFailed and again.message == "it broke" and again.details == ["line 1"]
    assert again.exit_code == 5


def test_rendering_helpers() -> None:
    assert cli.human_bytes(512) == "512 B"
    assert cli.human_bytes(3 * 2**30) == "3.0 GiB"
    assert cli.human_age(3725) == "1h02m"
    assert cli.table(["A", "BB"], [["xyz", "1"]]).splitlines() == ["A    BB", "xyz  1"]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (0.00085, "850 µs"),
        (0.010898351669311523, "10.9 ms"),
        (0.4321, "432 ms"),
        (0.9996, "1.0 s"),  # not "1000 ms"
        (3.24, "3.2 s"),
        (42.4, "42 s"),
        (59.96, "1 min"),
        (252, "4 min 12 s"),
        (600, "10 min"),
        (3599.6, "1 h"),
        (7479, "2 h 5 min"),
        (86399, "1 d"),
        (273600, "3 d 4 h"),
        (-3, "-3.0 s"),
        (float("nan"), "nan"),
    ],
)
def test_a_duration_reads_as_a_person_says_it(seconds: float, text: str) -> None:
    assert render.human_duration(seconds) == text


def test_a_time_reads_as_local_time_and_an_age() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", render.human_time(1_800_000_000))
    assert render.human_ago(0.4) == "just now"
    assert render.human_ago(312) == "5 min 12 s ago" and render.human_ago(-3.2) == "in 3 s"


@pytest.mark.parametrize(
    "command",
    [
        "run",
        "ps",
        "logs",
        "checkpoint",
        "hibernate",
        "resume",
        "restore",
        "checkpoints",
        "stop",
        "rm",
        "doctor",
        "store",
        "peers",
        "migrate",
    ],
)
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run([TORPOR, command, "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "usage: torpor" in result.stdout


def test_bad_flag_is_a_one_line_usage_error() -> None:
    result = subprocess.run([TORPOR, "ps", "--bogus"], capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


FAKE_CRIU = """#!/bin/sh
# a stand-in for criu: its dumps fail as CRIU's do when a process of the tree is exiting ($FAILS times)
[ "$1" = --version ] && { echo 'Version: 4.2.1'; exit 0; }
while [ $# -gt 0 ]; do
    case "$1" in --images-dir) dir=$2; shift ;; --log-file) log=$2; shift ;; esac
    shift
done
echo x >> "$dir/../attempts"
echo partial > "$dir/core-1.img"
if [ "$(wc -l < "$dir/../attempts")" -le "$FAILS" ]; then
    echo "(00.058879) Error (criu/seize.c:882): $ERROR" > "$log"
    exit 1
fi
echo "(00.1) Dumping finished successfully" > "$log"
"""


@pytest.mark.parametrize(
    ("error", "fails", "attempts", "ok"),
    [
        ("Zombies with threads are not supported", 1, 2, True),  # a DataLoader worker exiting
        ("Zombies with threads are not supported", 9, retry.DUMP_ATTEMPTS, False),
        ("Can't dump a process with an unsupported file", 1, 1, False),  # not passing: no retry
    ],
)
def test_a_dump_that_met_an_exiting_process_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str, fails: int, attempts: int, ok: bool
) -> None:
    fake = tmp_path / "criu"
    fake.write_text(FAKE_CRIU)
    fake.chmod(0o755)
    monkeypatch.setenv("ERROR", error)
    monkeypatch.setenv("FAILS", str(fails))
    images = tmp_path / "images"
    images.mkdir()
    (images / ".owner").write_text("1")
    dump = criu.Criu(fake)
    if ok:
        checkpointing.dump(dump, os.getpid(), images, tmp_path / "dump.log", leave_running=True)
    else:
        with pytest.raises(CheckpointFailed, match="criu dump failed"):
            checkpointing.dump(dump, os.getpid(), images, tmp_path / "dump.log", leave_running=True)
    assert (tmp_path / "attempts").read_text().count("x") == attempts
    assert (images / ".owner").exists()  # torpor's own files survive a retry


def test_holders_are_the_processes_that_have_the_file_open(tmp_path: Path) -> None:
    """The tests that prove a job never wrote its log wait for this list to be empty: it must see a holder."""
    path = tmp_path / "log"
    with path.open("a"):
        assert os.getpid() in holders(path)
    assert os.getpid() not in holders(path)


def _another_holds() -> bool:
    """Whether a process other than this one has the PM QoS device open (a request of its own)."""
    device = str(ownprocess.CPU_LATENCY_DEVICE)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == device for fd in (entry / "fd").iterdir()):
                return True
        except OSError:
            continue
    return False


def _wait_until_no_other_holds(timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _another_holds() and time.monotonic() < deadline:
        time.sleep(0.05)


def _cpu_latency_us() -> int:
    with open(ownprocess.CPU_LATENCY_DEVICE, "rb") as device:
        return int.from_bytes(device.read(4), sys.byteorder, signed=True)


@pytest.mark.root("the PM QoS device is root's")
@pytest.mark.skipif(not ownprocess.CPU_LATENCY_DEVICE.exists(), reason="no /dev/cpu_dma_latency")
def test_the_cpus_are_kept_quick_to_wake_while_criu_dumps_and_let_be_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "criu"
    # a stand-in for criu that notes the CPU latency the kernel allows while it runs
    fake.write_text(
        FAKE_CRIU.replace(
            'echo x >> "$dir/../attempts"',
            f'echo x >> "$dir/../attempts"\nod -An -t d4 {ownprocess.CPU_LATENCY_DEVICE} > "$dir/../seen"',
        )
    )
    fake.chmod(0o755)
    monkeypatch.setenv("ERROR", "")
    monkeypatch.setenv("FAILS", "0")
    for hold in (True, False):
        # the latency is the machine's: a dump or restore of another test (another worker) may hold a
        # request of its own meanwhile, and then this one cannot tell; it tries again once none does
        for _ in range(60):
            _wait_until_no_other_holds()
            before = _cpu_latency_us()
            assert before > 0
            images = tmp_path / "images"
            images.mkdir()
            checkpointing.dump(
                criu.Criu(fake),
                os.getpid(),
                images,
                tmp_path / "dump.log",
                leave_running=True,
                hold_cpu_wakeups=hold,
            )
            seen, after = int((tmp_path / "seen").read_text()), _cpu_latency_us()
            shutil.rmtree(images)
            if not _another_holds():
                break
        assert seen == (0 if hold else before), hold
        assert after == before  # the request ended with the dump


def test_holding_the_cpus_quick_to_wake_takes_only_the_kernels_device(tmp_path: Path) -> None:
    with ownprocess.cpu_wakeups_held(device=tmp_path / "missing") as made:
        assert not made
    planted = tmp_path / "planted"
    planted.write_bytes(b"keep")
    with ownprocess.cpu_wakeups_held(device=planted) as made:
        assert not made
    assert planted.read_bytes() == b"keep"  # a regular file put in its place is not written
    link = tmp_path / "link"
    link.symlink_to(planted)
    with ownprocess.cpu_wakeups_held(device=link) as made:
        assert not made
    assert planted.read_bytes() == b"keep"


# -- the demo's waiting -------------------------------------------------------------------------------


class _EndingEngine:
    """An engine whose job has just exited: every status says EXITED."""

    class records:  # stands in for Engine.records
        @staticmethod
        def jobs() -> list[object]:
            return []

    def status(self, name: str) -> object:
        return SimpleNamespace(job=SimpleNamespace(state=JobState.EXITED))

    def log_path(self, name: str) -> Path:
        return Path("/nonexistent")


def test_the_demo_counts_a_wait_done_just_before_the_job_exited() -> None:
    from torpor.apps.demo import Demo
    from torpor.errors import DemoFailed

    demo = Demo(_EndingEngine(), steps=10, pace=0.0, data_mib=1)  # type: ignore[arg-type]
    calls: list[int] = []  # not done at the first look; the job ends (done) before status() is read

    def done() -> bool:
        calls.append(1)
        return len(calls) > 1

    demo.wait(done, "the job to finish", timeout=5)

    with pytest.raises(DemoFailed, match="exited while waiting for step 3"):
        demo.wait(lambda: False, "step 3", timeout=5)
