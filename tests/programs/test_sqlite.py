"""sqlite3 (Debian's CLI) as a torpor job, fed SQL through a fifo, with real CRIU.

What it covers: a session survives checkpoint, hibernate and resume with its data right; a database
someone else wrote while the job was hibernated is not cut back silently (the resume is refused, naming
the file, nothing changed, the job still hibernated); a journal deleted meanwhile is refused even with
``--rewind``; and when ``criu restore`` fails after torpor cut a file (``--rewind``), the file is put back
byte for byte, times included, and a second attempt stores no second copy of the cut bytes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Torpor

pytestmark = [
    pytest.mark.criu,
    pytest.mark.root("to run the job in its own PID namespace under CRIU"),
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("sqlite3") is None, reason="needs the sqlite3 CLI (make setup)"),
]


@dataclass
class Sqlite:
    """A sqlite3 job reading SQL from ``fifo``; ``send`` writes to it."""

    torpor: Torpor
    name: str
    db: Path
    fd: int

    def send(self, sql: str) -> None:
        os.write(self.fd, (sql.strip() + "\n").encode())

    def ask(self, sql: str, expect: str) -> None:
        """Run ``sql`` in the job's session and wait for ``expect`` in its output."""
        self.send(sql)
        self.torpor.wait_log(self.name, expect, timeout=30)

    def outside(self, sql: str) -> str:
        """Run ``sql`` from another sqlite3 process, as another writer of the database would."""
        return subprocess.run(
            ["sqlite3", str(self.db), sql], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()


@pytest.fixture
def sqlite(torpor: Torpor, tmp_path: Path) -> Iterator[Callable[..., Sqlite]]:
    fds: list[int] = []

    def start(name: str, hold: Path | None = None) -> Sqlite:
        db, fifo = tmp_path / "db.sqlite", tmp_path / "sql.fifo"
        os.mkfifo(fifo)
        # a file the job holds open read-only: CRIU checks its size on restore, so growing it makes
        # ``criu restore`` fail for sure, after torpor prepared the job's files
        held = f"exec 7< {hold}; " if hold else ""
        torpor.run("run", "--name", name, "--", "sh", "-c", f"{held}exec sqlite3 {db} < {fifo}")
        deadline = time.monotonic() + 30
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:  # ENXIO: the job has not opened it yet
                if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        os.set_blocking(fd, True)
        fds.append(fd)
        return Sqlite(torpor, name, db, fd)

    yield start
    for fd in fds:
        os.close(fd)


def digest(path: Path) -> tuple[int, int, str]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


FILL = "insert into t(x, pad) select i, randomblob(500) from (with recursive c(i) as (select 1 union all select i + 1 from c where i < {n}) select i from c);"


def test_a_session_survives_checkpoint_hibernate_and_resume(
    torpor: Torpor, sqlite: Callable[..., Sqlite]
) -> None:
    job = sqlite("sq-ok")
    job.ask("create table t(x, pad); " + FILL.format(n=50) + " select 'a', count(*) from t;", "a|50")
    torpor.run("checkpoint", "sq-ok")
    job.ask(FILL.format(n=30) + " select 'b', count(*) from t;", "b|80")
    torpor.run("hibernate", "sq-ok")
    result = torpor.run("resume", "sq-ok")
    assert "rewound" not in result.stderr  # hibernated: nothing of its files changed
    job.ask("insert into t(x) values (1000); select 'c', count(*), sum(x) from t;", "c|81|2740")
    assert job.outside("pragma integrity_check") == "ok"
    assert job.outside("select count(*), sum(x) from t") == "81|2740"
    assert torpor.job("sq-ok")["state"] == "running"


def test_a_database_written_while_hibernated_is_not_cut_and_the_resume_says_why(
    torpor: Torpor, sqlite: Callable[..., Sqlite]
) -> None:
    """The issue's steps: a transaction open at the hibernation, another writer meanwhile."""
    job = sqlite("sq-tx")
    job.ask(
        "create table t(x, pad); " + FILL.format(n=50) + " begin; insert into t(x) values (-1);"
        " select 'in', count(*) from t;",
        "in|51",
    )
    journal = job.db.with_name(job.db.name + "-journal")
    assert journal.exists()
    torpor.run("hibernate", "sq-tx")
    # the job's locks went with it: another writer rolls its hot journal back (deleting it) and writes
    job.outside(FILL.format(n=40))
    assert not journal.exists()
    before = digest(job.db)

    result = torpor.run("resume", "sq-tx", check=False)
    assert result.returncode == 2, result.stderr
    (first,) = [line for line in result.stderr.splitlines() if line.startswith("torpor: error:")]
    assert str(job.db) in first and "size" in first and "nothing was changed" in first, result.stderr
    assert f"{journal}: deleted since the job stopped" in result.stderr
    assert digest(job.db) == before and job.outside("pragma integrity_check") == "ok"
    assert torpor.job("sq-tx")["state"] == "hibernated"

    # --rewind cannot bring the deleted journal back (the open transaction lived in it): still refused
    result = torpor.run("resume", "--rewind", "sq-tx", check=False)
    assert result.returncode == 2 and "deleted since the job stopped" in result.stderr, result.stderr
    assert "put them back" in result.stderr
    assert digest(job.db) == before and job.outside("pragma integrity_check") == "ok"
    assert job.outside("select count(*) from t") == "90"
    assert torpor.job("sq-tx")["state"] == "hibernated"
    assert not any(p.is_file() for p in (torpor.home / "jobs" / "sq-tx").rglob("rewound/**/*"))


def test_a_failed_criu_restore_puts_back_what_rewind_cut(
    torpor: Torpor, sqlite: Callable[..., Sqlite], tmp_path: Path
) -> None:
    held = tmp_path / "settings.txt"
    held.write_text("threads=4\n")
    job = sqlite("sq-undo", hold=held)
    job.ask("create table t(x, pad); " + FILL.format(n=20) + " select 'a', count(*) from t;", "a|20")
    torpor.run("hibernate", "sq-undo")
    job.outside(FILL.format(n=60))  # the database grows: --rewind would cut it back
    held.write_text("threads=8, changed\n")  # and CRIU will refuse this one ("bad size")
    before = digest(job.db)
    rewound = torpor.home / "jobs" / "sq-undo" / "rewound"

    result = torpor.run("resume", "sq-undo", check=False)
    assert result.returncode == 2 and str(job.db) in result.stderr and digest(job.db) == before

    for _attempt in range(2):
        result = torpor.run("resume", "--rewind", "sq-undo", check=False)
        assert result.returncode == 5, result.stderr
        assert "rewound 1 file" in result.stderr and "bad size" in result.stderr, result.stderr
        assert "the 1 file(s) torpor had cut are back as they were" in result.stderr, result.stderr
        assert digest(job.db) == before, "the database is not what it was before the resume"
        assert job.outside("pragma integrity_check") == "ok"
        assert torpor.job("sq-undo")["state"] == "hibernated"
        assert not [p for p in rewound.rglob("*") if p.is_file()], "the bytes put back are still saved"
