"""The node agent with real jobs and real CRIU: periodic checkpoints, idle hibernation, evacuation,
restarts (SIGTERM, SIGINT, kill -9), the API's answers to bad requests, and the CLI through it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import Torpor, free_port, python_job

from .conftest import AgentProcess, Metadata, _serve, pid_alive

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]

SLEEPER = ["--", sys.executable, "-c", "import time; time.sleep(100000)"]
SPINNER = ["--", sys.executable, "-c", "while True: pass"]


def steps(torpor: Torpor, name: str) -> int:
    """The last step the counter job printed."""
    lines = [line for line in torpor.log(name).splitlines() if line.startswith("step ")]
    return int(lines[-1].split()[1]) if lines else -1


def test_one_agent_per_state_directory_and_bad_requests_are_4xx_with_a_message(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start()
    assert stat.S_IMODE(os.stat(agent.socket).st_mode) == 0o600
    second = torpor.run("agent", check=False, timeout=30)
    assert second.returncode == 3
    assert "an agent already runs for" in second.stderr and str(torpor.home) in second.stderr

    assert "/v1/jobs/{name}/checkpoint" in agent.api.get("/openapi.json").json()["paths"]
    missing = agent.api.get("/v1/jobs/nope")
    assert missing.status_code == 404 and missing.json()["error"] == "no job named 'nope' (see 'torpor ps')"
    assert agent.api.post("/v1/jobs/nope/checkpoint", json={}).status_code == 404
    assert agent.api.post("/v1/jobs", json={"command": []}).status_code == 422
    assert agent.api.post("/v1/jobs", json={"command": ["/no/such/program"]}).status_code == 400
    for policy in ({"colour": "red"}, {"checkpoint_every_s": 0.1}, {"wake_on": [70000], "idle_after_s": 60}):
        refused = agent.api.post(
            "/v1/jobs", json={"command": ["sleep", "100"], "name": "s", "policy": policy}
        )
        assert refused.status_code == 400 and refused.json()["kind"] == "UsageError", refused.text
    assert agent.api.get("/v1/jobs").json() == []  # nothing was started
    started = agent.api.post(
        "/v1/jobs", json={"command": ["sleep", "100"], "name": "s", "policy": {"priority": 3}}
    )
    assert started.status_code == 201 and started.json()["policy"]["priority"] == 3
    assert started.json()["state"] == "running"

    torpor.run("run", "--name", "c", *python_job("counter.py"))
    bad = agent.api.put("/v1/jobs/c/policy", json={"checkpoint_every_s": 0.1})
    assert bad.status_code == 400 and "--checkpoint-every must be at least 1s" in bad.json()["error"]
    assert agent.api.put("/v1/jobs/c/policy", json={"colour": "red"}).status_code == 400
    busy = agent.api.post("/v1/jobs/c/restore", json={})
    assert busy.status_code in (404, 409)  # no checkpoint yet, or running: either way refused, with why
    assert busy.json()["error"]

    # the CLI gives the same one-line errors through the agent
    result = torpor.run("policy", "set", "c", "--checkpoint-every", "10", check=False)
    assert result.returncode == 2 and "'10' is not a duration" in result.stderr
    result = torpor.run("policy", "set", "c", "--idle-after", "1m", "--wake-on", "70000", check=False)
    assert result.returncode == 2 and "a TCP port is 1 to 65535" in result.stderr
    result = torpor.run("checkpoint", "nope", check=False)
    assert result.returncode == 2 and result.stderr.startswith("torpor: error: no job named 'nope'")


def test_the_cli_goes_through_the_agent_and_says_the_same(torpor: Torpor, agent: AgentProcess) -> None:
    agent.start()
    torpor.run("run", "--name", "c", *python_job("counter.py"))
    torpor.wait_log("c", "step 3", timeout=30)
    hibernated = torpor.run("hibernate", "c")
    assert hibernated.stdout.startswith("hibernated c as ") and "freed" in hibernated.stdout
    assert "dumping 1 process(es)" in hibernated.stderr  # the agent's progress, streamed
    at = steps(torpor, "c")
    resumed = torpor.run("resume", "c")
    assert resumed.stdout.startswith("restored c from ")
    torpor.wait_for(lambda: steps(torpor, "c") > at + 3, 30, "the counter to go on")
    actions = [(e["job"], e["action"], e["reason"]) for e in agent.events("c")]
    assert actions == [("c", "hibernate", "asked through the API"), ("c", "resume", "asked through the API")]


def test_periodic_checkpoints_are_stretched_to_the_budget_and_only_the_newest_kept(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start()
    torpor.run(
        "run",
        "--name",
        "c",
        "--checkpoint-every",
        "1s",
        "--budget",
        "1%",
        "--keep",
        "2",
        *python_job("counter.py"),
    )
    torpor.wait_for(
        lambda: len([e for e in agent.events("c") if e["action"] == "checkpoint"]) >= 3, 120, "3 checkpoints"
    )
    checkpoints = [e for e in agent.events("c") if e["action"] == "checkpoint"]
    assert all("error" not in e["detail"] for e in checkpoints), checkpoints
    # every freeze of this small job (~0.02-0.05 s: it has no TCP socket, so no network lock) on a 1 %
    # budget stretches 1s to a few: the reason says so, and the checkpoints are at least that far apart
    # (the interval is the mean of the kept checkpoints' freezes / budget: at least the smallest of them,
    # with --keep 2 the last two or three, counting one not yet pruned)
    assert any("stretched to" in e["reason"] for e in checkpoints[1:]), [e["reason"] for e in checkpoints]
    for i, (before, after) in enumerate(itertools.pairwise(checkpoints)):
        kept = [e["detail"]["freeze_s"] for e in checkpoints[max(0, i - 2) : i + 1]]
        assert after["at"] - before["at"] >= 0.9 * min(kept) / 0.01
    assert len(torpor.json("checkpoints", "c")) == 2  # --keep 2
    durable = agent.wait_event("durable", "c", timeout=60)  # how long each took to reach the cold tier
    assert (
        0 < durable["detail"]["durable_s"] < 60
        and durable["detail"]["checkpoint"] == checkpoints[0]["detail"]["checkpoint"]
    )


def test_an_idle_job_is_hibernated_and_a_busy_one_is_not(torpor: Torpor, agent: AgentProcess) -> None:
    agent.start()
    torpor.run("run", "--name", "idle", "--idle-after", "2s", *SLEEPER)
    torpor.run("run", "--name", "busy", "--idle-after", "2s", *SPINNER)
    event = agent.wait_event("hibernate", "idle", timeout=60)
    assert event["reason"] == "idle: no CPU used for 2s"
    assert event["detail"]["freed_bytes"] > 1 << 20 and "error" not in event["detail"]
    assert torpor.job("idle")["state"] == "hibernated"
    agent.wait_rounds(15)  # 3 s of rounds, past the busy job's 2 s idle time
    assert torpor.job("busy")["state"] == "running"
    assert not [e for e in agent.events("busy") if e["action"] == "hibernate"]


def test_killed_with_minus_9_and_started_again_it_loses_nothing(torpor: Torpor, agent: AgentProcess) -> None:
    agent.start()
    torpor.run("run", "--name", "a", "--checkpoint-every", "2s", "--budget", "50%", *python_job("counter.py"))
    agent.wait_event("checkpoint", "a", timeout=60)
    launcher = torpor.job("a")["launcher_pid"]
    agent.kill()
    assert pid_alive(launcher) and torpor.job("a")["state"] == "running"  # the job never needed the agent
    # while no agent runs, the CLI works embedded; the next agent adopts what it started, policy included
    torpor.run("run", "--name", "b", "--checkpoint-every", "2s", "--budget", "50%", *python_job("counter.py"))
    mark = agent.last_event_id()
    agent.start()
    adopted = agent.wait_event("adopt", after=mark, timeout=30)
    assert "2 running" in adopted["reason"]
    agent.wait_event("checkpoint", "a", after=mark, timeout=60)
    agent.wait_event("checkpoint", "b", after=mark, timeout=60)


def test_sigterm_hibernates_every_job_durably_and_the_next_start_resumes_them(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start()
    for name in ("a", "b"):
        torpor.run("run", "--name", name, *python_job("counter.py"))
        torpor.wait_log(name, "step 3", timeout=30)
    assert agent.stop(signal.SIGTERM) == 0
    at = {}
    for name in ("a", "b"):
        assert torpor.job(name)["state"] == "hibernated"
        assert [c["state"] for c in torpor.json("checkpoints", name)] == ["durable"]
        at[name] = steps(torpor, name)
    refused = torpor.run("run", "--name", "c", *python_job("counter.py"), check=False)
    assert refused.returncode == 2 and "being evacuated (SIGTERM)" in refused.stderr
    agent.start()  # "the next boot"
    for name in ("a", "b"):
        torpor.wait_state(name, "running", timeout=60)
        torpor.wait_for(lambda n=name: steps(torpor, n) > at[n] + 2, 30, f"{name} to count on")
        assert f"step {at[name] + 1}\n" in torpor.log(name)  # where it was, not from the start
    torpor.run("run", "--name", "c", *python_job("counter.py"))  # and the node takes jobs again


def test_a_drain_saves_the_most_valuable_first_refuses_new_jobs_and_survives_a_failing_job(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start("--parallel", "1")
    torpor.run("run", "--name", "low", "--priority", "1", *python_job("counter.py"))
    torpor.run("run", "--name", "high", "--priority", "5", *python_job("counter.py"))
    torpor.run("run", "--name", "ring", "--priority", "9", *python_job("io_uring_job.py", "fd"))
    torpor.wait_log("ring", "tick 2", timeout=30)
    drained = torpor.run("drain", "--json", "--why", "maintenance", check=False)
    assert drained.returncode == 4, drained.stderr  # one job could not be saved
    report = json.loads(drained.stdout)
    assert report["order"] == ["ring", "high", "low"]
    assert sorted(report["saved"]) == ["high", "low"] and report["pending"] == []
    assert "io_uring" in report["failed"]["ring"]
    assert torpor.job("ring")["state"] == "running"  # its failed checkpoint left it as it was
    for name in ("high", "low"):
        assert torpor.job(name)["state"] == "hibernated"
    refused = torpor.run("run", "--name", "new", *python_job("counter.py"), check=False)
    assert refused.returncode == 2 and "being evacuated (maintenance)" in refused.stderr
    agent.wait_rounds(10)  # the job it could not save is not tried again at each
    assert [e["action"] for e in agent.events()].count("evacuate") == 1
    cancelled = torpor.run("drain", "--cancel")
    assert "resuming" in cancelled.stdout
    for name in ("high", "low"):
        torpor.wait_state(name, "running", timeout=60)


def test_an_agent_killed_mid_evacuation_leaves_no_job_frozen(torpor: Torpor, agent: AgentProcess) -> None:
    agent.start("--parallel", "2")
    names = [f"j{i}" for i in range(3)]
    for name in names:
        torpor.run("run", "--name", name, *python_job("memory_hog.py", "200"))
    for name in names:
        torpor.wait_log(name, "holding", timeout=60)
    drain = subprocess.Popen(
        [sys.executable, "-m", "torpor.apps.cli", "drain", "--json"],
        env=torpor.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    agent.wait_event("evacuate", timeout=30)
    time.sleep(0.3)  # into the first dumps
    agent.kill()
    drain.wait(30)
    drain.stdout.close() if drain.stdout else None
    drain.stderr.close() if drain.stderr else None
    for name in names:
        job = torpor.job(name)
        if job["state"] == "running":
            state = Path(f"/proc/{job['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
            assert state not in ("t", "T"), f"{name} is left stopped ({state})"
    agent.start()  # the node still drains: the new agent saves what is left
    for name in names:
        torpor.wait_state(name, "hibernated", timeout=120)
    torpor.wait_for(
        lambda: all(c["state"] == "durable" for n in names for c in torpor.json("checkpoints", n)),
        120,
        "durable images",
    )


def test_on_tcp_every_request_needs_the_token_from_a_private_file(
    torpor: Torpor, agent: AgentProcess, tmp_path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-the-test\n")
    token.chmod(0o644)
    port = free_port()
    result = torpor.run(
        "agent", "--listen", f"127.0.0.1:{port}", "--token-file", str(token), check=False, timeout=30
    )
    assert result.returncode == 3 and "only you can read" in result.stderr
    token.chmod(0o600)
    agent.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token))
    url = f"http://127.0.0.1:{port}/v1/health"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer s3cret-token-for-the-test"}).json()["pid"] > 0
    assert agent.api.get("/v1/health").status_code == 200  # the unix socket needs none


def test_a_spot_notice_served_on_loopback_evacuates_every_job(
    torpor: Torpor, agent: AgentProcess, service: tuple[str, Metadata]
) -> None:
    url, meta = service
    for name in ("a", "b"):
        torpor.run("run", "--name", name, *python_job("counter.py"))
    path = "/latest/meta-data/spot/instance-action"
    agent.start("--notice-url", url + path, "--notice-interval", "200ms")
    meta.wait_requests(3)  # polled, and a 404 is no notice
    assert [torpor.job(n)["state"] for n in ("a", "b")] == ["running", "running"]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
    _serve(meta, path, 200, json.dumps({"action": "terminate", "time": when}).encode())
    notice = agent.wait_event("notice", timeout=30)
    assert "terminate" in notice["reason"] and 60 < notice["detail"]["deadline_s"] <= 120
    evacuated = agent.wait_event("evacuated", timeout=120)
    assert sorted(evacuated["detail"]["saved"]) == ["a", "b"], evacuated
    for name in ("a", "b"):
        assert torpor.job(name)["state"] == "hibernated"
        assert [c["state"] for c in torpor.json("checkpoints", name)] == ["durable"]
    refused = torpor.run("run", "--name", "c", *python_job("counter.py"), check=False)
    assert refused.returncode == 2 and "being evacuated" in refused.stderr


def test_an_idle_web_server_is_hibernated_and_woken_by_curl_which_gets_its_answer(
    torpor: Torpor, agent: AgentProcess, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "hello.txt").write_text("hello from a hibernated server\n")
    port = free_port()
    server = web_server(site, port)
    # a port someone else listens on is refused when the policy is set, naming who
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        refused = torpor.run(
            "run", "--name", "web", "--idle-after", "2s", "--wake-on", str(port), *server, check=False
        )
        assert refused.returncode == 2 and f"port {port} is in use by process {os.getpid()}" in refused.stderr
    torpor.run("run", "--name", "web", "--idle-after", "2s", "--wake-on", str(port), *server)
    agent.start()
    url = f"http://127.0.0.1:{port}/hello.txt"
    torpor.wait_for(lambda: _get(url) is not None, 30, "the server to answer")
    hibernated = agent.wait_event("hibernate", "web", timeout=60)
    assert hibernated["reason"].startswith("idle") and "error" not in hibernated["detail"]
    assert torpor.job("web")["state"] == "hibernated"
    agent.wait_for(lambda: f"holding 127.0.0.1:{port}" in agent.log(), 30, "the agent to hold the port")
    agent.kill()  # a new agent holds the port again, from what the records say
    agent.start()
    agent.wait_for(
        lambda: agent.log().count(f"holding 127.0.0.1:{port}") == 2, 30, "the new agent to hold it"
    )
    curl = subprocess.run(
        ["curl", "-sS", "--max-time", "60", url], capture_output=True, text=True, timeout=90
    )
    assert curl.returncode == 0, curl.stderr
    assert curl.stdout == "hello from a hibernated server\n"
    woken = agent.wait_event("resume", "web", timeout=30)
    assert woken["reason"] == f"a connection on 127.0.0.1:{port}"
    assert woken["detail"]["relayed"] >= 1 and woken["detail"]["dropped"] == 0
    if torpor.job("web")["state"] != "running":
        # idle again 2 s after its answer, a loaded machine may see it hibernated again: by the idle rule
        again = agent.wait_event("hibernate", "web", after=woken["id"])
        assert again["reason"].startswith("idle") and "error" not in again["detail"], again
    # straight to the job from now on; or, hibernated again, woken again: as long as curl was given
    assert _get(url, timeout_s=60) == "hello from a hibernated server\n"


def web_server(folder: Path, port: int) -> list[str]:
    """``torpor run``'s arguments for ``python -m http.server`` serving ``folder`` on 127.0.0.1:``port``."""
    return [
        "--",
        sys.executable,
        "-m",
        "http.server",
        "--bind",
        "127.0.0.1",
        "--directory",
        str(folder),
        str(port),
    ]


def _get(url: str, timeout_s: float = 5) -> str | None:
    try:
        return httpx.get(url, timeout=timeout_s).text
    except httpx.TransportError:
        return None


def test_a_periodic_checkpoint_that_fails_is_tried_again_after_an_interval_not_every_round(
    torpor: Torpor, agent: AgentProcess
) -> None:
    agent.start()
    torpor.run("run", "--name", "ring", "--checkpoint-every", "3s", *python_job("io_uring_job.py", "fd"))
    failed = agent.wait_event("checkpoint", "ring", timeout=30)
    assert "io_uring" in failed["detail"]["error"]
    since = time.monotonic()
    agent.wait_rounds(20)
    tries = [e for e in agent.events("ring") if e["action"] == "checkpoint"]
    # one try per 3 s interval (and the first), however long a loaded machine made the 20 rounds
    assert 1 <= len(tries) <= 2 + (time.monotonic() - since) / 3, [e["at"] for e in tries]
    assert torpor.job("ring")["state"] == "running"


def test_a_person_resuming_a_job_whose_ports_the_agent_holds_gets_it_back_listening(
    torpor: Torpor, agent: AgentProcess, tmp_path: Path
) -> None:
    port = free_port()
    server = web_server(tmp_path, port)
    torpor.run("run", "--name", "web", "--idle-after", "2s", "--wake-on", str(port), *server)
    agent.start("--round", "4s")  # (the last --round wins) no round comes to let go of the port in time
    agent.wait_event("hibernate", "web", timeout=60)
    agent.wait_for(lambda: f"holding 127.0.0.1:{port}" in agent.log(), 30, "the agent to hold the port")
    torpor.run("resume", "web")  # through the agent, which lets go of the port first
    assert torpor.job("web")["state"] == "running"
    assert _get(f"http://127.0.0.1:{port}/") is not None
