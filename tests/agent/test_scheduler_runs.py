"""The memory-first scheduler with real jobs that really allocate (issue 15, item 5).

Without torpor, jobs that grow past a node's memory meet the kernel's OOM killer (here inside a cgroup
with a limit, so that the test never endangers the machine); under the agent with the same budget none is
killed and all finish with correct output: the scheduler raises their cgroup limits while the budget has
room and hibernates one when it has none, until the others are done. A job of higher priority submitted
to a full node starts once its victim is hibernated, and the victim resumes where it was.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Torpor, python_job

from .conftest import AgentProcess

sys.path.insert(0, str(Path(__file__).parent.parent / "jobs"))
import grower  # the job's own module: the test computes the digest it must print

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

BUDGET_MIB = 1024
#: three jobs asking 300 MiB each (they fit) that grow to 600 MiB each (all three do not)
GROWERS = 3
REQUEST = "300M"
TARGET_MIB, STEP_MIB, PAUSE_S, HOLD_S = 600, 50, 0.3, 2.0


def memory_cgroup_root() -> Path | None:
    """This process's own memory cgroup (v1), where the test may make children; None without one."""
    mount = Path("/sys/fs/cgroup/memory")
    if not (mount / "memory.limit_in_bytes").exists():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return mount / path.lstrip("/")
    return None


@pytest.fixture
def limited() -> Iterator[Path]:
    """A memory cgroup with the budget as its limit and the kernel's OOM killer on (its default)."""
    root = memory_cgroup_root()
    if root is None:
        pytest.skip("this machine has no cgroup v1 memory controller for the comparison without torpor")
    folder = root / f"torpor-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    (folder / "memory.limit_in_bytes").write_text(str(BUDGET_MIB << 20))
    yield folder
    for pid in (folder / "cgroup.procs").read_text().split():
        os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (folder / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    folder.rmdir()


def steps_of(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"step (\d+)", log)]


def grower_command() -> list[str]:
    return python_job("grower.py", str(TARGET_MIB), str(STEP_MIB), str(PAUSE_S), str(HOLD_S))[1:]


def test_without_torpor_the_kernel_kills_a_job_that_grows_past_the_memory(limited: Path) -> None:
    procs = (limited / "cgroup.procs").as_posix()

    def join() -> None:  # pragma: no cover - runs in the child before exec
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))

    jobs = [
        subprocess.Popen(grower_command(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=join)
        for _ in range(GROWERS)
    ]
    outputs = [job.communicate(timeout=120)[0].decode() for job in jobs]
    codes = [job.returncode for job in jobs]
    killed = [code for code in codes if code == -signal.SIGKILL]
    assert killed, (codes, outputs)
    oom_kills = int(re.search(r"oom_kill (\d+)", (limited / "memory.oom_control").read_text()).group(1))  # type: ignore[union-attr]
    assert oom_kills >= len(killed)
    assert sum(f"done {grower.expected(TARGET_MIB)}" in out for out in outputs) == GROWERS - len(killed)


def test_under_the_agent_none_is_killed_and_every_job_finishes_with_correct_output(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start("--memory-budget", f"{BUDGET_MIB}M")
    names = [f"grow{i}" for i in range(GROWERS)]
    for name in names:
        torpor.run("submit", "--name", name, "--memory", REQUEST, "--", *grower_command())
    expected = f"done {grower.expected(TARGET_MIB)}"
    for name in names:
        job = torpor.wait_state(name, "exited", "failed", timeout=240)
        assert job["state"] == "exited" and job["exit_code"] == 0, (
            job,
            torpor.log(name),
            agent.log()[-3000:],
        )
        assert expected in torpor.log(name), torpor.log(name)
    events = agent.events()
    actions = [(e["job"], e["action"]) for e in events]
    # the node was too small for all three at their peak: the scheduler did something about it
    assert any(action == "hibernate" for _, action in actions), actions
    assert any(action == "resume" for _, action in actions), actions
    failed = [
        (e["job"], e["action"], e["reason"], e["detail"]["error"]) for e in events if e["detail"].get("error")
    ]
    # a job the guard chose as it finished may exit in the middle of its dump: that loses nothing
    assert all("exited" in error for *_, error in failed), (failed, agent.log()[-4000:])


def preempt_low(torpor: Torpor, agent: AgentProcess, high: str, low_steps: int = 5) -> int:
    """On a node with a 1G budget, a counter ``low`` (700M) runs ``low_steps`` steps, then ``high`` (700M,
    priority 5, running the Python code ``high``) is submitted; returns the event id before that submit."""
    agent.start("--memory-budget", "1G")
    torpor.run("submit", "--name", "low", "--memory", "700M", "--", *python_job("counter.py")[1:])
    torpor.wait_log("low", f"step {low_steps}")
    after = agent.last_event_id()
    torpor.run(
        "submit", "--name", "high", "--memory", "700M", "--priority", "5", "--", sys.executable, "-c", high
    )
    return after


def test_a_higher_priority_job_starts_once_its_victim_is_hibernated_and_the_victim_resumes_where_it_was(
    torpor: Torpor, agent: AgentProcess
) -> None:
    after = preempt_low(torpor, agent, "import time; print('high runs', flush=True); time.sleep(3)", 20)
    submitted = agent.wait_event("submit", "high", after=after)
    started = agent.wait_event("start", "high", timeout=60, after=after)
    victim = agent.wait_event("hibernate", "low", after=after)
    assert victim["detail"]["cause"] == "preempted" and victim["detail"]["for_job"] == "high", victim
    # high starts only once low is hibernated: never both at once on a node they do not fit together
    # (how soon after the submit is scripts/bench_scheduler_runs.py's measure, against the bar)
    assert submitted["id"] < victim["id"] < started["id"], (submitted, victim, started)
    torpor.wait_log("high", "high runs")
    # once high is done, low comes back by itself, from where it was
    agent.wait_event("resume", "low", timeout=60, after=after)
    last = steps_of(torpor.log("low"))[-1]
    torpor.wait_log("low", f"step {last + 5}")
    steps = steps_of(torpor.log("low"))
    assert steps == list(range(len(steps))), (
        "the counter restarted or skipped: it did not resume where it was"
    )


def test_a_project_below_its_share_reclaims_what_another_borrowed(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start("--memory-budget", "1G")
    torpor.run("quota", "set", "ml", "--share", "512M")
    torpor.run("quota", "set", "web", "--share", "512M")
    # ml borrows: 800M is more than its share, and web leaves its own unused
    torpor.run(
        "submit",
        "--name",
        "borrower",
        "--memory",
        "800M",
        "--project",
        "ml",
        "--",
        *python_job("counter.py")[1:],
    )
    torpor.wait_log("borrower", "step 5")
    after = agent.last_event_id()
    torpor.run(
        "submit", "--name", "owner", "--memory", "400M", "--project", "web", "--",
        sys.executable, "-c", "import time; print('owner runs', flush=True); time.sleep(2)",
    )  # fmt: skip
    reclaimed = agent.wait_event("hibernate", "borrower", after=after)
    assert reclaimed["detail"]["cause"] == "reclaimed" and reclaimed["detail"]["for_job"] == "owner", (
        reclaimed
    )
    agent.wait_event("start", "owner", after=after)
    torpor.wait_log("owner", "owner runs")
    agent.wait_event("resume", "borrower", timeout=60, after=after)
    last = steps_of(torpor.log("borrower"))[-1]
    torpor.wait_log("borrower", f"step {last + 3}")
    steps = steps_of(torpor.log("borrower"))
    assert steps == list(range(len(steps)))


def test_an_agent_killed_while_a_job_is_preempted_brings_it_back_after_its_restart(
    torpor: Torpor, agent: AgentProcess
) -> None:
    after = preempt_low(torpor, agent, "import time; print('high runs', flush=True); time.sleep(6)")
    torpor.run(
        "submit", "--name", "later", "--memory", "700M", "--", sys.executable, "-c", "print('later ran')"
    )
    agent.wait_event("start", "high", after=after)
    agent.kill()  # kill -9: what it knew is in the records (why low is hibernated, what waits)
    low = torpor.job("low")
    assert low["state"] == "hibernated", (low, agent.log()[-4000:])
    agent.start("--memory-budget", "1G")
    # once high is done, low (hibernated by the scheduler) and later (still queued) run, one after the other
    agent.wait_event("resume", "low", timeout=90, after=after)
    torpor.wait_log("low", f"step {steps_of(torpor.log('low'))[-1] + 3}")
    torpor.run("rm", "--force", "low")
    torpor.wait_state("later", "exited", timeout=90)
    assert "later ran" in torpor.log("later")


def test_a_victim_dumped_stopped_goes_on_when_a_person_resumes_it_without_the_agent(
    torpor: Torpor, agent: AgentProcess
) -> None:
    """The scheduler stops a job with a memory limit before its dump (a job reaching its limit while CRIU
    works would stall it); whoever restores that checkpoint continues it: here torpor resume, embedded."""
    after = preempt_low(torpor, agent, "import time; time.sleep(60)")
    agent.wait_event("hibernate", "low", after=after)
    agent.stop()  # SIGINT: the agent goes, high runs on, low stays hibernated
    last = steps_of(torpor.log("low"))[-1]
    torpor.run("resume", "low")
    torpor.wait_log("low", f"step {last + 5}", timeout=30)  # counting again: not left stopped
    steps = steps_of(torpor.log("low"))
    assert steps == list(range(len(steps)))
