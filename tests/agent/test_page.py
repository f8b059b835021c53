"""The agent's web page in a real browser: Debian's chromium, headless, driven by Selenium.

A FastAPI app built with the page's and the metrics' ``add_routes`` is served by a real uvicorn on
127.0.0.1; the jobs are real (checkpointed by CRIU where marked), their events and policies are written
into the real records as the agent writes them. A node that cannot be made here (an hour of memory
samples, hostile job names) is drawn from a made-up view of one. The tests read what the browser shows —
the rendered text, not the HTML — and the page's own reloads bring in what changed. Signing in over TCP
is test_page_login.py's.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Torpor, python_job, serving
from torpor.apps.agent import web
from torpor.apps.agent.metrics import Event, Snapshot
from torpor.apps.render import human_bytes, human_duration, human_time
from torpor.core.engine import Engine, JobStatus
from torpor.core.recordtypes import Checkpoint, CheckpointId, CheckpointKind, Job, JobName, JobState
from torpor.policy.jobpolicy import JobPolicy
from torpor.settings import Settings

from .browsing import (
    HOSTILE_COMMAND,
    HOSTILE_NAME,
    RAW_FLOAT,
    agent_app,
    browser,
    made_up_node,
    read_page,
    screenshot,
    wait_shown,
)

__all__ = ["browser"]  # the fixture, for pytest
# one browser for the module: make suite runs the browser tests on one worker
pytestmark = pytest.mark.xdist_group("chromium")


def test_an_empty_node_shows_the_timeline_and_an_unreadable_one_why(
    browser: Any, torpor: Torpor, tmp_path: Path
) -> None:
    events: list[Any] = [
        Event(1, time.time() - 90, None, "notice", "spot instance-action for 2026-12-01T15:00:00Z", {}),
        Event(2, time.time() - 30, None, "drain", "torpor drain", {"error": "<i>no</i> CRIU here"}),
    ]
    with serving(agent_app(torpor.engine, lambda: events, dict, refresh_s=5)) as url:
        browser.get(url)
        shown = read_page(browser)
        response = httpx.get(url, timeout=30)
    assert shown["title"] == f"torpor agent on {socket.gethostname()}"
    assert shown["refresh"] == "5" and shown["scripts"] == 0
    assert "No jobs on this node." in shown["body"] and "No checkpoints." in shown["body"]
    assert shown["summary"].startswith("no jobs · 0 checkpoint(s), 0 B stored · 0 B freed by hibernation")
    # newest first; a failure is marked and says why, its markup shown as text
    assert [row["cells"]["action"] for row in shown["timeline"]] == ["drain", "notice"]
    drain = shown["timeline"][0]
    assert drain["cls"] == "failed" and drain["cells"]["cost"] == "failed: <i>no</i> CRIU here"
    stamp, age = drain["cells"]["time"].splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", stamp) and stamp == time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(events[1].at)
    )
    assert drain["cells"]["job"] == "-" and 30 <= int(age.removesuffix(" s ago")) < 60
    assert response.headers["content-security-policy"].startswith("default-src 'none'")
    assert response.headers["content-type"].startswith("text/html")

    home = tmp_path / "not-a-folder"
    home.write_text("")
    with serving(agent_app(lambda: Engine(Settings(home=home)), list, dict, refresh_s=5)) as url:
        response = httpx.get(url, timeout=30)
        browser.get(url)
        shown = read_page(browser)
    assert response.status_code == 503
    assert "cannot read torpor's state:" in shown["body"] and str(home) in shown["body"]
    assert shown["refresh"] == "5"  # it tries again by itself


def test_each_actions_cost_reads_as_words() -> None:
    def cost(**detail: object) -> str:
        return web.describe_cost(Event(1, 0.0, "j", "act", "why", detail))

    assert cost() == "-"
    periodic = cost(
        checkpoint="0123456789abcdef", freeze_s=0.4321, total_s=2.5, size_bytes=3 << 20, overhead=0.0123
    )
    assert periodic == "checkpoint 0123456789ab; frozen 432 ms; image 3.0 MiB; took 2.5 s; overhead 1.2 %"
    assert cost(checkpoint="c1", restore_s=0.81, pid=4242) == "checkpoint c1; restored in 810 ms"
    # the evacuation's report: what was saved, failed (and why) and is still pending, not its bookkeeping
    report = cost(
        why="spot", by="notice", started_at=1.0, deadline_at=2.0, order=["a", "b"], finished_at=1.5,
        saved={"a": {"freeze_s": 1.0}}, failed={"b": "criu dump failed"}, pending=[],
    )  # fmt: skip
    assert report == "saved 1; failed 1 (b: criu dump failed); pending 0"
    assert cost(deadline_s=600, flavour="new") == "deadline 10 min; flavour new"
    # the keys the page does not name itself read by their kind: a duration, a size, a time
    assert (
        cost(pid=77, waited_s=0.010898351669311523, request=314572800) == "waited 10.9 ms; request 300.0 MiB"
    )
    assert cost(limit=1 << 30, usage=900 << 20) == "limit 1.0 GiB; usage 900.0 MiB"
    assert (
        cost(cause="preempted", for_job="high", ratio=0.123456789)
        == "cause preempted; for job high; ratio 0.1235"
    )
    assert re.fullmatch(r"stamped at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", cost(stamped_at=1.8e9))
    # a known key whose value is not what it should be is shown as it is
    assert cost(freed_bytes=True, error="no CRIU") == "freed_bytes True; failed: no CRIU"
    assert cost(grace_s="soon") == "grace_s soon"
    for key, value in {"waited_s": 0.25, "memory": 1 << 20, "seen_at": 0.0, "note": "x", "n": 3}.items():
        assert web.describe_value(key, value) in {
            "250 ms",
            "1.0 MiB",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(0)),
            "x",
            "3",
        }


def test_a_policy_reads_as_one_line() -> None:
    assert web.describe_policy(JobPolicy(checkpoint_every_s=600, keep=3)) == "checkpoint every 10m, keep 3"
    assert web.describe_policy(JobPolicy()) == "-"
    assert web.describe_policy(None) == "-"
    # from the JSON API (a dict) or any other dataclass: its set fields, each value by its kind
    listed = {"checkpoint_every_s": 600, "wake_on": [8888, 8889], "idle_after_s": None, "keep": 0}
    assert web.describe_policy(listed) == "checkpoint every 10 min; wake on 8888, 8889"
    assert web.describe_policy({"budget": 0.02, "memory": 2 << 30}) == "budget 0.02; memory 2.0 GiB"
    assert web.describe_policy("idle-after 15m") == "idle-after 15m"


def test_a_long_history_shows_its_newest_rows_and_says_where_the_rest_is() -> None:
    now = time.time()
    job = Job(JobName("long"), ["sleep", "9"], "/", JobState.EXITED, None, None, None, "/log", now, now, now, 0, None, None)  # fmt: skip
    checkpoints = [
        Checkpoint(CheckpointId(f"c{n:03}"), job.name, CheckpointKind.CHECKPOINT, now - 100 + n, 0.1, 0.2, 1 << 20, "4.2.1", None)
        for n in range(web.CHECKPOINT_ROWS + 5)
    ]  # fmt: skip
    events = [
        Event(n, now - 1000 + n, "long", "checkpoint", "every 10m") for n in range(web.TIMELINE_ROWS + 7)
    ]
    page = web.render_page(
        Snapshot(now, [JobStatus(job, None, checkpoints[-1])], checkpoints, {}, events), {}, "h"
    )
    shown = re.findall(r'data-checkpoint="(c\d+)"', page)
    assert shown == [f"c{n:03}" for n in reversed(range(5, web.CHECKPOINT_ROWS + 5))]
    assert "5 older: see <code>torpor checkpoints long</code>." in page
    assert [int(n) for n in re.findall(r'data-event="(\d+)"', page)] == list(
        reversed(range(7, web.TIMELINE_ROWS + 7))
    )
    assert "7 older action(s): see <code>torpor events</code>." in page
    assert page.count('class="state missing"') == web.CHECKPOINT_ROWS + 1  # no image: each row and the job's


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_the_page_shows_the_jobs_their_checkpoints_and_the_timeline(
    browser: Any, torpor: Torpor, tmp_path: Path
) -> None:
    marked = "<script>document.title='pwned'</script>"
    torpor.run("run", "--name", "alpha", *python_job("counter.py"))
    torpor.run("run", "--name", "beta", "--", sys.executable, "-c", "import time; time.sleep(3600)", marked)
    torpor.wait_log("alpha", "step 3")
    first = torpor.json("checkpoint", "alpha", "--wait")
    torpor.wait_for(lambda: torpor.job("beta")["rss_bytes"] is not None, what="beta to have processes")
    hibernated = torpor.json("hibernate", "beta", "--wait")
    # what the agent would have recorded, in its records (oldest first)
    engine = torpor.engine()
    records = engine.records
    records.add_event("alpha", "adopt", "running when the agent started")
    records.add_event(
        "beta", "hibernate", "no CPU for 15m <b>at all</b>", checkpoint=hibernated["id"],
        freeze_s=hibernated["freeze_s"], size_bytes=hibernated["size_bytes"], freed_bytes=hibernated["freed_rss_bytes"],
    )  # fmt: skip
    records.add_event("alpha", "checkpoint", "every 10m", error="criu dump failed: io_uring")
    records.set_policy(JobName("alpha"), JobPolicy(checkpoint_every_s=600, keep=3, priority=2))
    records.set_policy(JobName("beta"), JobPolicy(idle_after_s=900, wake_on=(8888, 8889)))

    def policies() -> dict[str, object]:
        return {name: care.policy for name, care in records.cares().items()}

    with serving(agent_app(lambda: engine, records.events, policies, refresh_s=2)) as url:
        browser.get(url)
        shown = read_page(browser)
        assert shown["refresh"] == "2"

        jobs = {row["key"]: row["cells"] for row in shown["jobs"]}
        assert list(jobs) == ["alpha", "beta"]
        alpha, beta = jobs["alpha"], jobs["beta"]
        assert alpha["state-cell"] == "running" and alpha["pid"] == str(torpor.job("alpha")["pid"])
        assert alpha["memory"].endswith("MiB") and float(alpha["memory"].split()[0]) > 1
        assert first["id"][:12] in alpha["last-checkpoint"] and alpha["last-checkpoint"].endswith("durable")
        assert alpha["policy"] == "checkpoint every 10m, keep 3; priority 2"
        # the state, and under it the record's message
        assert beta["state-cell"].splitlines() == ["hibernated", f"hibernated as {hibernated['id'][:12]}"]
        assert beta["pid"] == "-" and beta["memory"] == "-"
        assert beta["policy"] == "hibernate after 15m idle; wake on port 8888,8889"
        # the command is user input: shown as the text it is, never run
        assert beta["command"].endswith(marked)
        assert shown["scripts"] == 0 and shown["title"] != "pwned"

        [alpha_first] = shown["checkpoints"]["alpha"]
        assert alpha_first["key"] == first["id"]
        cells = alpha_first["cells"]
        assert (cells["kind"], cells["image"], cells["size"]) == (
            "checkpoint",
            "durable",
            human_bytes(first["size_bytes"]),
        )
        assert cells["freeze"] == human_duration(first["freeze_s"]) and cells["stored"].endswith("B")
        [beta_hibernate] = shown["checkpoints"]["beta"]
        assert (
            beta_hibernate["cells"]["kind"] == "hibernate" and beta_hibernate["cells"]["image"] == "durable"
        )

        timeline = shown["timeline"]
        assert [(row["cells"]["job"], row["cells"]["action"]) for row in timeline] == [
            ("alpha", "checkpoint"), ("beta", "hibernate"), ("alpha", "adopt"),
        ]  # fmt: skip
        failed, hibernate, _ = (row["cells"] for row in timeline)
        assert timeline[0]["cls"] == "failed" and failed["cost"] == "failed: criu dump failed: io_uring"
        assert hibernate["reason"] == "no CPU for 15m <b>at all</b>"
        assert hibernate["cost"] == (
            f"checkpoint {hibernated['id'][:12]}; frozen {human_duration(hibernated['freeze_s'])}; image {human_bytes(hibernated['size_bytes'])}; "
            f"freed {human_bytes(hibernated['freed_rss_bytes'])}"
        )
        assert f"{human_bytes(hibernated['freed_rss_bytes'])} freed by hibernation" in shown["summary"]
        assert shown["summary"].startswith("1 hibernated, 1 running · 2 checkpoint(s)")
        # no history given: each job's chart has no line, but its checkpoint or hibernation is on it
        assert shown["charts"]["alpha"]["marks"][0][0] == "checkpoint"
        assert shown["charts"]["beta"]["marks"][0] == [
            "hibernate",
            f"hibernate {hibernated['id'][:12]} at {human_time(hibernated['created_at'])}: image "
            f"{human_bytes(hibernated['size_bytes'])}, frozen {human_duration(hibernated['freeze_s'])}",
        ]
        assert not RAW_FLOAT.search(shown["body"]), shown["body"]
        screenshot(browser, tmp_path, "jobs-and-checkpoints")

        # what happens next shows up by itself: the page reloads (no driver.get here)
        second = torpor.json("checkpoint", "alpha")
        records.add_event("alpha", "checkpoint", "every 10m", freeze_s=second["freeze_s"])
        later = wait_shown(
            browser,
            lambda page: (
                any(row["key"] == second["id"] for row in page["checkpoints"].get("alpha", []))
                and len(page["timeline"]) == 4
            ),
            f"checkpoint {second['id']} and the 4th event",
        )
        assert [row["key"] for row in later["checkpoints"]["alpha"]] == [second["id"], first["id"]]
        assert later["timeline"][0]["cells"]["cost"] == f"frozen {human_duration(second['freeze_s'])}"


def test_a_nodes_hour_is_drawn_and_every_value_reads_for_a_person_and_stays_text(
    browser: Any, tmp_path: Path
) -> None:
    now = time.time()
    node, history, queue, events = made_up_node(now)
    app = agent_app(lambda: node, lambda: events, dict, 0, lambda: history, lambda: queue)
    with serving(app) as url:
        browser.get(url)
        shown = read_page(browser)
        # values for a person: no float as Python prints it anywhere on the page
        assert not RAW_FLOAT.search(shown["body"]), RAW_FLOAT.findall(shown["body"])
        assert shown["scripts"] == 0 and shown["title"] != "pwned"
        # markup in a name or a command is text, in the tables and in the charts alike
        assert [row["key"] for row in shown["jobs"]] == ["train", "notebook", HOSTILE_NAME]
        assert shown["jobs"][2]["cells"]["command"] == f"sh -c {HOSTILE_COMMAND}"
        assert browser.execute_script("return document.querySelectorAll('img').length") == 0
        charted = shown["charts"]
        assert set(charted) == {"train", "notebook", HOSTILE_NAME}  # (the browser's dict comes sorted)
        assert charted[HOSTILE_NAME]["title"].startswith(
            f"Memory of {HOSTILE_NAME} over the last hour: now 60.0 MiB"
        )
        assert charted[HOSTILE_NAME]["caption"].startswith(HOSTILE_NAME)
        # an hour of samples, every checkpoint and the hibernation marked, each with what it was
        assert (
            charted["train"]["points"] in (719, 720)
            and [kind for kind, _ in charted["train"]["marks"]] == ["checkpoint"] * 6
        )
        assert charted["train"]["caption"].endswith(
            f"now {human_bytes(history['train'][-1][1])} · peak {human_bytes(max(b for _, b in history['train']))}"
        )
        [(kind, label)] = charted["notebook"]["marks"]
        assert kind == "hibernate" and label == (
            f"hibernate {'09' * 6} at {human_time(now - 1200)}: image 700.0 MiB, frozen 111 ms"
        )
        assert shown["svgs"] == 4  # three jobs' memory and the budget
        assert shown["budget"] == "Memory budget 16.0 GiB: held 9.0 GiB (56%), free 7.0 GiB"
        assert shown["budgetSummary"] == (
            "budget 16.0 GiB: 9.0 GiB held, 7.0 GiB free · the machine has 22.0 GiB available · reserve 3.0 GiB"
        )
        queued = {row["key"]: row["cells"] for row in shown["queue"]}
        assert list(queued) == ["eval", "train", "notebook"]
        assert queued["eval"]["priority"] == "1 (aged 1.23)" and queued["eval"]["request"] == "8.0 GiB"
        assert queued["eval"]["since"].splitlines() == [human_time(now - 252), "4 min 12 s ago"]
        assert queued["eval"]["why"] == "needs 8.0 GiB; 7.0 GiB free of the budget"
        assert (
            queued["notebook"]["state-cell"] == "hibernated (reclaimed)" and queued["train"]["since"] == "-"
        )
        start = next(row for row in shown["timeline"] if row["cells"]["action"] == "start")
        assert start["cells"]["cost"] == "waited 10.9 ms; request 6.0 GiB"
        assert [row["cells"]["freeze"] for row in shown["checkpoints"]["train"]][-2:] == ["12.3 ms", "0 s"]
        screenshot(browser, tmp_path, "synthetic-page")
        dark = {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
        browser.execute_cdp_cmd("Emulation.setEmulatedMedia", dark)
        try:
            browser.refresh()
            screenshot(browser, tmp_path, "synthetic-page-dark")
        finally:
            browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
