"""``make demo`` end to end: the narrated demo runs with real CRIU and reports identical losses.

The demo itself compares every loss of the checkpointed, hibernated and resumed job with an
uninterrupted run; this test checks that it says so, exits 0 and leaves no job behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
@pytest.mark.criu
@pytest.mark.torch
@pytest.mark.timeout(300)
def test_demo_reports_matching_losses(tmp_path: Path) -> None:
    home = tmp_path / "home"
    hot = Path("/dev/shm") / f"torpor-test-demo-{os.getpid()}"
    env = {**os.environ, "TORPOR_HOME": str(home), "TORPOR_HOT_DIR": str(hot)}
    try:
        check_demo(env)
    finally:
        shutil.rmtree(hot, ignore_errors=True)


def check_demo(env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torpor.apps.demo", "--steps", "120"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "identical losses: 120 of 120 steps" in output
    assert "final weights sha256: identical" in output
    assert "OK: " in output
    for chapter in ("Checkpoint it", "Hibernate it", "Resume it", "processes alive: 0"):
        assert chapter in output

    listing = subprocess.run(
        [str(Path(sys.executable).parent / "torpor"), "ps", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert listing.stdout.strip() == "[]", "the demo left a job behind"
