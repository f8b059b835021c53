"""``torpor run -- torchrun …`` as typed: two gloo ranks trained through checkpoint, hibernate, resume and
rollback print exactly the losses of an uninterrupted torchrun, and no process of the job holds an io_uring.

torchrun's rendezvous store runs on libuv, whose io_uring CRIU cannot dump; torpor starts torchrun with its
TCPStore without libuv (src/torpor/policy/torchrun.py). The ranks talk over TCP on loopback, both ends
inside the job, which CRIU restores with --tcp-established. The uninterrupted reference is plain torchrun
(libuv and all), run beside the job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import JOBS, Torpor
from torpor.adapters.system import procfs

BIN = Path(sys.executable).parent
STEPS = "200"
PAUSE = "0.15"  # from step 45 to the end: > 20 s, more than a loaded machine takes to hibernate it
RANKS = (0, 1)


def losses(log: str) -> list[tuple[tuple[int, int], str]]:
    found = re.findall(r"^rank (\d) step (\d+) loss (\S+)$", log, re.M)
    return [((int(rank), int(step)), loss) for rank, step, loss in found]


def assert_matches(log: str, reference: dict[tuple[int, int], str]) -> None:
    seen = losses(log)
    assert seen, "no losses in the log"
    mismatched = [(key, loss, reference[key]) for key, loss in seen if reference[key] != loss]
    assert not mismatched, f"losses differ from the uninterrupted run: {mismatched[:5]}"
    assert {key for key, _ in seen} == set(reference), "some steps never ran"


def job_processes(root: int) -> list[int]:
    namespace = os.readlink(f"/proc/{root}/ns/pid")
    members = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                members.append(int(entry))
        except OSError:
            continue
    return members


def io_uring_holders(pids: list[int]) -> list[int]:
    """As ``ls -l /proc/PID/fd | grep io_uring`` (and the same in /proc/PID/maps) would show them."""
    holders = []
    for pid in pids:
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        if any("io_uring" in link for link in links) or "io_uring" in Path(f"/proc/{pid}/maps").read_text():
            holders.append(pid)
    return holders


def wait_step(torpor: Torpor, step: int, timeout: float = 60) -> None:
    for rank in RANKS:
        torpor.wait_log("ddp", f"rank {rank} step {step} loss", timeout=timeout)


def test_the_interpreter_of_a_script_is_read_from_its_first_line(tmp_path: Path) -> None:
    script = tmp_path / "torchrun"
    script.write_text("#!/venv/bin/python3.11\nimport sys\n")
    assert procfs.script_interpreter(str(script)) == ["/venv/bin/python3.11"]
    script.write_text("#! /usr/bin/env python3\n")
    assert procfs.script_interpreter(str(script)) == ["/usr/bin/env", "python3"]
    # pip's form for an interpreter path too long for #!
    script.write_text(
        "#!/bin/sh\n'''exec' \"/a/very/long/venv/bin/python\" \"$0\" \"$@\"\n' '''\nimport sys\n"
    )
    assert procfs.script_interpreter(str(script)) == ["/a/very/long/venv/bin/python"]
    script.write_text("import sys\n")
    assert procfs.script_interpreter(str(script)) is None
    assert procfs.script_interpreter(str(tmp_path / "missing")) is None


@pytest.mark.criu
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_with_two_gloo_ranks_survives_checkpoint_hibernate_resume_and_rollback(
    torpor: Torpor, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    script = str(JOBS / "train_ddp.py")
    uninterrupted = subprocess.Popen(
        [str(BIN / "torchrun"), "--nproc-per-node", "2", "--standalone", script, STEPS],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        torpor.env["PATH"] = f"{BIN}:{torpor.env.get('PATH', '')}"  # torchrun as a user types it
        started = torpor.run(
            "run",
            "--name",
            "ddp",
            "--",
            "torchrun",
            "--nproc-per-node",
            "2",
            "--standalone",
            script,
            STEPS,
            PAUSE,
        )
        assert "TCPStore runs without libuv" in started.stdout
        wait_step(torpor, 20)
        processes = job_processes(torpor.job("ddp")["pid"])
        assert len(processes) >= 3, "the agent and two ranks"
        assert io_uring_holders(processes) == []
        early = torpor.json("checkpoint", "ddp")
        # early enough that the job is still running when the (slow, on a loaded machine) CLI claims it
        wait_step(torpor, 45)
        hibernated = torpor.run("hibernate", "ddp", check=False)
        assert hibernated.returncode == 0, (
            f"{hibernated.stderr}{torpor.job('ddp')}\n{torpor.log('ddp')[-3000:]}"
        )
        assert torpor.job("ddp")["state"] == "hibernated"
        torpor.run("resume", "ddp")
        torpor.wait_state("ddp", "exited", timeout=90)
        log = torpor.log("ddp")
        assert torpor.job("ddp")["exit_code"] == 0, log[-2000:]
        out, _ = uninterrupted.communicate(timeout=90)
    finally:
        uninterrupted.kill()
    reference = dict(losses(out))
    assert len(reference) == len(RANKS) * int(STEPS)
    assert_matches(log, reference)

    # roll back to the first checkpoint: both ranks train again from step 20, identically
    torpor.run("restore", "ddp", "--from", early["id"])
    torpor.wait_state("ddp", "exited", timeout=90)
    log = torpor.log("ddp")
    assert torpor.job("ddp")["exit_code"] == 0, log[-2000:]
    assert log.count("rank 0 done") == 2 and log.count("rank 1 done") == 2
    assert_matches(log, reference)
