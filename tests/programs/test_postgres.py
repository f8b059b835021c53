"""PostgreSQL under torpor, as a user runs it: Debian's server on a fresh cluster, started as a job that
runs as the ``postgres`` user, driven by pgbench and psql over TCP from outside the job.

Covered: a checkpoint and a hibernation while pgbench runs lose no transaction and fail none (pgbench's
connections, from outside the job, stay open through both: CRIU dumps them with ``--tcp-established``
and holds them with an nftables rule while the job is frozen or hibernated); the tables stay consistent
(every account, teller and branch balance adds up to the history, one history row per transaction
pgbench counted) and unchanged across an idle hibernation; a psql session in an open transaction
continues it after both and commits; the server then shuts down cleanly. PostgreSQL attaches a SysV
shared-memory segment, so this needs the job's own IPC namespace. With dynamic_shared_memory_type=sysv all
of its shared memory is in the image (none in /dev/shm), parallel workers included.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Torpor, free_port

pytestmark = [
    pytest.mark.criu,
    pytest.mark.slow,
    pytest.mark.root("runs PostgreSQL as the postgres user"),
    pytest.mark.timeout(150),
    # one initdb per run: make suite runs these on one worker (the session fixture is per worker)
    pytest.mark.xdist_group("postgres"),
]

USER = "postgres"


def postgres_bin() -> Path | None:
    """The newest installed server's folder (scripts/install-programs.sh installs Debian's)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def missing_programs() -> str | None:
    if postgres_bin() is None or not all(shutil.which(tool) for tool in ("psql", "pgbench", "runuser")):
        return "PostgreSQL, psql, pgbench or runuser is not installed (scripts/install-programs.sh installs them)"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"there is no {USER!r} user (Debian's postgresql package creates it)"
    return None


def other_user_blocker(torpor: Torpor) -> str | None:
    """Why a job with processes of another user cannot be checkpointed here; None if it can.

    Where root lacks CAP_SYS_RESOURCE, CRIU may not read another user's resource limits unless torpor's
    rlimit shim is preloaded into it (``make setup`` builds it); ``torpor doctor`` finds out with a real
    dump of a process of ``nobody``'s. Anywhere else the test runs, and a failing dump fails it.
    """
    other = torpor.json("doctor")["other_users"]
    if other["cap_sys_resource"] is False and not other["checkpoint_ok"]:
        return f"{other['problem']} ({'; '.join(other['details'])})"
    return None


def mapped_from_dev_shm(job_pid: int) -> set[str]:
    """The files in /dev/shm that the processes of the job (its PID namespace) have mapped."""
    namespace = os.readlink(f"/proc/{job_pid}/ns/pid")
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns" / "pid") == namespace:
                found |= {
                    line.split()[-1]
                    for line in (proc / "maps").read_text().splitlines()
                    if " /dev/shm/" in line
                }
        except OSError:  # gone meanwhile
            continue
    return found


@dataclass
class Cluster:
    """A fresh cluster in its own folder (the postgres user's), reached on 127.0.0.1:port."""

    folder: Path
    port: int
    bin: Path
    torpor: Torpor
    job: str = "pg"

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def start(self, *settings: str) -> int:
        """Start the server as a torpor job (``settings``: ``-c name=value`` options); returns its pid.

        runuser stays the job's first process, as root: CRIU asks the first process of a PID namespace
        for a /proc of that namespace, which only a privileged one can mount; postgres refuses root.
        """
        self.torpor.run(
            "run", "--name", self.job, "--", "runuser", "-u", USER, "--",
            str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.folder),
            "-p", str(self.port), "-h", "127.0.0.1", *settings,
        )  # fmt: skip
        self.torpor.wait_log(self.job, "database system is ready to accept connections", timeout=30)
        return int(self.torpor.job(self.job)["pid"])

    def shut_down(self) -> None:
        """Fast shutdown, as docs/postgres.md says: SIGINT to the server, the child of the job's runuser
        (``torpor stop`` would SIGTERM runuser, which SIGKILLs the server 2 s later, done or not)."""
        runuser = int(self.torpor.job(self.job)["pid"])
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if (
                    proc.name.isdigit()
                    and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == runuser
                ):
                    os.kill(int(proc.name), signal.SIGINT)
        job = self.torpor.wait_state(self.job, "exited", "failed", timeout=30)
        assert job["exit_code"] == 0, self.torpor.log(self.job)

    def client(self, program: str, *args: str) -> list[str]:
        return [program, "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, *args]

    def sql(self, query: str) -> str:
        out = subprocess.run(
            self.client("psql", "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", "postgres", "-c", query),
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return out.stdout.strip()

    def totals(self) -> tuple[int, ...]:
        """History rows, and the sums of history deltas, account, teller and branch balances."""
        row = self.sql(
            "select (select count(*) from pgbench_history), (select coalesce(sum(delta), 0) from pgbench_history),"
            " (select sum(abalance) from pgbench_accounts), (select sum(tbalance) from pgbench_tellers),"
            " (select sum(bbalance) from pgbench_branches)"
        )
        return tuple(int(v) for v in row.split("|"))


def postgres_folder(prefix: str) -> Path:
    """A new folder of the postgres user's: not under pytest's tmp_path, which it cannot enter."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    shutil.chown(folder, USER, USER)
    return folder


@pytest.fixture(scope="session")
def initialized() -> Iterator[Path]:
    """A data folder initdb made, once per run: each test's cluster starts from a copy of it."""
    if (why := missing_programs()) is not None:
        pytest.skip(why)
    bin_dir = postgres_bin()
    assert bin_dir is not None
    folder = postgres_folder("torpor-pg-initdb-")
    try:
        subprocess.run(
            ["runuser", "-u", USER, "--", str(bin_dir / "initdb"), "-D", str(folder / "data"), "-A", "trust",
             "-U", USER, "--no-sync", "-E", "UTF8", "--locale", "C"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        yield folder / "data"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def cluster(torpor: Torpor, initialized: Path) -> Iterator[Cluster]:
    if (why := other_user_blocker(torpor)) is not None:
        pytest.skip(why)
    bin_dir = postgres_bin()
    assert bin_dir is not None
    folder = postgres_folder("torpor-pg-")
    try:
        subprocess.run(["cp", "-a", str(initialized), str(folder / "data")], check=True, timeout=60)
        made = Cluster(folder, free_port(), bin_dir, torpor)
        yield made
        if any(job["name"] == made.job and job["state"] == "running" for job in torpor.json("ps")):
            made.shut_down()  # a clean shutdown: PostgreSQL removes its files in /dev/shm
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Session:
    """psql over TCP, fed one statement at a time: the open transaction a user would leave open."""

    def __init__(self, cluster: Cluster) -> None:
        self.psql = subprocess.Popen(
            cluster.client("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", "postgres"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip

    def ask(self, statements: str) -> str:
        """Run ``statements``, the last of which prints one row; returns that row."""
        assert self.psql.stdin and self.psql.stdout
        self.psql.stdin.write(statements + "\n")
        self.psql.stdin.flush()
        return self.psql.stdout.readline().strip()

    def close(self) -> int:
        assert self.psql.stdin
        with contextlib.suppress(BrokenPipeError):
            self.psql.stdin.close()
        try:
            return self.psql.wait(timeout=10)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.psql.poll() is None:
            self.psql.kill()
            self.psql.wait()
        assert self.psql.stdout
        self.psql.stdout.close()


def pgbench_numbers(report: str) -> tuple[int, int]:
    """(transactions processed, failed transactions) from pgbench's report."""
    processed = re.search(r"^number of transactions actually processed: (\d+)", report, re.M)
    failed = re.search(r"^number of failed transactions: (\d+)", report, re.M)
    assert processed and failed, report
    return int(processed.group(1)), int(failed.group(1))


def test_postgres_through_checkpoint_and_hibernation_under_pgbench(torpor: Torpor, cluster: Cluster) -> None:
    pid = cluster.start()
    # Debian's default dynamic_shared_memory_type=posix: a file in /dev/shm, not in the image; a resume
    # finds it still there on this machine (a hibernated server was killed, it could not remove it)
    outside = mapped_from_dev_shm(pid)
    assert outside, "PostgreSQL mapped no file of /dev/shm"
    subprocess.run(
        cluster.client("pgbench", "-i", "-s", "1", "-q", "postgres"),
        capture_output=True,
        timeout=60,
        check=True,
    )
    session = Session(cluster)
    bench: subprocess.Popen[str] | None = None
    try:
        opened = session.ask(
            "create table notes(said text); begin; insert into notes values ('before');"
            " select txid_current(), pg_backend_pid();"
        )
        assert re.fullmatch(r"\d+\|\d+", opened), opened

        bench = subprocess.Popen(
            cluster.client("pgbench", "-c", "2", "-T", "10", "postgres"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        torpor.wait_for(lambda: cluster.totals()[0] > 50, timeout=20, what="pgbench to commit transactions")
        torpor.run("checkpoint", "pg")  # pgbench's connections come from outside the job: kept open
        moved_on = cluster.totals()[0]
        torpor.wait_for(
            lambda: cluster.totals()[0] > moved_on + 50, timeout=20, what="pgbench after the checkpoint"
        )
        torpor.run("hibernate", "pg")
        assert torpor.job("pg")["state"] == "hibernated"
        assert bench.poll() is None and session.psql.poll() is None  # the clients wait for the server
        torpor.run("resume", "pg")
        report, _ = bench.communicate(timeout=60)
        assert bench.returncode == 0, report
        processed, failed = pgbench_numbers(report)
        assert failed == 0, report
        after_bench = cluster.totals()
        # one history row per transaction pgbench counted, and every balance adds up to the history
        assert after_bench[0] == processed > moved_on, (after_bench, report)
        assert after_bench[1] == after_bench[2] == after_bench[3] == after_bench[4], after_bench

        torpor.run("hibernate", "pg")
        torpor.run("resume", "pg")
        assert cluster.totals() == after_bench

        # the session is still in the transaction it opened before the checkpoint, served by the same
        # backend: it sees its own uncommitted row and the same transaction id, then commits it
        assert session.ask("select count(*), txid_current(), pg_backend_pid() from notes;") == f"1|{opened}"
        assert cluster.sql("select count(*) from notes") == "0"  # not committed yet
        assert session.ask("insert into notes values ('after'); commit; select count(*) from notes;") == "2"
        assert cluster.sql("select string_agg(said, ',' order by said) from notes") == "after,before"
        assert session.close() == 0
        log = torpor.log("pg")
        assert not re.search(r"\b(FATAL|PANIC)\b|terminated by signal", log), log
        cluster.shut_down()
        assert "database system is shut down" in torpor.log("pg")
        assert not any(Path(name).exists() for name in outside)
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait()
        session.kill()


def test_postgres_with_sysv_dynamic_shared_memory_keeps_all_of_it_in_the_image(
    torpor: Torpor, cluster: Cluster
) -> None:
    """dynamic_shared_memory_type=sysv: every segment in the job's IPC namespace, none in /dev/shm, so a
    resume depends on no file outside the image (after a reboot, on another machine); parallel workers,
    which attach such segments, still run after it."""
    pid = cluster.start("-c", "dynamic_shared_memory_type=sysv")
    assert mapped_from_dev_shm(pid) == set()
    segments = subprocess.run(
        ["nsenter", "-t", str(pid), "-i", "cat", "/proc/sysvipc/shm"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[1:]
    assert len(segments) >= 2, segments  # the interlock segment and the dynamic shared memory control one
    cluster.sql("create table numbers as select generate_series(1, 300000) as n")
    parallel = (
        "set parallel_setup_cost = 0; set parallel_tuple_cost = 0; set min_parallel_table_scan_size = 0;"
        " set max_parallel_workers_per_gather = 2; explain (analyze, costs off) select sum(n) from numbers"
    )
    assert "Workers Launched: 2" in cluster.sql(parallel)
    torpor.run("hibernate", "pg")
    torpor.run("resume", "pg")
    assert mapped_from_dev_shm(int(torpor.job("pg")["pid"])) == set()
    assert "Workers Launched: 2" in cluster.sql(parallel)
    assert cluster.sql("select count(*), sum(n) from numbers") == f"300000|{300000 * 300001 // 2}"
