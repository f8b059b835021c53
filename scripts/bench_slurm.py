"""Benchmark: a preempted Slurm job under ``torpor slurm run`` against the same job restarted cold.

On a throwaway one-node cluster (``tests/slurm/slurm_cluster.py``: munged, slurmctld, slurmd on loopback)
a job with a long start-up (it fills ``--memory-mb`` of memory and sleeps ``--startup-s``, standing in for
loading a large model) runs in the ``low`` partition and is preempted by an exclusive job in ``high``:

* **torpor**: ``exec torpor slurm run -- JOB`` with ``--signal=B:USR1@60``; SIGUSR1 → hibernate, requeue;
  the restart restores the image.
* **cold** (the anchor): the best a plain batch script can do — on SIGUSR1 it kills the job and runs
  ``scontrol requeue`` itself; the restart runs the job from the beginning, start-up included.

Measured per run (wall clock, from timestamps the scripts and the job print):

* *signal → node free*: from the preemption signal reaching the batch script until the high job starts
  (the node is free once Slurm can start it; includes Slurm's own scheduling delay, the same for both);
* *restart → computing*: from the requeued job's batch script starting until the job prints its first
  new step;
* *steps redone*: steps computed before the preemption that the restarted job computed again;
* *submit → done*: the low job's whole life.

Writes its section of ``docs/benchmarks.md`` between ``<!-- slurm:begin -->`` and ``<!-- slurm:end -->``.
usage: bench_slurm.py [--memory-mb N] [--startup-s S] [--steps N] [--repeat N] [--no-doc]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "slurm"))

from benchdoc import DOC, write_section  # noqa: E402
from slurm_cluster import Cluster, running_cluster, slurm_available  # noqa: E402

from torpor.core.store import remove_hot_tier  # noqa: E402
from torpor.settings import Settings  # noqa: E402

TORPOR = str(Path(sys.executable).parent / "torpor")
TRAIN = HERE.parent / "tests" / "slurm" / "train.py"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STAMP = 'echo "batch start $(date +%s.%N) restart=${SLURM_RESTART_COUNT:-0}" >&2'


@dataclass(frozen=True)
class Result:
    mode: str
    signal_to_free_s: float
    restart_to_compute_s: float
    steps_redone: int
    total_s: float
    note: str


def job_command(args: argparse.Namespace) -> str:
    return shlex.join(
        [
            sys.executable,
            "-u",
            str(TRAIN),
            "--steps",
            str(args.steps),
            "--step-s",
            str(args.step_s),
            "--memory-mb",
            str(args.memory_mb),
            "--startup-s",
            str(args.startup_s),
            "--stamp",
        ]
    )


def batch_script(mode: str, args: argparse.Namespace) -> str:
    if mode == "torpor":
        return f"#!/bin/bash\n{STAMP}\nexec {TORPOR} slurm run -- {job_command(args)}\n"
    # the cold anchor: kill the job and requeue on SIGUSR1, start from scratch when restarted
    return (
        "#!/bin/bash\n"
        f"{STAMP}\n"
        f"{job_command(args)} &\n"
        "job=$!\n"
        "trap 'echo \"signal at $(date +%s.%N)\" >&2; kill -9 $job; scontrol requeue $SLURM_JOB_ID; exit 0' USR1\n"
        "while kill -0 $job 2>/dev/null; do wait $job; done\n"
        "wait $job\n"
    )


def steps_with_times(text: str) -> list[tuple[int, float]]:
    found = []
    for match in re.finditer(r"^step (\d+) \w+ (\d+\.\d+)$", text, re.M):
        found.append((int(match.group(1)), float(match.group(2))))
    return found


def wait_for(predicate: object, timeout: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_slurm: timed out waiting for {what}")
        time.sleep(0.05)


def run_once(cluster: Cluster, mode: str, args: argparse.Namespace, folder: Path) -> Result:
    folder.mkdir(parents=True, exist_ok=True)
    home = folder / "torpor-home"
    script = folder / "job.sh"
    script.write_text(batch_script(mode, args))
    submitted = time.time()
    low = cluster.sbatch(
        [
            "--partition=low",
            "--signal=B:USR1@60",
            "--open-mode=append",  # keep both runs' output, to count the steps done twice
            f"--output={folder}/low.out",
            f"--error={folder}/low.err",
            f"--chdir={folder}",
            "--export=ALL",
            str(script),
        ],
        env={"TORPOR_HOME": str(home)},
    )
    out = folder / "low.out"
    preempt_after = args.preempt_at_step

    def computed_steps() -> list[tuple[int, float]]:
        return steps_with_times(out.read_text()) if out.exists() else []

    wait_for(lambda: len(computed_steps()) > preempt_after, args.startup_s + 120, "the job to compute")
    high = cluster.sbatch(
        [
            "--partition=high",
            "--exclusive",
            f"--output={folder}/high.out",
            "--wrap",
            'echo "high start $(date +%s.%N)"; sleep 2',
        ]
    )
    wait_for(
        lambda: (folder / "high.out").exists() and "high start" in (folder / "high.out").read_text(),
        120,
        "the high job",
    )
    high_start = float((folder / "high.out").read_text().split()[2])
    state = cluster.wait_state(low, FINAL, args.startup_s * 2 + args.steps * args.step_s + 180)
    done = time.time()
    if state != "COMPLETED":
        raise SystemExit(f"bench_slurm: the {mode} job ended {state}:\n{cluster.job_summary(low)}")
    cluster.wait_state(high, FINAL, 60)

    errors = (folder / "low.err").read_text()
    history = (home / "slurm" / f"{low}.log").read_text() if mode == "torpor" else errors
    signal_at = re.search(r"(?:received SIGUSR1 at|signal at) (\d+\.\d+)", history)
    if signal_at is None:
        raise SystemExit(f"bench_slurm: no signal time in the {mode} job's log:\n{history}")
    restart = re.findall(r"batch start (\d+\.\d+) restart=1", errors)
    if not restart:
        raise SystemExit(f"bench_slurm: the {mode} job did not restart:\n{errors}")
    restart_at = float(restart[-1])
    steps = computed_steps()
    last_before = max(step for step, t in steps if t < restart_at)
    first_step, first_at = next((step, t) for step, t in steps if t > restart_at)
    redone = max(0, last_before + 1 - first_step)
    note = ""
    if mode == "torpor":
        hib = re.search(
            r"hibernated as \w+: frozen ([\d.]+) s, image ([\d.]+) MiB, ([\d.]+) s in all", history
        )
        res = re.search(r"restored \S+ from \w+ \w+ \(taken \d+ s ago\) in ([\d.]+) s", history)
        if hib:
            note += f"hibernate {hib.group(3)} s ({hib.group(2)} MiB image, frozen {hib.group(1)} s)"
        if res:
            note += f"; restore {res.group(1)} s"
    remove_hot_tier(Settings(home=home))
    return Result(
        mode=mode,
        signal_to_free_s=high_start - float(signal_at.group(1)),
        restart_to_compute_s=first_at - restart_at,
        steps_redone=redone,
        total_s=done - submitted,
        note=note,
    )


def section(results: list[Result], args: argparse.Namespace, root: Path, load: tuple[float, float]) -> str:
    def median(mode: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in results if r.mode == mode)

    rows = []
    for r in results:
        rows.append(
            f"| {r.mode} | {r.signal_to_free_s:.2f} s | {r.restart_to_compute_s:.2f} s | {r.steps_redone} "
            f"| {r.total_s:.1f} s | {r.note or '-'} |"
        )
    compute_ratio = median("cold", "restart_to_compute_s") / max(
        median("torpor", "restart_to_compute_s"), 1e-6
    )
    free_ratio = median("torpor", "signal_to_free_s") / max(median("cold", "signal_to_free_s"), 1e-6)
    return "\n".join(
        [
            "## Slurm: preempted job, torpor vs cold restart (`scripts/bench_slurm.py`)",
            "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
            f"({os.cpu_count()} CPUs), Slurm from Debian on one node (test cluster on loopback, "
            f"`sched_interval=1`), torpor state in {root}. The job (`tests/slurm/train.py`) holds "
            f"{args.memory_mb} MiB and takes {args.startup_s:.0f} s to start (a stand-in for loading a model), "
            f"then computes {args.steps} steps of {args.step_s} s; an exclusive job in the `high` partition "
            f"preempts it after step {args.preempt_at_step}. *cold* is the best a plain batch script can do: "
            "kill the job and `scontrol requeue` on SIGUSR1, start from scratch when restarted.",
            "",
            "| mode | signal → node free | restart → computing | steps redone | submit → done | torpor's part |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"- **restart → computing again: torpor {compute_ratio:.1f}× faster** than the cold restart "
            f"(median {median('torpor', 'restart_to_compute_s'):.2f} s vs "
            f"{median('cold', 'restart_to_compute_s'):.2f} s), and it redoes no step.",
            f"- **signal → node free: torpor takes {free_ratio:.1f}× the cold job's time** "
            f"({median('torpor', 'signal_to_free_s'):.2f} s vs {median('cold', 'signal_to_free_s'):.2f} s): "
            "it writes the image before leaving, the cold job only dies. Both include Slurm noticing the node "
            "is free and starting the high job.",
            "- The requeued job waits a few seconds in the queue either way (`cred_expire=5` here); that wait "
            "is in *submit → done*, not in *restart → computing*.",
            f"- Load average (1 min) {load[0]:.1f} at the start and {load[1]:.1f} at the end on "
            f"{os.cpu_count()} CPUs: other work shared the machine, so single rows are noisy; compare medians.",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--startup-s", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--preempt-at-step", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-doc", action="store_true", help="print the section, do not write the doc")
    args = parser.parse_args()
    missing = slurm_available()
    if missing:
        print(f"bench_slurm: cannot run: {missing}", file=sys.stderr)
        return 3
    results: list[Result] = []
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="torpor-bench-slurm-") as tmp:
        root = Path(tmp)
        with running_cluster(root / "cluster") as cluster:
            for n in range(args.repeat):
                for mode in ("torpor", "cold"):
                    result = run_once(cluster, mode, args, root / f"{mode}-{n}")
                    print(
                        f"{mode}: signal→free {result.signal_to_free_s:.2f} s, restart→computing "
                        f"{result.restart_to_compute_s:.2f} s, steps redone {result.steps_redone}, "
                        f"total {result.total_s:.1f} s {result.note}",
                        flush=True,
                    )
                    results.append(result)
        text = section(results, args, Path(tempfile.gettempdir()), (load_start, os.getloadavg()[0]))
    print(text)
    if not args.no_doc:
        write_section("slurm", text)
        print(f"wrote the slurm section of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
