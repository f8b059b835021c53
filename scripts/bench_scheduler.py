"""Benchmark: one decision of the memory-first scheduler (torpor.policy.scheduler.decision) at 10 000 queued jobs.

The agent asks for a decision every round, so a decision must stay well under a round even with a long
queue (issue 15's goal: < 50 ms at 10 000 queued jobs). Each scenario builds one snapshot (seeded, so
every run measures the same one) and times ``decide`` on it ``--repeat`` times; the median is reported with
the fastest and slowest, and the number of actions (what the agent would execute or show):

* **full node, quotas**: 10 000 queued jobs of three projects, priorities 0–9, and running jobs of
  1–8 GiB that fill a 256 GiB budget, one project borrowing beyond its share: every priority class searches for victims
  (reclaim, preemption) and most of the queue waits behind them;
* **empty node, quotas**: the same queue on a node with nothing running: jobs start until the budget is
  full, the rest wait;
* **full node, no quotas**: the first scenario with one pool;
* **empty node, MemAvailable binds**: the empty node while memory used outside torpor leaves 64 GiB:
  the budget has room, the node has not (jobs wait without holding the room);
* **guard**: the full node under memory pressure (MemAvailable below the guard): the guard picks victims
  and the whole queue waits.

Nothing is compared with an anchor here: the goal is an absolute bound. Writes its section of
``docs/benchmarks.md`` between ``<!-- scheduler:begin -->`` and ``<!-- scheduler:end -->``.
usage: bench_scheduler.py [--queued N] [--repeat N] [--no-doc]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchdoc import DOC, cpu_model, say, write_section

from torpor.policy.scheduler import Job, Pressure, Project, Rules, Snapshot, State, decide

GIB = 1 << 30
BUDGET = 256 * GIB
RESERVE = 16 * GIB
GOAL_S = 0.050
PROJECTS = {name: Project(name, BUDGET // 3) for name in ("vision", "nlp", "speech")}


def full_node(queued: int, seed: int = 15) -> Snapshot:
    rng = random.Random(seed)
    names = sorted(PROJECTS)
    jobs = []
    used = 0
    i = 0
    while used < BUDGET:
        # the first project borrows: it runs beyond its share, the others within theirs
        project = names[0] if i % 3 == 0 or used > 2 * BUDGET // 3 else names[i % 3]
        request = min(rng.randint(1, 8) * GIB, BUDGET - used)
        jobs.append(
            Job(
                f"run{i:03d}",
                State.RUNNING,
                request,
                priority=rng.randint(0, 9),
                project=project,
                submitted_at=rng.uniform(0, 3600),
                usage=int(request * rng.uniform(0.8, 1.0)),
                work_since_checkpoint_s=rng.uniform(0, 1800),
            )
        )
        used += request
        i += 1
    for k in range(queued):
        jobs.append(
            Job(
                f"job{k:05d}",
                State.QUEUED,
                rng.randint(1, 16) * GIB,
                priority=rng.randint(0, 9),
                project=rng.choice(names),
                submitted_at=rng.uniform(0, 7200),
            )
        )
    rng.shuffle(jobs)
    calm = Pressure(BUDGET - used + RESERVE, 0.0, 0.0)  # what the running jobs leave, and the reserve
    return Snapshot(BUDGET, tuple(jobs), now=7200.0, projects=PROJECTS, pressure=calm)


def scenarios(queued: int) -> list[tuple[str, Snapshot]]:
    full = full_node(queued)
    empty = replace(
        full,
        jobs=tuple(j for j in full.jobs if j.state is State.QUEUED),
        pressure=Pressure(BUDGET + RESERVE, 0.0, 0.0),
    )
    return [
        ("full node, quotas", full),
        ("empty node, quotas", empty),
        ("full node, no quotas", replace(full, projects={})),
        ("empty node, MemAvailable binds (64 GiB)", replace(empty, pressure=Pressure(64 * GIB, 0.0, 0.0))),
        ("guard (MemAvailable 256 MiB)", replace(full, pressure=Pressure(256 << 20, 5.0, 20.0))),
    ]


def measure(snapshot: Snapshot, repeat: int) -> tuple[list[float], list[float], int, int]:
    """Wall-clock and CPU times of ``repeat`` decisions (CPU time leaves out the moments another
    process had the core: on a shared machine it says what the decision itself costs)."""
    rules = Rules()
    decide(snapshot, rules)  # warm up
    walls, cpus = [], []
    actions: tuple[object, ...] = ()
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        actions = decide(snapshot, rules)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    moved = sum(type(a).__name__ != "Wait" for a in actions)
    return walls, cpus, len(actions), moved


def machine() -> str:
    cpu = cpu_model() or "unknown CPU"
    return f"{platform.node()} ({cpu}, {os.cpu_count()} CPUs), Python {platform.python_version()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument(
        "--no-doc", action="store_true", help="print the section, do not write docs/benchmarks.md"
    )
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    rows = []
    worst = worst_cpu = 0.0
    measured = scenarios(args.queued)
    running_full = sum(j.state is State.RUNNING for j in measured[0][1].jobs)
    for title, snapshot in measured:
        times, cpus, actions, moved = measure(snapshot, args.repeat)
        med, cpu = statistics.median(times), statistics.median(cpus)
        worst = max(worst, med)
        worst_cpu = max(worst_cpu, cpu)
        running = sum(j.state is State.RUNNING for j in snapshot.jobs)
        rows.append(
            f"| {title} | {len(snapshot.jobs) - running} | {running} | {med * 1000:.1f} ms | "
            f"{cpu * 1000:.1f} ms | {min(times) * 1000:.1f}–{max(times) * 1000:.1f} ms | "
            f"{actions} ({moved} not a Wait) |"
        )
        say(f"{title}: median {med * 1000:.1f} ms (CPU {cpu * 1000:.1f} ms) over {args.repeat}")
    verdict = "meets" if worst < GOAL_S else "misses"
    section = "\n".join(
        [
            "## Scheduler: one decision at 10 000 queued jobs (`scripts/bench_scheduler.py`)",
            "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine()}: "
            f"`decide()` of `torpor.policy.scheduler` timed {args.repeat} times on each snapshot "
            "(seeded: every run measures the same ones) after one warm-up call. The budget is 256 GiB; three "
            "projects share it equally; queued jobs ask 1–16 GiB with priorities 0–9; on a full node "
            f"{running_full} running jobs of 1–8 GiB fill it, one project borrowing.",
            "",
            "| scenario | candidates | running | median | median CPU time | fastest–slowest | actions |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"- **The slowest scenario's median is {worst * 1000:.1f} ms ({worst_cpu * 1000:.1f} ms of CPU): it "
            f"{verdict} the goal of {GOAL_S * 1000:.0f} ms** (issue 15).",
            "- What it costs: one pass over the jobs, one sort of the candidates, one of the running jobs, one "
            "`Wait` per job that does not start; a victim search only once per (project, priority, within "
            "share) that fails, so the queue behind a blocked job is answered in constant time per job.",
            f"- Load average (1 min) {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end on "
            f"{os.cpu_count()} CPUs: other work shared the machine; compare medians.",
        ]
    )
    if args.no_doc:
        print(section)
    else:
        write_section("scheduler", section, DOC)
        say(f"wrote its section of {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
