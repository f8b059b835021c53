"""The scheduler's commands as a user types them: ``torpor submit``, ``queue``, ``quota``, ``rm`` of a
queued job, and what ``ps`` adds for a submitted job — against a real agent with a small budget (1G), so
that nothing here can take much of the machine's memory; and what each says without an agent.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from conftest import TORPOR, Torpor

from .conftest import AgentProcess

BUDGET = "1G"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(100000)"]
QUEUE_KEYS = {"budget", "reserve", "held", "free", "mem_available", "psi_full_avg10", "jobs"}
JOB_KEYS = {
    "name",
    "state",
    "request",
    "usage",
    "limit",
    "priority",
    "effective_priority",
    "project",
    "submitted_at",
    "waited_s",
    "hibernated_by",
    "why",
}


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The error a refused command printed: one line on stderr, nothing on stdout, exit ``code``."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torpor: error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def queued(torpor: Torpor) -> dict[str, dict[str, Any]]:
    return {job["name"]: job for job in torpor.json("queue")["jobs"]}


@pytest.fixture(autouse=True)
def tag() -> str:
    """A suffix for the test's job names, so that what one test leaves (a cgroup, a log) is never another's."""
    return uuid.uuid4().hex[:6]


def start_agent(agent: AgentProcess) -> None:
    agent.start("--memory-budget", BUDGET)


# -- without an agent -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["submit", "--memory", "100M", "--", "true"],
        ["queue"],
        ["quota", "show"],
        ["quota", "set", "ml", "--share", "1G"],
        ["quota", "rm", "ml"],
    ],
)
def test_without_an_agent_each_says_to_start_one(torpor: Torpor, command: list[str]) -> None:
    line = one_line_error(torpor.run(*command, check=False), 3)
    assert f"no agent runs for {torpor.home}" in line and "start it with 'torpor agent'" in line


def test_help_and_flags_of_the_wrong_kind_are_refused_by_the_parser_in_one_line(torpor: Torpor) -> None:
    for command in (["submit"], ["queue"], ["quota"], ["quota", "set"], ["quota", "show"], ["quota", "rm"]):
        shown = torpor.run(*command, "--help")
        assert shown.stdout.startswith(f"usage: torpor {' '.join(command)}"), shown.stdout
    assert "--memory SIZE" in torpor.run("submit", "--help").stdout
    line = one_line_error(
        torpor.run("submit", "--memory", "1G", "--priority", "high", "--", "true", check=False), 2
    )
    assert line == "torpor: error: submit: argument --priority: invalid int value: 'high'"
    line = one_line_error(torpor.run("submit", "--", "true", check=False), 2)
    assert "--memory" in line and "required" in line
    line = one_line_error(
        torpor.run("quota", "set", "ml", "--share", "1G", "--borrow-limit", "1G", "--no-borrow", check=False),
        2,
    )
    assert "not allowed with" in line


# -- with a real agent --------------------------------------------------------------------------------------


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_bad_submissions_are_refused_in_one_line_and_nothing_is_queued(
    torpor: Torpor, agent: AgentProcess
) -> None:
    start_agent(agent)
    too_large = one_line_error(torpor.run("submit", "--memory", "2G", "--", "true", check=False), 2)
    assert "--memory 2G is larger than this node's whole budget (1G)" in too_large
    malformed = one_line_error(torpor.run("submit", "--memory", "4X", "--", "true", check=False), 2)
    assert "'4X' is not a size" in malformed
    negative = one_line_error(
        torpor.run("submit", "--memory", "10M", "--priority", "-1", "--", "true", check=False), 2
    )
    assert "--priority -1" in negative
    both = one_line_error(
        torpor.run("submit", "--memory", "4X", "--priority", "-2", "--", "true", check=False), 2
    )
    assert "'4X' is not a size" in both and "--priority -2" in both and "; " in both  # all problems, one line
    missing = one_line_error(
        torpor.run("submit", "--memory", "10M", "--", "no-such-program-here", check=False), 2
    )
    assert "command not found: no-such-program-here" in missing  # looked up in the submitter's PATH
    assert torpor.json("queue")["jobs"] == []

    torpor.run("quota", "set", "ml", "--share", "512M")
    unknown = one_line_error(
        torpor.run("submit", "--memory", "10M", "--project", "nope", "--", "true", check=False), 2
    )
    assert "unknown project 'nope'" in unknown and "ml" in unknown
    unnamed = one_line_error(torpor.run("submit", "--memory", "10M", "--", "true", check=False), 2)
    assert "unknown project 'default'" in unnamed  # once quotas exist, every job names one
    assert torpor.json("queue")["jobs"] == [] and torpor.json("ps") == []

    # the API refuses the same, as 400 with the error body of the others
    refused = agent.api.post(
        "/v1/submit",
        json={"command": ["true"], "cwd": "/", "env": {}, "umask": 0o22, "memory": "2G", "project": "ml"},
    )
    assert refused.status_code == 400 and refused.json()["kind"] == "UsageError", refused.text
    assert "larger than this node's whole budget" in refused.json()["error"]


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_a_submit_that_fits_runs_in_the_submitters_environment_cwd_and_umask(
    torpor: Torpor, agent: AgentProcess, tmp_path: Path, tag: str
) -> None:
    start_agent(agent)
    env, plain = f"env-{tag}", f"plain-{tag}"
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    script = "import os; print('mark', os.environ.get('TORPOR_TEST_MARK'), os.getcwd(), oct(os.umask(0)), flush=True)"
    submit = [TORPOR, "submit", "--name", env, "--memory", "200M", "--priority", "3", "--cpus", "0.5"]
    shell = f"umask 027; exec {shlex.join([*submit, '--', sys.executable, '-c', script])}"
    result = subprocess.run(
        ["sh", "-c", shell],
        cwd=workdir,
        env={**torpor.env, "TORPOR_TEST_MARK": "from-the-submitter"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"queued job '{env}' (200M, priority 3, project default): torpor queue shows it\n"
    torpor.wait_for(lambda: env in {j["name"] for j in torpor.json("ps")}, 60, "the job to start")
    torpor.wait_state(env, "exited", timeout=60)
    assert f"mark from-the-submitter {workdir} 0o27" in torpor.log(env)
    job = torpor.job(env)
    assert job["exit_code"] == 0
    assert (job["request"], job["priority"], job["project"]) == (200 << 20, 3, "default")
    assert {"limit", "hibernated_by", "why"} <= set(job)

    # a job that did not come through the scheduler has the keys, empty
    torpor.run("run", "--name", plain, "--", *SLEEPER)
    other = torpor.job(plain)
    assert (other["request"], other["priority"], other["project"]) == (None, None, None)
    header, *rows = torpor.run("ps").stdout.splitlines()
    assert header.split()[:5] == ["NAME", "STATE", "PID", "MEMORY", "REQUEST"]
    assert any(row.split()[0] == env and "200M" in row.split() for row in rows), rows


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_queue_and_quota_say_the_budget_and_the_shares_and_refuse_what_cannot_be_kept(
    torpor: Torpor, agent: AgentProcess
) -> None:
    start_agent(agent)
    shown = torpor.json("quota", "show")
    assert shown == {"budget": 1 << 30, "projects": []}
    assert "no quotas" in torpor.run("quota", "show").stdout

    done = torpor.run("quota", "set", "ml", "--share", "512M", "--borrow-limit", "256M")
    assert done.stdout == "project ml: guaranteed 512M, may borrow up to 256M more\n"
    assert torpor.json("quota", "set", "web", "--share", "256M", "--no-borrow") == {
        "project": "web",
        "share": 256 << 20,
        "borrow_limit": 0,
    }
    beyond = one_line_error(torpor.run("quota", "set", "big", "--share", "512M", check=False), 2)
    assert "more than the budget 1G" in beyond
    malformed = one_line_error(torpor.run("quota", "set", "big", "--share", "lots", check=False), 2)
    assert "'lots' is not a size" in malformed
    projects = {p["project"]: p for p in torpor.json("quota", "show")["projects"]}
    assert set(projects) == {"ml", "web"}
    for project in projects.values():
        assert set(project) == {"project", "share", "borrow_limit", "held", "borrowed"}
    assert (projects["ml"]["share"], projects["ml"]["borrow_limit"]) == (512 << 20, 256 << 20)
    assert (projects["web"]["borrow_limit"], projects["web"]["held"]) == (0, 0)
    table = torpor.run("quota", "show").stdout.splitlines()
    assert table[0] == "budget 1G; shares 768M"
    assert table[1].split() == ["PROJECT", "SHARE", "MAY", "BORROW", "HELD", "BORROWED"]

    nope = one_line_error(torpor.run("quota", "rm", "nope", check=False), 2)
    assert "no quota for project 'nope'" in nope
    assert agent.api.delete("/v1/quotas/nope").status_code == 404
    assert torpor.run("quota", "rm", "web").stdout == "removed the quota of project web\n"
    assert [p["project"] for p in torpor.json("quota", "show")["projects"]] == ["ml"]

    queue = torpor.json("queue")
    assert set(queue) == QUEUE_KEYS
    assert (queue["budget"], queue["held"], queue["free"], queue["jobs"]) == (1 << 30, 0, 1 << 30, [])
    header = torpor.run("queue").stdout.splitlines()[0]
    assert header.startswith("budget 1G (reserve ") and "held 0, free 1G" in header


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_rm_of_a_queued_job_cancels_it_and_it_never_starts(
    torpor: Torpor, agent: AgentProcess, tag: str
) -> None:
    start_agent(agent)
    holder, waiter, waiter2, waiter3 = (f"{n}-{tag}" for n in ("holder", "waiter", "waiter2", "waiter3"))
    torpor.run("submit", "--name", holder, "--memory", "800M", "--", *SLEEPER)
    torpor.wait_for(lambda: queued(torpor)[holder]["state"] == "running", 60, "the holder to run")
    torpor.run("submit", "--name", waiter, "--memory", "500M", "--", *SLEEPER)  # does not fit, same priority
    queue = torpor.json("queue")
    assert set(queue) == QUEUE_KEYS and queue["held"] >= 800 << 20
    jobs = {job["name"]: job for job in queue["jobs"]}
    assert [job["name"] for job in queue["jobs"]] == [waiter, holder]  # the queued first
    for job in jobs.values():
        assert set(job) >= JOB_KEYS, set(job) ^ JOB_KEYS
    assert jobs[waiter]["state"] == "queued" and jobs[waiter]["request"] == 500 << 20
    assert jobs[holder]["request"] == 800 << 20 and jobs[holder]["hibernated_by"] is None
    rows = {row.split()[0]: row for row in torpor.run("queue").stdout.splitlines()[2:]}
    assert rows[waiter].split()[1:3] == ["queued", "500M"]
    assert waiter not in {job["name"] for job in torpor.json("ps")}  # queued: in the queue, not in ps

    cancelled = torpor.run("rm", waiter)
    assert cancelled.stdout == f"cancelled {waiter}: it waited in the queue and never started\n"
    assert set(queued(torpor)) == {holder}
    gone = one_line_error(torpor.run("rm", waiter, check=False), 2)
    assert f"no job named '{waiter}'" in gone

    # the API does the same for a client of its own
    torpor.run("submit", "--name", waiter2, "--memory", "500M", "--json", "--", *SLEEPER)
    answer = agent.api.delete(f"/v1/jobs/{waiter2}")
    assert answer.status_code == 200 and answer.json() == {
        "job": waiter2,
        "removed_checkpoints": [],
        "cancelled": True,
    }
    assert set(queued(torpor)) == {holder}
    assert [e["reason"] for e in agent.events() if e["action"] == "cancel" and e["job"] == waiter] == [
        "removed from the queue"
    ]

    # without an agent (SIGINT leaves its jobs), rm cancels from the records
    torpor.run("submit", "--name", waiter3, "--memory", "500M", "--", *SLEEPER)
    assert agent.stop() == 0
    assert json.loads(torpor.run("rm", waiter3, "--json").stdout) == {
        "job": waiter3,
        "removed_checkpoints": [],
        "cancelled": True,
    }
    removed = json.loads(torpor.run("rm", "--force", holder, "--json").stdout)
    assert removed["cancelled"] is False
    assert torpor.json("ps") == []


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_ps_says_why_the_scheduler_hibernated_a_job(torpor: Torpor, agent: AgentProcess, tag: str) -> None:
    start_agent(agent)
    low, high = f"low-{tag}", f"high-{tag}"
    torpor.run("submit", "--name", low, "--memory", "800M", "--", *SLEEPER)
    torpor.wait_for(lambda: queued(torpor)[low]["state"] == "running", 60, "low to run")
    torpor.run("submit", "--name", high, "--memory", "500M", "--priority", "5", "--", *SLEEPER)
    torpor.wait_for(lambda: queued(torpor).get(high, {}).get("state") == "running", 120, "high to run")
    job = torpor.wait_state(low, "hibernated", timeout=60)
    assert (job["hibernated_by"], job["request"], job["priority"]) == ("preempted", 800 << 20, 0)
    assert job["hibernation"] == f"preempted by {high} (priority 5 > 0)", job
    assert job["why"], job  # why it has not come back: the room is high's
    other = torpor.job(high)
    assert (other["hibernated_by"], other["hibernation"], other["request"]) == (None, None, 500 << 20)
    shown = torpor.run("ps").stdout
    reasons = [line for line in shown.splitlines() if line.startswith(f"{low}: ")]
    # "now": the scheduler's word on it, which moves on from round to round
    assert len(reasons) == 1 and reasons[0].startswith(
        f"{low}: preempted by {high} (priority 5 > 0); now "
    ), shown
    row = next(line for line in shown.splitlines() if line.startswith(f"{low} "))
    assert row.split()[1] == "hibernated" and "800M" in row.split()
    queue = queued(torpor)
    assert (queue[low]["state"], queue[low]["hibernated_by"]) == ("hibernated", "preempted")
    assert _why_cell(torpor, low).startswith("preempted; ") and queue[low]["why"]


def _why_cell(torpor: Torpor, name: str) -> str:
    """The WHY of ``name`` in ``torpor queue``'s table (the last column: it may hold spaces)."""
    header, *rows = torpor.run("queue").stdout.splitlines()[1:]
    start = header.index("WHY")
    return next(row[start:] for row in rows if row.split()[0] == name)
