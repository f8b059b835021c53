"""``torpor slurm run`` against a real Slurm cluster (munged, slurmctld, slurmd on loopback) and real CRIU.

Covers: preemption by a higher-priority partition (checkpoint, requeue, restore, output identical to an
uninterrupted run, no step repeated); the same through ``scontrol requeue``; hibernate-instead-of-suspend
(the held job's memory is freed, ``torpor slurm resume`` brings it back); and faults — killed before any
checkpoint, a checkpoint that fails during preemption, a restore that fails on the next run — each of
which ends in a correct result, says so in the job's log and loses nothing the job wrote.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_cluster import Cluster, running_cluster, slurm_available
from slurm_jobs import SlurmJobs, processes_of, reference_output

from torpor.settings import Settings

SLURM_MISSING = slurm_available()

pytestmark = [
    pytest.mark.slurm,
    # one Slurm cluster per run: make suite runs these on one worker (the session fixture is per worker)
    pytest.mark.xdist_group("slurm"),
    pytest.mark.criu,
    pytest.mark.timeout(150),
    pytest.mark.skipif(SLURM_MISSING is not None, reason=str(SLURM_MISSING)),
]

ARGS = ["--steps", "60", "--step-s", "0.1"]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """munged, slurmctld and slurmd on loopback for the whole session; the daemons are killed after."""
    with running_cluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture
def jobs(cluster: Cluster, tmp_path: Path) -> Iterator[SlurmJobs]:
    instance = SlurmJobs(cluster, tmp_path, tmp_path / "torpor-home")
    yield instance
    instance.cleanup()


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("step ")]


def assert_uninterrupted(output: str, *args: str) -> None:
    """The job's output is the uninterrupted run's, line for line: no step lost, none repeated."""
    expected = reference_output(*args)
    assert output == expected, f"output differs from an uninterrupted run:\n{output[-800:]}"
    steps = step_lines(output)
    assert len(steps) == len(set(steps)) == int(args[args.index("--steps") + 1])


def test_preempted_by_high_partition_resumes_where_it_was(jobs: SlurmJobs) -> None:
    low = jobs.submit_torpor(ARGS)
    jobs.wait_output(low, "step 15")
    high = jobs.submit_high(low)

    assert jobs.wait_done(low) == "COMPLETED"
    assert jobs.wait_done(high) == "COMPLETED"
    assert "low job while high runs: PENDING" in jobs.output(high)
    assert jobs.restarts(low) == 1
    assert_uninterrupted(jobs.output(low), *ARGS)
    history = jobs.history(low)
    assert "received SIGUSR1" in history
    assert re.search(r"hibernated as \w+: frozen", history)
    assert re.search(r"restart 1: restored slurm-\d+ from hibernate", history)
    # the restarted run's error file says it was restored (Slurm truncated the first run's)
    assert "restored" in jobs.errors(low)


@pytest.mark.parametrize("open_mode", ["truncate", "append"])
def test_scontrol_requeue_hibernates_and_restores(jobs: SlurmJobs, open_mode: str) -> None:
    # truncate (Slurm's default): the restored run writes the earlier output again; append: it must not
    job = jobs.submit_torpor(ARGS, script=True, sbatch_args=(f"--open-mode={open_mode}",))
    jobs.wait_output(job, "step 15")
    jobs.cluster.run(["scontrol", "requeue", job])

    assert jobs.wait_done(job) == "COMPLETED"
    assert jobs.restarts(job) == 1
    assert_uninterrupted(jobs.output(job), *ARGS)
    history = jobs.history(job)
    assert "received SIGTERM" in history
    assert "Slurm is requeueing the job itself" in history
    assert "restart 1: restored" in history


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_hibernate_instead_of_suspend_frees_memory_until_resumed(jobs: SlurmJobs) -> None:
    args = [*ARGS, "--memory-mb", "300"]
    job = jobs.submit_torpor(args)
    jobs.wait_output(job, "step 10", timeout=90)
    (record,) = json.loads(jobs.torpor("ps", "--json").stdout)
    pid = record["pid"]
    assert rss_bytes(pid) > 250 * 2**20

    said = jobs.torpor("slurm", "hibernate", job)
    assert "held" in said.stdout
    jobs.cluster.wait_state(job, {"PENDING"}, timeout=30)
    assert "held" in jobs.cluster.job(job).get("Reason", "").lower()
    # while it waits: no process of the job is left, the node has nothing allocated
    deadline = time.monotonic() + 10
    while processes_of(jobs.home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of(jobs.home) == []
    assert not Path(f"/proc/{pid}").exists()
    (record,) = json.loads(jobs.torpor("ps", "--json").stdout)
    assert record["state"] == "hibernated"
    # …and its image is not kept in this node's RAM (torpor's hot tier in /dev/shm) either
    hot = Settings(home=jobs.home).hot_path
    in_ram = sum(f.stat().st_size for f in hot.rglob("*") if f.is_file()) if hot.exists() else 0
    assert in_ram < 2**20
    node = jobs.cluster.run(["scontrol", "show", "node", "-o"]).stdout
    assert "CPUAlloc=0 " in node
    # it stays held: Slurm runs a job submitted after it on the free node, and does not start this one
    later = jobs.cluster.sbatch(["--partition=low", f"--output={jobs.folder}/%j.out", "--wrap", "true"])
    jobs.submitted.append(later)
    assert jobs.wait_done(later) == "COMPLETED"
    assert jobs.cluster.state(job) == "PENDING"

    jobs.torpor("slurm", "resume", job)
    assert jobs.wait_done(job) == "COMPLETED"
    assert_uninterrupted(jobs.output(job), *args)
    assert "received SIGUSR2" in jobs.history(job)


def test_killed_before_any_checkpoint_restarts_cold(jobs: SlurmJobs) -> None:
    job = jobs.submit_torpor(ARGS, sbatch_args=("--signal=B:USR1@30", "--open-mode=append"))
    jobs.wait_output(job, "step 5")
    for pid in processes_of(jobs.home):  # the node dies under the job: no chance to checkpoint
        os.kill(pid, signal.SIGKILL)
    assert jobs.wait_done(job) == "FAILED"
    jobs.cluster.run(["scontrol", "requeue", job])

    assert jobs.wait_done(job) == "COMPLETED"
    history = jobs.history(job)
    assert "no checkpoint exists" in history and "starting cold" in history
    assert "no checkpoint exists" in jobs.errors(job)
    # append mode: the first, killed run's output is still there, then the complete cold run
    output = jobs.output(job)
    assert output.endswith(reference_output(*ARGS))
    assert output.startswith("ready ") and output.count("ready ") == 2
    # nothing the first run wrote is lost: its torpor log is kept beside the cold run's
    first_log = jobs.home / "jobs" / f"slurm-{job}" / "output.log"
    assert "step 5" in first_log.read_text()
    assert (jobs.home / "jobs" / f"slurm-{job}-r1" / "output.log").exists()


def failing_criu(folder: Path, *, dump: bool = False, first_restore: bool = False) -> str:
    """A criu that refuses ``dump`` or the first ``restore`` (fault injection), else runs the real one."""
    real = Path(os.environ.get("TORPOR_CRIU") or Path(sys.executable).parent / "criu")
    marker = folder / "restore-failed-once"
    wrapper = folder / "criu"
    wrapper.write_text(
        "#!/bin/sh\n"
        + ('if [ "$1" = dump ]; then echo "Error: injected dump failure" >&2; exit 1; fi\n' if dump else "")
        + (
            f'if [ "$1" = restore ] && [ ! -e {marker} ]; then touch {marker}; '
            'echo "Error: injected restore failure" >&2; exit 1; fi\n'
            if first_restore
            else ""
        )
        + f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def test_checkpoint_failing_at_preemption_still_requeues_and_restarts_cold(jobs: SlurmJobs) -> None:
    criu = failing_criu(jobs.folder, dump=True)
    low = jobs.submit_torpor(
        ARGS, sbatch_args=("--signal=B:USR1@30", "--open-mode=append"), env={"TORPOR_CRIU": criu}
    )
    jobs.wait_output(low, "step 10")
    high = jobs.submit_high(low)

    assert jobs.wait_done(low) == "COMPLETED"
    assert jobs.wait_done(high) == "COMPLETED"
    assert jobs.restarts(low) == 1
    errors = jobs.errors(low)
    assert "checkpoint failed" in errors and "injected dump failure" in errors
    assert "the next run starts cold" in errors
    assert f"requeued Slurm job {low}" in errors
    assert "no checkpoint exists" in errors
    output = jobs.output(low)
    assert output.endswith(reference_output(*ARGS))
    assert "step 10" in (jobs.home / "jobs" / f"slurm-{low}" / "output.log").read_text()


def test_restore_failing_falls_back_to_previous_checkpoint(jobs: SlurmJobs) -> None:
    criu = failing_criu(jobs.folder, first_restore=True)
    job = jobs.submit_torpor(ARGS, torpor_args=("--interval", "1"), env={"TORPOR_CRIU": criu})
    jobs.wait_output(job, "step 30")
    jobs.cluster.run(["scontrol", "requeue", job])

    assert jobs.wait_done(job) == "COMPLETED"
    history = jobs.history(job)
    assert history.count("checkpoint ") >= 2, history
    match = re.search(
        r"restoring checkpoint (\w+) failed: .*falling back to the previous checkpoint (\w+)", history
    )
    assert match, history
    failed, previous = match.groups()
    assert f"restored slurm-{job} from checkpoint {previous}" in history
    # the restored run replays the output up to the older checkpoint, then computes the rest; a periodic
    # checkpoint's log offset is exact only up to the lines printed while it was taken, which may repeat
    output = jobs.output(job).splitlines(keepends=True)
    expected = reference_output(*ARGS).splitlines(keepends=True)
    assert list(dict.fromkeys(output)) == expected
    assert len(output) - len(expected) <= 2, "more than the lines printed during a checkpoint repeat"
    # nothing lost: the newer, unusable checkpoint is kept, and the job's own log still holds what the
    # first run printed after the older checkpoint (only Slurm's output file leaves it out)
    checkpoints = {c["id"] for c in json.loads(jobs.torpor("checkpoints", "--json").stdout)}
    assert {failed, previous} <= checkpoints
    log = (jobs.home / "jobs" / f"slurm-{job}" / "output.log").read_text()
    assert len(step_lines(log)) > len(step_lines(reference_output(*ARGS)))
    assert set(step_lines(log)) == set(step_lines(reference_output(*ARGS)))


def test_hibernate_or_resume_of_an_unknown_job_says_what_slurm_said(jobs: SlurmJobs) -> None:
    for command in ("hibernate", "resume"):
        result = jobs.torpor("slurm", command, "999999", check=False)
        assert result.returncode == 3, result.stderr
        first = result.stderr.splitlines()[0]
        assert first.startswith("torpor: error: '") and "999999" in first
        assert "Traceback" not in result.stderr
