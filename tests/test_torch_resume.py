"""A deterministic PyTorch training job checkpointed, killed, resumed and rolled back prints exactly the
losses of an uninterrupted run — the property users judge torpor by ("does my job come back exactly").
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import JOBS, Torpor, python_job

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.criu,
    pytest.mark.torch,
    pytest.mark.timeout(300),
    # one reference training run: make suite runs these on one worker (the module fixture is per worker)
    pytest.mark.xdist_group("torch"),
]

STEPS = 150
PAUSE = "0.03"


def losses(log: str) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in re.findall(r"^step (\d+) loss (\S+)$", log, re.M)]


@pytest.fixture(scope="module")
def reference() -> dict[int, str]:
    out = subprocess.run(
        [sys.executable, "-u", str(JOBS / "train.py"), str(STEPS)], capture_output=True, text=True, check=True
    ).stdout
    result = dict(losses(out))
    assert len(result) == STEPS
    return result


def assert_matches(log: str, reference: dict[int, str]) -> None:
    seen = losses(log)
    assert seen, "no losses in the log"
    mismatched = [(step, loss, reference[step]) for step, loss in seen if reference[step] != loss]
    assert not mismatched, f"losses differ from the uninterrupted run: {mismatched[:5]}"
    assert {step for step, _ in seen} == set(reference), "some steps never ran"


def test_checkpoint_kill_resume_and_rollback_match_uninterrupted_run(
    torpor: Torpor, reference: dict[int, str], tmp_path: Path
) -> None:
    gate = tmp_path / "go-on"  # the job waits before step 85 until it exists: killed mid-run however slow
    torpor.run("run", "--name", "train", *python_job("train.py", str(STEPS), PAUSE, "85", str(gate)))
    torpor.wait_log("train", "step 30 ", timeout=120)
    early = torpor.json("checkpoint", "train")
    torpor.wait_log("train", "step 60 ", timeout=120)
    torpor.json("checkpoint", "train")
    torpor.wait_log("train", "step 80 ", timeout=120)
    torpor.run("stop", "train", "--timeout", "0")
    assert torpor.job("train")["state"] == "failed"
    assert "done" not in torpor.log("train")
    gate.touch()

    torpor.run("resume", "train")
    torpor.wait_state("train", "exited", timeout=120)
    log = torpor.log("train")
    assert torpor.job("train")["exit_code"] == 0 and log.rstrip().endswith("done")
    assert_matches(log, reference)
    # steps between the second checkpoint and the kill (none, if the job reached the gate first) ran twice,
    # before the kill and after the resume, identically (assert_matches)
    assert len(losses(log)) >= STEPS

    # roll back to the early checkpoint of the finished job: it trains again from there, identically
    torpor.run("restore", "train", "--from", early["id"])
    torpor.wait_state("train", "exited", timeout=120)
    log = torpor.log("train")
    assert log.count("done") == 2
    assert_matches(log, reference)


def test_dataloader_workers_job_resumed_after_kill_matches(torpor: Torpor) -> None:
    # 8 epochs of 16 steps, 0.1 s apart once started: what is left after step 200 (6 epochs, >= 10 s) is
    # more than a loaded machine takes to see step 200 and stop the job
    epochs = "8"
    out = subprocess.run(
        [sys.executable, "-u", str(JOBS / "train_dataloader.py"), epochs],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    reference = dict(losses(out))
    torpor.run("run", "--name", "dl", *python_job("train_dataloader.py", epochs, "0.1"))
    torpor.wait_log("dl", "step 105 ", timeout=120)
    torpor.run("checkpoint", "dl")
    torpor.wait_log("dl", "step 200 ", timeout=120)
    torpor.run("stop", "dl", "--timeout", "0")
    torpor.run("resume", "dl")
    torpor.wait_state("dl", "exited", timeout=120)
    log = torpor.log("dl")
    assert torpor.job("dl")["exit_code"] == 0, log[-2000:]
    assert_matches(log, reference)
