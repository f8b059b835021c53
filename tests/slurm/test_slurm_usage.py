"""Bad input to ``torpor slurm``: one line on stderr and a usage exit status, no traceback, no Slurm needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TORPOR = str(Path(sys.executable).parent / "torpor")


def torpor(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        [TORPOR, "--home", str(tmp_path / "home"), *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["slurm", "run", "--", "true"], {}, "must run inside a Slurm batch job"),
        (["slurm", "run"], {"SLURM_JOB_ID": "7"}, "no command given"),
        (["slurm", "run", "--", "true"], {"SLURM_JOB_ID": "7x"}, "not a job number"),
        (["slurm", "run", "--", "true"], {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "-1"}, "not a number"),
        (["slurm", "run", "--interval", "0", "--", "true"], {"SLURM_JOB_ID": "7"}, "--interval must be"),
        (["slurm", "hibernate", "12a"], {}, "bad Slurm job id"),
        (["slurm", "resume", ""], {}, "bad Slurm job id"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], env: dict[str, str], said: str
) -> None:
    result = torpor(tmp_path, *args, env=env)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
