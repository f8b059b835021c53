"""PostgreSQL under torpor, as a user runs it: Debian's server on a fresh cluster, started as a job that
runs as the ``postgres`` user, driven by pgbench and psql over TCP from outside the job.

Covered: a checkpoint and a hibernation while pgbench runs lose no transaction and fail none (pgbench's
connections, from outside the job, stay open through both: CRIU dumps them with ``--tcp-established``
and holds them with an nftables rule while the job is frozen or hibernated); the tables stay consistent
(every account, teller and branch balance adds up to the history, one history row per transaction
pgbench counted) and unchanged across an idle hibernation; a psql session in an open transaction
continues it after both and commits. PostgreSQL attaches a SysV shared-memory segment, so this needs the
job's own IPC namespace.
"""

from __future__ import annotations

import contextlib
import pwd
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Torpor

pytestmark = [
    pytest.mark.criu,
    pytest.mark.slow,
    pytest.mark.root("runs PostgreSQL as the postgres user"),
    pytest.mark.timeout(150),
]

USER = "postgres"


def postgres_bin() -> Path | None:
    """The newest installed server's folder (scripts/install-programs.sh installs Debian's)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def missing_programs() -> str | None:
    if postgres_bin() is None or not shutil.which("psql") or not shutil.which("runuser"):
        return "PostgreSQL, psql or runuser is not installed (scripts/install-programs.sh installs them)"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"there is no {USER!r} user (Debian's postgresql package creates it)"
    return None


def other_user_blocker() -> str | None:
    """Why CRIU cannot dump a process owned by another user here, probed the way CRIU reads it; else None.

    CRIU reads every process's rlimits with prlimit(2), which needs CAP_SYS_RESOURCE for another user's
    process (some containers leave root without it).
    """
    probe = subprocess.Popen(
        ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "sleep", "30"]
    )
    try:
        deadline = time.monotonic() + 5
        while Path(f"/proc/{probe.pid}/status").read_text().find(f"Uid:\t{pwd.getpwnam(USER).pw_uid}") < 0:
            if time.monotonic() > deadline:
                return "could not start a process as the postgres user to probe"
            time.sleep(0.01)
        try:
            resource.prlimit(probe.pid, resource.RLIMIT_NOFILE)
        except PermissionError:
            return (
                "root lacks CAP_SYS_RESOURCE here, so CRIU cannot read the rlimits of a process owned by "
                "another user ('Can't get rlimit 0: Operation not permitted'): PostgreSQL cannot be dumped"
            )
        return None
    finally:
        probe.kill()
        probe.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    """A fresh cluster in its own folder (the postgres user's), reached on 127.0.0.1:port."""

    folder: Path
    port: int
    bin: Path

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def server_command(self) -> list[str]:
        # runuser stays the job's root (PID 1, root): CRIU asks the root of a PID namespace for a /proc
        # of that namespace, and only a privileged one can mount it; postgres itself refuses to run as root
        return [
            "runuser", "-u", USER, "--",
            str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.folder),
            "-p", str(self.port), "-h", "127.0.0.1",
        ]  # fmt: skip

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


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    if (why := missing_programs()) is not None:
        pytest.skip(why)
    if (why := other_user_blocker()) is not None:
        pytest.skip(why)
    bin_dir = postgres_bin()
    assert bin_dir is not None
    # not under pytest's tmp_path: the postgres user cannot enter root's private folders
    folder = Path(tempfile.mkdtemp(prefix="torpor-pg-", dir="/tmp"))
    try:
        shutil.chown(folder, USER, USER)
        subprocess.run(
            ["runuser", "-u", USER, "--", str(bin_dir / "initdb"), "-D", str(folder / "data"), "-A", "trust",
             "-U", USER, "--no-sync", "-E", "UTF8", "--locale", "C"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        yield Cluster(folder, free_port(), bin_dir)
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
    torpor.run("run", "--name", "pg", "--", *cluster.server_command())
    torpor.wait_log("pg", "database system is ready to accept connections", timeout=30)
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

        # the session is still in the transaction it opened before the checkpoint: it sees its own
        # uncommitted row and the same transaction id, then commits it
        assert session.ask("select count(*), txid_current() from notes;") == f"1|{opened.split('|')[0]}"
        assert cluster.sql("select count(*) from notes") == "0"  # not committed yet
        assert session.ask("insert into notes values ('after'); commit; select count(*) from notes;") == "2"
        assert cluster.sql("select string_agg(said, ',' order by said) from notes") == "after,before"
        assert session.close() == 0
        log = torpor.log("pg")
        assert not re.search(r"\b(FATAL|PANIC)\b|terminated by signal", log), log
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
            bench.wait()
        session.kill()
