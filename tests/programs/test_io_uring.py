"""A job holding an io_uring instance is refused before anything is frozen, and keeps running.

CRIU cannot dump io_uring ("Unknown shit 600 (anon_inode:[io_uring])", whether the ring's descriptor is
open or only its rings are mapped); libuv opens one, so PyTorch's TCPStore does. torpor looks for it in the
job's processes before CRIU runs and says which process holds it and what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import JOBS, Torpor, python_job
from torpor.adapters.system import procfs

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        os.uname().machine != "x86_64", reason="the job calls io_uring_setup by its x86-64 number"
    ),
]


def wait_counting(torpor: Torpor, name: str) -> None:
    """Until job ``name`` printed a few more ticks: it was not left frozen."""
    before = torpor.log(name).count("tick ")
    torpor.wait_for(lambda: torpor.log(name).count("tick ") > before + 2, timeout=10, what="more ticks")


@pytest.mark.parametrize("holds", ["fd", "mapped"])
def test_io_uring_users_finds_a_ring_by_its_descriptor_or_its_mapping(holds: str) -> None:
    job = subprocess.Popen(
        [sys.executable, "-u", str(JOBS / "io_uring_job.py"), holds], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout is not None and job.stdout.readline().startswith("ready")
        assert procfs.io_uring_users([job.pid, os.getpid()]) == [job.pid]
        assert "io_uring_job.py " + holds in procfs.command_line(job.pid)
        # too long for the limit, wherever the checkout is: the paths are cut to their last part first
        expected = f"{os.path.basename(sys.executable)} -u io_uring_job.py {holds}"
        short = procfs.command_line(job.pid, limit=len(expected))
        assert short == expected
    finally:
        job.kill()
        job.wait()
        job.stdout.close()
    assert procfs.io_uring_users([job.pid]) == []  # gone: nothing to refuse


@pytest.mark.criu
@pytest.mark.parametrize("holds", ["fd", "mapped"])
def test_checkpoint_and_hibernate_are_refused_naming_the_process_and_the_job_keeps_running(
    torpor: Torpor, holds: str
) -> None:
    torpor.run("run", "--name", "ring", *python_job("io_uring_job.py", holds))
    torpor.wait_log("ring", "tick 3", timeout=30)
    pid = torpor.job("ring")["pid"]
    for verb in ("checkpoint", "hibernate"):
        result = torpor.run(verb, "ring", check=False)
        assert result.returncode == 4, result.stderr  # CheckpointFailed, as any job CRIU cannot dump
        message = result.stderr.splitlines()[0]
        assert message.startswith(f"torpor: error: process {pid} (")
        assert "io_uring_job.py" in message and "uses io_uring" in message
        assert "use_libuv=False" in message and "USE_LIBUV=0" in message
        assert "the job is still running" in result.stderr
        assert torpor.job("ring")["state"] == "running"
        # never frozen: it goes on counting
        wait_counting(torpor, "ring")
    assert torpor.json("checkpoints", "ring") == []
    assert not list((torpor.home / "jobs" / "ring" / "criu").glob("*dump*")), "CRIU was run"
