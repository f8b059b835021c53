"""``torpor migrate`` of a PyTorch training job mid-run (issue 30): it finishes on the peer with every
loss bit-identical to an uninterrupted run's, each step once. Real CRIU, a real peer agent on loopback
with its own state directory and store key."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Torpor, python_job
from test_torch_resume import PAUSE, STEPS, assert_matches, losses, reference

from .conftest import loopback_peer

pytest.importorskip("torch")
pytestmark = [pytest.mark.criu, pytest.mark.torch, pytest.mark.timeout(300), pytest.mark.xdist_group("torch")]

__all__ = ["reference"]  # the fixture, for pytest


def test_a_training_job_moved_mid_run_finishes_on_the_peer_with_the_losses_of_an_uninterrupted_run(
    torpor: Torpor, other: Torpor, reference: dict[int, str], tmp_path: Path
) -> None:
    peer = loopback_peer(torpor, other, "b", tmp_path).agent
    try:
        gate = tmp_path / "go-on"  # it waits before step 100 until the file is there: moved mid-run
        torpor.run("run", "--name", "train", *python_job("train.py", str(STEPS), PAUSE, "100", str(gate)))
        torpor.wait_log("train", "step 30 ", timeout=120)
        moved = torpor.run("migrate", "train", "--to", "b")
        assert "moved job 'train' to peer b" in moved.stdout, moved.stderr
        gate.touch()
        other.wait_state("train", "exited", timeout=120)
        log = other.log("train")
        assert other.job("train")["exit_code"] == 0 and log.rstrip().endswith("done")
        assert_matches(log, reference)
        assert len(losses(log)) == STEPS  # each step once: nothing ran twice
    finally:
        peer.close()
        other.run("rm", "--force", "train", check=False)
        torpor.run("rm", "--force", "train", check=False)
