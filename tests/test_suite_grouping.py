"""The suite's own parallelism: ``make suite`` runs tests on two pytest-xdist workers with ``--dist
loadgroup``, and tests marked ``xdist_group`` (one Slurm cluster, one initdb, the hot tiers every
``torpor cleanup`` looks at) rely on running on one worker. pytest 9.2 broke that silently
(pytest-xdist#1386: the tests are spread as if unmarked), so this checks it on the versions installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("together")

@pytest.mark.parametrize("n", range(6))
def test_grouped(n):
    with open(os.environ["WORKERS_LOG"], "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_grouped.py").write_text(GROUPED)
    (suite / "test_other.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         str(suite)],
        cwd=suite, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "WORKERS_LOG": str(tmp_path / "workers")},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    workers = (tmp_path / "workers").read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers
