"""The job lifecycle end to end with real CRIU: run, ps, logs, checkpoint, hibernate, resume, restore,
stop, rm — and the job shapes that must survive it (threads, a child, an open file, a TCP connection).
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest

from conftest import Torpor, python_job

pytestmark = [pytest.mark.criu, pytest.mark.timeout(180)]


def last_step(log: str) -> int:
    return max(int(n) for n in re.findall(r"^step (\d+)$", log, re.M))


def test_run_returns_and_ps_shows_the_job(torpor: Torpor) -> None:
    out = torpor.run("run", "--name", "count", *python_job("counter.py")).stdout
    assert "started job 'count'" in out
    torpor.wait_log("count", "step 3")
    job = torpor.job("count")
    assert job["state"] == "running"
    assert job["pid"] and job["rss_bytes"] > 1 << 20
    assert job["launcher_pid"] != os.getpid()
    table = torpor.run("ps").stdout
    assert re.search(r"^count\s+running\s+\d+\s+[\d.]+ MiB", table, re.M)


def test_the_launcher_is_forked_or_with_other_threads_a_new_interpreter(
    torpor: Torpor, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torpor.core.engine import Engine
    from torpor.settings import Settings

    torpor.run("run", "--name", "forked", "--", "sleep", "60")
    forked = Path(f"/proc/{torpor.job('forked')['launcher_pid']}")
    assert (forked / "comm").read_text().strip() == "torpor-launch"
    assert "torpor.core.launcher" not in (forked / "cmdline").read_text()

    monkeypatch.setenv("TORPOR_HOT_DIR", torpor.env["TORPOR_HOT_DIR"])
    engine = Engine(Settings.from_environment(home=str(torpor.home)))
    # a caller's signal handlers are not the launcher's (torpor slurm run catches SIGUSR1 and SIGTERM)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        engine.run("caught", ["sleep", "60"], "/")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    status = Path(f"/proc/{torpor.job('caught')['launcher_pid']}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    assert not caught & (1 << (signal.SIGUSR1 - 1))

    done = threading.Event()
    other = threading.Thread(target=done.wait)  # forking while it runs could deadlock
    other.start()
    try:
        engine.run("spawned", ["sleep", "60"], "/")
    finally:
        done.set()
        other.join()
    spawned = Path(f"/proc/{torpor.job('spawned')['launcher_pid']}")
    assert "torpor.core.launcher" in (spawned / "cmdline").read_text()
    for name in ("forked", "caught", "spawned"):
        torpor.run("stop", name)
        assert torpor.job(name)["state"] != "running"


def test_job_that_exits_is_reported_with_its_exit_code(torpor: Torpor) -> None:
    torpor.run("run", "--name", "quits", *python_job("counter.py", "7"))
    job = torpor.wait_state("quits", "exited")
    assert job["exit_code"] == 7
    assert "step 4" in torpor.log("quits")
    assert re.search(r"^quits\s+exited \(7\)", torpor.run("ps").stdout, re.M)


def test_checkpoint_hibernate_resume_restore(torpor: Torpor) -> None:
    torpor.run("run", "--name", "c", *python_job("counter.py"))
    torpor.wait_log("c", "step 5")
    first = torpor.json("checkpoint", "c")
    assert first["job"] == "c" and first["size_bytes"] > 0 and first["freeze_s"] > 0
    step_at_first = last_step(torpor.log("c"))
    torpor.wait_log("c", f"step {step_at_first + 5}")

    hib = torpor.json("hibernate", "c")
    assert hib["kind"] == "hibernate" and hib["freed_rss_bytes"] > 0
    job = torpor.job("c")
    assert job["state"] == "hibernated" and job["pid"] is None and job["rss_bytes"] is None
    step_at_hibernate = last_step(torpor.log("c"))

    resumed = torpor.json("resume", "c")
    assert resumed["checkpoint"] == hib["id"]
    torpor.wait_log("c", f"step {step_at_hibernate + 3}")
    log = torpor.log("c")
    # resumed exactly where it stopped: the step after the hibernation comes next, once
    assert log.count(f"step {step_at_hibernate + 1}\n") == 1

    # roll back to the first checkpoint: refused while running, then forced
    refused = torpor.run("restore", "c", "--from", first["id"][:6], check=False)
    assert refused.returncode == 2 and "running" in refused.stderr
    torpor.run("restore", "c", "--from", first["id"][:6], "--force")
    torpor.wait_for(lambda: torpor.log("c").count(f"step {step_at_first + 2}\n") == 2, what="replayed steps")
    assert torpor.job("c")["restored_from"] == first["id"]

    # a restored job checkpoints, hibernates and resumes like a fresh one
    torpor.run("hibernate", "c")
    torpor.run("resume", "c")
    torpor.wait_state("c", "running")
    listing = torpor.json("checkpoints", "c")
    assert [c["kind"] for c in listing] == ["checkpoint", "hibernate", "hibernate"]
    assert listing[1]["parent"] == first["id"]

    removed = torpor.run("rm", "c", "--force").stdout
    assert "3 checkpoint(s)" in removed
    assert torpor.json("ps") == []


def test_job_with_threads_child_file_and_tcp_survives_twice(torpor: Torpor, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    torpor.run("run", "--name", "cx", *python_job("complex_job.py", str(data)))
    torpor.wait_log("cx", "messages")
    for round_ in range(2):
        torpor.run("checkpoint", "cx")
        before = torpor.log("cx").count("\n")
        torpor.wait_for(
            lambda b=before: torpor.log("cx").count("\n") > b + 3, what="progress after checkpoint"
        )
        torpor.run("hibernate", "cx")
        assert torpor.job("cx")["state"] == "hibernated"
        lines_at_hibernate = torpor.log("cx").count("\n")
        torpor.run("resume", "cx")
        torpor.wait_for(
            lambda n=lines_at_hibernate: torpor.log("cx").count("\n") > n + 5,
            what=f"progress after resume {round_}",
        )
    log = torpor.log("cx")
    assert "ERROR" not in log
    assert torpor.job("cx")["state"] == "running"
    numbers = [int(m) for m in re.findall(r"^messages (\d+)", log, re.M)]
    assert numbers == sorted(numbers) and numbers[-1] > numbers[0]
    threads = re.findall(r"threads (\d+) (\d+)", log)
    assert int(threads[-1][0]) > int(threads[0][0]) and int(threads[-1][1]) > int(threads[0][1])
    # the file the job keeps writing went on growing across the restores, with no gaps
    written = data.read_text().splitlines()
    assert written and [int(line.split()[1]) for line in written] == sorted(
        int(line.split()[1]) for line in written
    )
    assert len(written) >= len(numbers) - 1


def test_stop_then_resume_from_latest(torpor: Torpor) -> None:
    torpor.run("run", "--name", "s", *python_job("counter.py"))
    torpor.wait_log("s", "step 3")
    ckpt = torpor.json("checkpoint", "s")
    torpor.run("stop", "s", "--timeout", "0.5")
    job = torpor.job("s")
    assert job["state"] == "failed" and job["exit_code"] == 128 + 9
    torpor.run("resume", "s")
    assert torpor.job("s")["restored_from"] == ckpt["id"]


def test_resume_after_kill_rewinds_files_the_job_writes(torpor: Torpor, tmp_path: Path) -> None:
    """CRIU refuses a file whose size changed since the checkpoint; torpor cuts it back and keeps the rest."""
    data = tmp_path / "metrics.txt"
    torpor.run("run", "--name", "wr", *python_job("writer.py", str(data)))
    torpor.wait_log("wr", "step 5")
    torpor.run("checkpoint", "wr")
    size_at_checkpoint_max = data.stat().st_size
    torpor.wait_log("wr", "step 30")
    torpor.run("stop", "wr", "--timeout", "0")
    grown = data.read_text()
    result = torpor.run("resume", "wr")
    assert "rewound 1 file" in result.stderr
    torpor.wait_log("wr", "step 40")
    lines = data.read_text().splitlines()
    assert lines == [f"line {i}" for i in range(len(lines))], "the file has gaps or repeats"
    saved = list((torpor.home / "jobs" / "wr" / "rewound").rglob("*"))
    saved_files = [p for p in saved if p.is_file()]
    assert len(saved_files) == 1
    cut = int(saved_files[0].name.rsplit("-", 1)[1])
    assert cut <= size_at_checkpoint_max
    assert grown[:cut] + saved_files[0].read_text() == grown


def _numbered(text: str, first: int = 0) -> bool:
    lines = text.splitlines()
    return bool(lines) and lines == [f"line {i}" for i in range(first, first + len(lines))]


@pytest.mark.parametrize("mode", ["w", "a", "r+"])
def test_resume_after_kill_rewinds_a_file_opened_to_write_append_or_read_write(
    torpor: Torpor, tmp_path: Path, mode: str
) -> None:
    """Lines written after the checkpoint are cut (and saved), whatever the mode: none appear twice.

    CRIU records no size for a file opened with O_APPEND; torpor takes it from the descriptor's offset.
    The job's own output log is never cut: it keeps what the killed incarnation printed.
    """
    data = tmp_path / "metrics.txt"
    header = "header\n" if mode == "a" else ""
    data.write_text(header)
    torpor.run("run", "--name", "wa", *python_job("writer.py", str(data), mode))
    torpor.wait_log("wa", "step 5")
    torpor.run("checkpoint", "wa")
    torpor.wait_log("wa", "step 30")
    torpor.run("stop", "wa", "--timeout", "0")
    killed_at = last_step(torpor.log("wa"))  # on a loaded machine, maybe far past step 30 (or the checkpoint)
    result = torpor.run("resume", "wa")
    assert "rewound 1 file" in result.stderr
    # the log keeps the killed run's lines: its last step appears twice once the resumed job passes it
    torpor.wait_for(
        lambda: torpor.log("wa").count(f"step {killed_at}\n") == 2, what="the resumed job past the kill"
    )
    text = data.read_text()
    assert text.startswith(header) and _numbered(text[len(header) :]), "the file has gaps or repeats"
    saved = [p for p in (torpor.home / "jobs" / "wa" / "rewound").rglob("*") if p.is_file()]
    assert len(saved) == 1 and _numbered(saved[0].read_text(), int(saved[0].read_text().split()[1]))


def test_a_file_first_opened_after_the_checkpoint_is_left_to_the_job(torpor: Torpor, tmp_path: Path) -> None:
    """Not in the image, so torpor does not touch it; the resumed job opens it again ("w" starts it over)."""
    data = tmp_path / "later.txt"
    torpor.run("run", "--name", "wl", *python_job("writer.py", str(data), "w", "60"))
    torpor.wait_log("wl", "step 3")
    torpor.run("checkpoint", "wl")
    assert not data.exists(), "the checkpoint came after step 60: it has the file open"
    torpor.wait_log("wl", "step 70")
    torpor.run("stop", "wl", "--timeout", "0")
    result = torpor.run("resume", "wl")
    assert "rewound" not in result.stderr
    torpor.wait_for(lambda: torpor.log("wl").count("step 70\n") == 2, what="the resumed job at step 70")
    assert _numbered(data.read_text(), 60)


def test_a_written_file_replaced_by_a_symlink_is_not_rewound_through_it(
    torpor: Torpor, tmp_path: Path
) -> None:
    """Someone who could write the job's folder must not make root cut another file on resume."""
    data = tmp_path / "metrics.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n" * 1000)
    torpor.run("run", "--name", "ws", *python_job("writer.py", str(data)))
    torpor.wait_log("ws", "step 5")
    torpor.run("checkpoint", "ws")
    torpor.wait_log("ws", "step 10")
    torpor.run("stop", "ws", "--timeout", "0")
    data.unlink()
    data.symlink_to(victim)
    result = torpor.run("resume", "ws", check=False)
    assert result.returncode == 5 and "symbolic link" in result.stderr, result.stderr
    assert victim.read_text() == "precious\n" * 1000
    assert torpor.job("ws")["state"] == "failed"
