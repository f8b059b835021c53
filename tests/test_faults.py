"""Bad input and faults: each gives a one-line error and a non-zero exit status, loses nothing, and never
leaves the job frozen (DESIGN.md invariants 1, 3 and 5).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import TORPOR, MountTmpfs, OutsideUnixServer, Torpor, python_job
from torpor.adapters import criulog
from torpor.adapters.system import procfs
from torpor.core import checkpoint
from torpor.errors import CheckpointFailed, StorageFull

pytestmark = pytest.mark.timeout(180)


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("torpor: error: ")]
    assert len(errors) == 1 and text in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def assert_running_not_frozen(torpor: Torpor, name: str) -> None:
    job = torpor.job(name)
    assert job["state"] == "running", job
    pids = procfs.namespace_members(job["pid"])
    assert pids and all(procfs.process_state(pid) not in ("T", "t") for pid in pids)
    before = torpor.log(name).count("\n")
    torpor.wait_for(lambda: torpor.log(name).count("\n") > before + 2, what=f"{name} to make progress")


def test_unknown_job(torpor: Torpor) -> None:
    for command in (
        ["checkpoint", "nope"],
        ["resume", "nope"],
        ["logs", "nope"],
        ["rm", "nope"],
        ["stop", "nope"],
    ):
        assert_one_line_error(torpor.run(*command, check=False), 2, "no job named 'nope'")


def test_bad_names_and_commands(torpor: Torpor) -> None:
    assert_one_line_error(torpor.run("run", "--name", "../x", "--", "true", check=False), 2, "bad job name")
    assert_one_line_error(torpor.run("run", "--", "no-such-program-xyz", check=False), 2, "command not found")
    assert_one_line_error(torpor.run("run", check=False), 2, "no command given")
    assert_one_line_error(torpor.run("run", "--name", "", "--", "true", check=False), 2, "bad job name ''")
    assert torpor.json("ps") == []


@pytest.mark.criu
def test_wrong_states(torpor: Torpor) -> None:
    torpor.run("run", "--name", "w", *python_job("counter.py"))
    torpor.wait_log("w", "step 2")
    assert_one_line_error(torpor.run("resume", "w", check=False), 2, "no checkpoint")
    torpor.run("checkpoint", "w")
    assert_one_line_error(torpor.run("resume", "w", check=False), 2, "is running")
    assert_one_line_error(torpor.run("rm", "w", check=False), 2, "is running")
    assert_one_line_error(torpor.run("restore", "w", "--from", "zzz", check=False), 2, "no checkpoint 'zzz'")
    torpor.run("hibernate", "w")
    assert_one_line_error(torpor.run("checkpoint", "w", check=False), 2, "it is hibernated")
    assert_one_line_error(torpor.run("hibernate", "w", check=False), 2, "it is hibernated")
    assert_one_line_error(torpor.run("stop", "w", check=False), 2, "not running")
    # a duplicate name is refused and the existing job is untouched
    assert_one_line_error(torpor.run("run", "--name", "w", "--", "true", check=False), 2, "already exists")
    assert torpor.job("w")["state"] == "hibernated"


@pytest.mark.criu
def test_two_resumes_at_once_one_wins(torpor: Torpor) -> None:
    torpor.run("run", "--name", "r", *python_job("counter.py"))
    torpor.wait_log("r", "step 2")
    torpor.run("hibernate", "r")
    procs = [
        subprocess.Popen(
            [TORPOR, "resume", "r"], env=torpor.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [(p.communicate(timeout=60)[1], p.returncode) for p in procs]
    codes = sorted(code for _, code in results)
    assert codes == [0, 2], results
    assert torpor.job("r")["state"] == "running"


def test_criu_missing_or_too_old(torpor: Torpor, tmp_path: Path) -> None:
    env = {**torpor.env, "TORPOR_CRIU": str(tmp_path / "no-criu")}
    missing = Torpor(torpor.home, env).run("doctor", check=False)
    assert (
        missing.returncode == 3 and "no-criu" in missing.stdout and "cannot checkpoint here" in missing.stdout
    )
    old = tmp_path / "old-criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17'\n")
    old.chmod(0o755)
    too_old = Torpor(torpor.home, {**torpor.env, "TORPOR_CRIU": str(old)})
    result = too_old.run("doctor", "--json", check=False)
    assert result.returncode == 3 and "too old" in result.stdout


@pytest.mark.criu
def test_checkpoint_refused_when_criu_too_old_or_missing_leaves_job_running(
    torpor: Torpor, tmp_path: Path
) -> None:
    torpor.run("run", "--name", "old", *python_job("counter.py"))
    torpor.wait_log("old", "step 2")
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 4.1.1'\n")
    fake.chmod(0o755)
    result = Torpor(torpor.home, {**torpor.env, "TORPOR_CRIU": str(fake)}).run(
        "checkpoint", "old", check=False
    )
    assert_one_line_error(result, 3, "too old")
    missing = {**torpor.env, "TORPOR_CRIU": str(tmp_path / "none")}
    result = Torpor(torpor.home, missing).run("hibernate", "old", check=False)
    assert_one_line_error(result, 3, "run 'make setup'")
    assert_running_not_frozen(torpor, "old")


@pytest.mark.root("mounting a tmpfs")
def test_state_directory_not_writable(torpor: Torpor, tmpfs: MountTmpfs) -> None:
    readonly = tmpfs("ro", "ro,size=1m")
    home = Torpor(readonly / "home", {**torpor.env, "TORPOR_HOME": str(readonly / "home")})
    assert_one_line_error(home.run("ps", check=False), 3, "set TORPOR_HOME")
    assert_one_line_error(home.run("run", "--", "true", check=False), 3, "set TORPOR_HOME")


@pytest.mark.criu
def test_disk_full_while_dumping(torpor: Torpor, tmpfs: MountTmpfs) -> None:
    small = tmpfs("small", "size=24m")
    # both tiers on the small file system: the RAM tier that CRIU dumps into and the durable one
    env = {**torpor.env, "TORPOR_HOME": str(small / "home"), "TORPOR_HOT_DIR": str(small / "hot")}
    full = Torpor(small / "home", env)
    full.run("run", "--name", "big", *python_job("memory_hog.py", "64"))
    full.wait_log("big", "step 1")
    try:
        result = full.run("checkpoint", "big", check=False)
        assert_one_line_error(result, 6, "no space left")
        assert_running_not_frozen(full, "big")
        assert full.json("checkpoints") == []
        leftovers = [p for p in small.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]
        assert [p for p in leftovers if p.suffix != ".log"] == [], "a partial image was left behind"
        result = full.run("hibernate", "big", check=False)
        assert_one_line_error(result, 6, "no space left")
        assert_running_not_frozen(full, "big")
    finally:
        full.run("rm", "--force", "big", check=False)


@pytest.mark.root("mounting a tmpfs")
def test_a_dump_failing_on_a_full_disk_whose_log_was_cut_is_no_space_left(tmpfs: MountTmpfs) -> None:
    # CRIU writes its log on the same file system: when it fills, the log may stop before saying why
    small = tmpfs("cut", "size=2m")
    images = small / "images"
    images.mkdir()
    log = small / "dump.log"
    log.write_text("(00.448695) Error (criu/page-xfer.c:263):")
    with (small / "filler").open("wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"x" * 65536)
        except OSError:
            pass
    error = criulog.dump_failure(os.getpid(), images, log, 1, "")
    assert isinstance(error, StorageFull) and "no space left" in str(error), error
    (small / "filler").unlink()
    error = criulog.dump_failure(os.getpid(), images, log, 1, "")
    assert isinstance(error, CheckpointFailed) and "criu dump failed" in str(error), error


@pytest.mark.criu
def test_dump_failure_leaves_job_running_and_shows_criu_log(torpor: Torpor, tmp_path: Path) -> None:
    path = str(tmp_path / "outside.sock")
    with OutsideUnixServer(path):
        try:
            torpor.run("run", "--name", "ext", *python_job("external_unix.py", path))
            torpor.wait_log("ext", "step 2")
            for verb in ("checkpoint", "hibernate"):
                result = torpor.run(verb, "ext", check=False)
                # in torpor's words: which socket, which process outside the job (this one), what to do
                assert_one_line_error(
                    result, 4, f"the job is connected to the unix socket {path} of pid {os.getpid()}"
                )
                assert "or checkpoint or hibernate with --ext-unix-sk" in result.stderr
                assert "External socket is used" in result.stderr  # the CRIU log lines that explain it
                assert "the job is still running" in result.stderr
                assert_running_not_frozen(torpor, "ext")
            assert torpor.json("checkpoints") == []
        finally:
            torpor.run("rm", "--force", "ext", check=False)


@pytest.mark.criu
@pytest.mark.root("giving a folder to another user")
def test_a_dump_that_meets_another_in_the_jobs_folder_is_made_again_a_dead_criu_s_is_removed_one_put_there_named(
    torpor: Torpor, tmp_path: Path
) -> None:
    """CRIU's parasite creates ``proc.crtools`` in the job's working directory for a moment (to mount a
    /proc of the job's PID namespace there): a dump of another job of that folder at the same moment
    fails, and is made again; a folder that stays there fails every attempt, in words that say so."""
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [TORPOR, "run", "--name", "w", *python_job("counter.py")],
        cwd=work,
        env=torpor.env,
        check=True,
        capture_output=True,
    )
    torpor.wait_log("w", "step 2")
    pid = torpor.job("w")["pid"]
    planted = work / "proc.crtools"
    criu_ = torpor.engine().ctx.criu
    tried: list[bool] = []

    class Spy(type(criu_)):  # type: ignore[misc]
        def dump(self, *args: Any, **options: Any) -> Any:
            first = not tried
            tried.append(first)
            if first:  # another dump's folder, there during the first attempt only
                planted.mkdir()
            try:
                return super().dump(*args, **options)
            finally:
                if first:
                    planted.rmdir()

    spy = Spy.__new__(Spy)
    spy.__dict__.update(criu_.__dict__)
    images = tmp_path / "images"
    images.mkdir()
    stats = checkpoint.dump(spy, pid, images, tmp_path / "dump.log", leave_running=True)
    assert tried == [True, False] and stats is not None
    assert list(images.glob("pages-*.img"))

    # one of another user's stays: it was put there, and fails every attempt, in words that say so
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    result = torpor.run("checkpoint", "w", check=False)
    assert_one_line_error(
        result,
        4,
        f"CRIU could not create its folder proc.crtools in the working directory of the job's first process ({work})",
    )
    assert planted.is_dir()
    assert_running_not_frozen(torpor, "w")
    # one of root's made just now that stays is a CRIU's killed a moment ago: waited out, then removed
    os.chown(planted, 0, 0)
    torpor.run("checkpoint", "w")
    assert not planted.exists()
    assert_running_not_frozen(torpor, "w")
    planted.mkdir()
    old = time.time() - 60
    # an old one of root's is a CRIU's killed mid-dump: removed, and the checkpoint is made
    os.chown(planted, 0, 0)
    os.utime(planted, (old, old))
    torpor.run("checkpoint", "w")
    assert not planted.exists()
    torpor.run("rm", "--force", "w")


@pytest.mark.criu
@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dump", "pre-copy"])
def test_job_killed_during_its_checkpoint(torpor: Torpor, stage: str) -> None:
    """Killed in CRIU's dump (not pre-copied: the dump begins at once), or after the first of its
    pre-copy rounds (in a later round, or in the dump that follows them): a one-line error, the job
    failed with its signal, no checkpoint."""
    torpor.env["TORPOR_PRECOPY"] = "1" if stage == "pre-copy" else "0"
    torpor.run("run", "--name", "dies", *python_job("memory_hog.py", "1500"))
    torpor.wait_log("dies", "step 1", timeout=120)
    pid = torpor.job("dies")["pid"]
    proc = subprocess.Popen(
        [TORPOR, "checkpoint", "dies"],
        env=torpor.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    assert "dumping" in proc.stderr.readline()
    if stage == "dump":
        # kill it while the dump is really in progress: CRIU traces the job from its seize to the end of
        # the dump (while its parasite runs in the job the state is S or R, not t: only the tracer says so)
        torpor.wait_for(lambda: traced(pid), timeout=60, what="the dump to seize the job")
    else:
        line = proc.stderr.readline()
        if "pre-copy round" not in line:
            os.kill(pid, signal.SIGKILL)
            proc.communicate(timeout=120)
            pytest.skip(f"not pre-copied on this machine: {line.strip()}")
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 4, stderr
    said = [line for line in stderr.splitlines() if not line.startswith("  … ")]  # progress: pre-copy rounds
    assert said[0].startswith("torpor: error: ") and "Traceback" not in stderr, stderr
    job = torpor.wait_state("dies", "failed")
    assert job["exit_code"] == 128 + 9
    assert torpor.json("checkpoints") == []


def traced(pid: int) -> bool:
    """Whether a process of job ``pid``'s tree is being traced (by CRIU, during a dump)."""
    for member in procfs.namespace_members(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        if any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in status.splitlines()):
            return True
    return False


@pytest.mark.criu
def test_a_job_whose_launcher_was_killed_is_reported_and_can_be_stopped_resumed_and_removed(
    torpor: Torpor,
) -> None:
    """Its processes run on unsupervised (PID 1 of their namespace ignores a plain kill): torpor says so,
    and stop, resume --force and rm --force end them."""

    def orphan() -> int:
        job = torpor.job("o")
        os.kill(job["launcher_pid"], signal.SIGKILL)
        torpor.wait_for(lambda: not procfs.is_alive(job["launcher_pid"]), what="the launcher to die")
        return int(job["pid"])

    torpor.run("run", "--name", "o", *python_job("counter.py"))
    torpor.wait_log("o", "step 2")
    torpor.run("checkpoint", "o")
    pid = orphan()
    assert torpor.job("o")["state"] == "failed"
    assert "its launcher died; its processes still run unsupervised" in torpor.run("ps").stdout
    assert_one_line_error(torpor.run("resume", "o", check=False), 2, "running unsupervised")
    assert_one_line_error(torpor.run("checkpoint", "o", check=False), 2, "runs unsupervised")
    assert procfs.is_alive(pid)

    torpor.run("resume", "o", "--force")
    assert not procfs.is_alive(pid)
    job = torpor.job("o")
    assert job["state"] == "running" and job["restored_from"]
    assert_running_not_frozen(torpor, "o")

    pid = orphan()
    stopped = torpor.run("stop", "o", "--timeout", "0")
    assert "stopped its unsupervised processes" in stopped.stdout
    assert not procfs.is_alive(pid) and torpor.job("o")["pid"] is None

    torpor.run("resume", "o")
    pid = orphan()
    members = procfs.namespace_members(pid)
    assert_one_line_error(torpor.run("rm", "o", check=False), 2, "running unsupervised")
    torpor.run("rm", "o", "--force")
    assert not any(procfs.is_alive(member) for member in members)
    assert not list((torpor.home / "run").glob("o.sock"))


@pytest.mark.criu
def test_rm_force_leaves_no_launcher_socket(torpor: Torpor) -> None:
    """The launcher removed its socket only if its record still existed once it got there (a race)."""
    for n in range(5):
        torpor.run("run", "--name", f"s{n}", *python_job("counter.py"))
        torpor.wait_log(f"s{n}", "step 1")
        assert (torpor.home / "run" / f"s{n}.sock").exists()
        torpor.run("rm", f"s{n}", "--force")
    assert not list((torpor.home / "run").glob("*.sock"))
