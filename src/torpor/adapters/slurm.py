"""Slurm's client commands (``scontrol``, ``scancel``), the only way torpor talks to Slurm.

Slurm has no stable Python API, so torpor runs the same commands an administrator would, and turns their
failures into :class:`SlurmCommandFailed` with the command's own message. Which config the commands read
is Slurm's business (``SLURM_CONF`` or ``/etc/slurm/slurm.conf``); the environment passes through.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from torpor.errors import EnvironmentProblem
from torpor.errors import SlurmCommandFailed as SlurmCommandFailed  # its home is errors.py; re-exported

_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def _command(tool: str) -> str:
    found = shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), _SBIN]))
    if found is None:
        raise EnvironmentProblem(f"{tool} not found: install Slurm's client tools (slurm-client / slurm-wlm)")
    return found


def _run(argv: list[str], timeout: float) -> str:
    argv = [_command(argv[0]), *argv[1:]]
    try:
        result = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SlurmCommandFailed(
            f"'{' '.join(argv)}' did not answer within {timeout:.0f} s; is slurmctld reachable?"
        ) from exc
    except OSError as exc:
        raise SlurmCommandFailed(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip()
        raise SlurmCommandFailed(
            f"'{' '.join([os.path.basename(argv[0]), *argv[1:]])}' failed (exit {result.returncode}): {said.splitlines()[-1] if said else 'no message'}",
            details=said.splitlines()[:-1][-5:],
        )
    return result.stdout


def requeue(job_id: str, hold: bool = False, timeout: float = 30) -> None:
    """``scontrol requeue[hold] JOB``: put the job back in the queue (held: until ``release``)."""
    _run(["scontrol", "requeuehold" if hold else "requeue", job_id], timeout)


def release(job_id: str, timeout: float = 30) -> None:
    """``scontrol release JOB``: let a held job be scheduled again."""
    _run(["scontrol", "release", job_id], timeout)


def signal_batch_shell(job_id: str, signal_name: str, timeout: float = 30) -> None:
    """``scancel --batch --signal=SIG JOB``: signal only the batch script (``torpor slurm run``)."""
    _run(["scancel", "--batch", f"--signal={signal_name}", job_id], timeout)


@dataclass(frozen=True)
class JobInfo:
    """What ``scontrol show job`` says about a job that matters to torpor."""

    state: str  # RUNNING, COMPLETING, PENDING…
    restarts: int  # how many times Slurm requeued it so far


def job_info(job_id: str, timeout: float = 30) -> JobInfo:
    """The job's state and restart count; raises :class:`SlurmCommandFailed` if Slurm does not know it."""
    out = _run(["scontrol", "show", "job", "-o", job_id], timeout)
    fields: dict[str, str] = {}
    for token in out.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    restarts = fields.get("Restarts", "0")
    return JobInfo(
        state=fields.get("JobState", "UNKNOWN"), restarts=int(restarts) if restarts.isdigit() else 0
    )
