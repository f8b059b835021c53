"""Helpers of the Slurm tests: submit jobs that run ``torpor slurm run`` on the test cluster and watch them.

Each test gets one :class:`SlurmJobs` with its own ``TORPOR_HOME``; it submits real batch jobs and, at the
end, cancels whatever it left in the queue. (Not a ``conftest.py``: a second module named ``conftest``
would shadow the one of ``tests/`` that other test modules import.)
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_cluster import Cluster

from torpor.core.store import remove_hot_tier
from torpor.settings import Settings

TORPOR = str(Path(sys.executable).parent / "torpor")
TRAIN = Path(__file__).parent / "train.py"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def train_command(*args: str) -> list[str]:
    return [sys.executable, "-u", str(TRAIN), *args]


def reference_output(*args: str) -> str:
    """What the training job prints when nothing interrupts it (``--step-s`` does not change it)."""
    return subprocess.run(
        [*train_command(*args), "--step-s", "0"], capture_output=True, text=True, check=True, timeout=60
    ).stdout


@dataclass
class SlurmJobs:
    """Submit jobs that run under ``torpor slurm run`` and watch them; one per test."""

    cluster: Cluster
    folder: Path
    home: Path
    submitted: list[str] = field(default_factory=list)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"TORPOR_HOME": str(self.home), **(extra or {})}

    def submit_torpor(
        self,
        train_args: list[str],
        *,
        torpor_args: tuple[str, ...] = (),
        sbatch_args: tuple[str, ...] = ("--signal=B:USR1@30",),
        env: dict[str, str] | None = None,
        script: bool = False,
    ) -> str:
        """A low-partition job ``exec torpor slurm run -- train.py ARGS`` (``--wrap`` or a script)."""
        line = "exec " + shlex.join([TORPOR, "slurm", "run", *torpor_args, "--", *train_command(*train_args)])
        if script:
            path = self.folder / f"job-{len(self.submitted)}.sh"
            path.write_text(f"#!/bin/bash\n#SBATCH --partition=low\n{line}\n")
            form = [str(path)]
        else:
            form = ["--wrap", line]
        job_id = self.cluster.sbatch(
            [
                "--partition=low",
                f"--output={self.folder}/%j.out",
                f"--error={self.folder}/%j.err",
                f"--chdir={self.folder}",
                "--export=ALL",
                *sbatch_args,
                *form,
            ],
            env=self.env(env),
        )
        self.submitted.append(job_id)
        return job_id

    def submit_high(self, low_job: str, seconds: float = 2) -> str:
        """An exclusive high-partition job (preempts the low one) that records the low job's state."""
        job_id = self.cluster.sbatch(
            [
                "--partition=high",
                "--exclusive",
                f"--output={self.folder}/%j.out",
                "--wrap",
                f"squeue -h -j {low_job} -o 'low job while high runs: %T'; sleep {seconds}",
            ]
        )
        self.submitted.append(job_id)
        return job_id

    def output(self, job_id: str) -> str:
        path = self.folder / f"{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def errors(self, job_id: str) -> str:
        path = self.folder / f"{job_id}.err"
        return path.read_text(errors="replace") if path.exists() else ""

    def history(self, job_id: str) -> str:
        """Every ``torpor slurm:`` line of every run of the job (Slurm truncates its own files)."""
        path = self.home / "slurm" / f"{job_id}.log"
        return path.read_text() if path.exists() else ""

    def wait_output(self, job_id: str, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output(job_id):
            state = self.cluster.state(job_id)
            if state in FINAL_STATES or time.monotonic() > deadline:
                raise AssertionError(
                    f"{text!r} not in the output of job {job_id} ({state}):\n{self.output(job_id)[-500:]}\n"
                    f"{self.errors(job_id)}\n{self.cluster.job_summary(job_id)}"
                )
            time.sleep(0.1)

    def wait_done(self, job_id: str, timeout: float = 120) -> str:
        try:
            return self.cluster.wait_state(job_id, FINAL_STATES, timeout)
        except Exception as exc:
            raise AssertionError(f"{exc}\n--- stderr of the job:\n{self.errors(job_id)}") from exc

    def restarts(self, job_id: str) -> int:
        return int(self.cluster.job(job_id).get("Restarts", "0"))

    def torpor(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [TORPOR, *args],
            env=self.cluster.env(self.env()),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"torpor {' '.join(args)} failed: {result.stderr}")
        return result

    def cleanup(self) -> None:
        for job_id in self.submitted:
            self.cluster.run(["scancel", job_id], check=False)
        for job_id in self.submitted:
            with_timeout = time.monotonic() + 30
            while self.cluster.state(job_id) not in FINAL_STATES | {"GONE"}:
                if time.monotonic() > with_timeout:
                    break
                time.sleep(0.2)
        for pid in processes_of(self.home):
            os.kill(pid, signal.SIGKILL)
        # torpor's RAM hot tier for this home (in /dev/shm), if any command made one
        remove_hot_tier(Settings(home=self.home))


def processes_of(home: Path) -> list[int]:
    """Processes started with ``TORPOR_HOME=home`` in their environment (launchers, jobs)."""
    needle = f"TORPOR_HOME={home}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
