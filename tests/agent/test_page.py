"""The agent's web page in a real browser: Debian's chromium, headless, driven by Selenium.

A FastAPI app built with the page's and the metrics' ``add_routes`` is served by a real uvicorn on
127.0.0.1; the jobs are real (checkpointed by CRIU where marked), their events and policies are written
into the real records as the agent writes them. A real ``torpor agent`` on TCP shows its sign-in form,
and its page once signed in: its queue, budget and each job's memory chart. A node that cannot be made
here (an hour of memory samples, hostile job names) is drawn from a fixed view of one. The tests read
what the browser shows — the rendered text, not the HTML — and the page's own reloads bring in what
changed. Screenshots of the full page are saved in the test's folder, and copied into the folder
``TORPOR_TESTS_SCREENSHOTS`` names when that is set (a fixed path in /tmp would be one another user can
plant a link at).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from conftest import Torpor, free_port, python_job, serving
from torpor.apps.agent import login, metrics, web
from torpor.apps.agent.login import MAX_SESSIONS, SESSION_COOKIE, SESSION_LIFETIME_S, PageLogin, Sessions
from torpor.apps.agent.metrics import EngineSource, Event, EventSource, Snapshot
from torpor.apps.agent.web import HistorySource, PolicySource, QueueSource
from torpor.apps.render import human_bytes, human_duration, human_time
from torpor.core.engine import Engine, JobStatus
from torpor.core.records import Checkpoint, CheckpointId, CheckpointKind, Job, JobName, JobState
from torpor.core.store.base import StoredImage
from torpor.policy.jobpolicy import JobPolicy
from torpor.settings import Settings

from .conftest import AgentProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

# what the browser shows, read in one call (the page may reload between two): each row's key (its data-
# attribute) and class, and its cells' text by the cell's last class
READ_PAGE = """
const rows = (root, sel) => [...root.querySelectorAll(sel)].map(r => ({
  key: r.dataset.job || r.dataset.checkpoint || r.dataset.event, cls: r.className,
  cells: Object.fromEntries([...r.cells].map(c => [c.classList[c.classList.length - 1], c.innerText.trim()])),
}));
const refresh = document.querySelector('meta[http-equiv="refresh"]');
const text = (el) => el ? el.textContent : null;
return {
  title: document.title, scripts: document.scripts.length, refresh: refresh ? refresh.content : null,
  summary: (document.getElementById('summary') || {}).innerText, body: document.body.innerText,
  jobs: rows(document, '#jobs tbody tr'), timeline: rows(document, '#timeline tbody tr'),
  queue: rows(document, '#queue tbody tr'),
  checkpoints: Object.fromEntries([...document.querySelectorAll('section.checkpoints')].map(
    s => [s.dataset.job, rows(s, 'tbody tr')])),
  charts: Object.fromEntries([...document.querySelectorAll('figure.memory')].map(f => [f.dataset.job, {
    caption: f.querySelector('figcaption').innerText, title: text(f.querySelector('svg > title')),
    marks: [...f.querySelectorAll('g.mark')].map(g => [g.classList[1], text(g.querySelector('title'))]),
    points: [...f.querySelectorAll('polyline')].map(l => l.points.length).reduce((a, b) => a + b, 0),
  }])),
  svgs: document.querySelectorAll('svg').length,
  budget: text(document.querySelector('#budget svg > title')),
  budgetSummary: text(document.getElementById('budget-summary')),
  signIn: !!document.querySelector('form.sign-in'), signOut: !!document.querySelector('form.sign-out'),
  error: text(document.getElementById('sign-in-error')),
};
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Chromium headless through chromedriver, both Debian's (selenium-manager cannot download here)."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        why = f"needs Debian's chromium and chromium-driver ({', '.join(missing)} missing: run scripts/install-programs.sh)"
        if os.environ.get("TORPOR_TESTS_NEED_CRIU") == "1":
            pytest.fail(f"TORPOR_TESTS_NEED_CRIU=1, but the browser test {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    profile = tmp_path_factory.mktemp("chromium-profile")
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
        # nothing but the page: no update checks, sync or other background requests
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def agent_app(
    engine: EngineSource,
    events: EventSource,
    policies: PolicySource,
    refresh_s: int,
    history: HistorySource | None = None,
    queue: QueueSource | None = None,
) -> FastAPI:
    """The app as the agent wires it: the page and /metrics, on one engine and one source of events."""
    app = FastAPI()
    web.add_routes(app, engine, events, policies, refresh_s=refresh_s, history=history, queue=queue)
    metrics.add_routes(app, engine, events)
    return app


@dataclass
class FixedNode:
    """The engine's view of a node the test makes up (what the page reads of an engine)."""

    jobs: list[JobStatus]
    taken: list[Checkpoint] = field(default_factory=list)

    def statuses(self) -> list[JobStatus]:
        return self.jobs

    def checkpoints(self, name: str | None = None) -> list[Checkpoint]:
        return [c for c in self.taken if name is None or c.job == name]

    def image_states(self, checkpoints: list[Checkpoint]) -> dict[CheckpointId, StoredImage | None]:
        return {c.id: StoredImage(c.id, c.job, c.size_bytes, c.size_bytes // 3) for c in checkpoints}


def read_page(driver: Any) -> dict[str, Any]:
    """What the browser shows now; a read that meets a reload half-way is tried again (a few times)."""
    from selenium.common.exceptions import WebDriverException

    for attempt in range(10):
        try:
            shown: dict[str, Any] = driver.execute_script(READ_PAGE)
            return shown
        except WebDriverException:
            if attempt == 9:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def wait_shown(
    driver: Any, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30
) -> dict[str, Any]:
    """The page as the browser shows it once ``predicate`` holds, without reloading it ourselves."""
    deadline = time.monotonic() + timeout
    while True:
        shown = read_page(driver)
        if predicate(shown):
            return shown
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {what}; it shows:\n{shown['body']}")
        time.sleep(0.3)


def screenshot(driver: Any, folder: Path, name: str = "agent-page") -> Path:
    """A PNG of the whole page (the window grown to its height), copied into TORPOR_TESTS_SCREENSHOTS."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(int(height) + 40, 600), 4000))
    path = folder / f"{name}.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    if copies := os.environ.get("TORPOR_TESTS_SCREENSHOTS"):
        shutil.copyfile(path, Path(copies) / path.name)
    driver.set_window_size(1400, 1000)
    return path


#: a float as Python prints it, which a person should never have to read (0.010898351669311523)
RAW_FLOAT = re.compile(r"\d\.\d{4,}")


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


# -- a node drawn from a fixed view: an hour of samples, hostile names ---------------------------------------

MIB, GIB = 1 << 20, 1 << 30
HOSTILE_NAME = "<img src=x onerror=alert(1)>"
HOSTILE_COMMAND = "<script>document.title='pwned'</script>"


def made_up_node(
    now: float,
) -> tuple[FixedNode, dict[str, list[tuple[float, int]]], dict[str, Any], list[Event]]:
    """A node with an hour behind it: a training job checkpointed every 10 min, a notebook hibernated
    20 min ago, a job whose name and command are markup, and the scheduler's queue with one job waiting."""

    def job(name: str, state: JobState, pid: int | None, command: list[str]) -> Job:
        return Job(JobName(name), command, "/", state, pid, None, None, "/log", now - 4000, now - 4000, None, None, None, None)  # fmt: skip

    def taken(name: str, n: int, kind: CheckpointKind, at: float, size: int) -> Checkpoint:
        return Checkpoint(CheckpointId(f"{n:02x}" * 16), JobName(name), kind, at, 0.0123 * n, 0.9, size, "4.2.1", None)  # fmt: skip

    train = [
        taken("train", n, CheckpointKind.CHECKPOINT, now - 3300 + 600 * n, (2 * GIB + n * 90 * MIB))
        for n in range(6)
    ]
    notebook = [taken("notebook", 9, CheckpointKind.HIBERNATE, now - 1200, 700 * MIB)]
    hostile = [taken(HOSTILE_NAME, 10, CheckpointKind.CHECKPOINT, now - 300, 50 * MIB)]
    node = FixedNode(
        [
            JobStatus(job("train", JobState.RUNNING, 4242, ["python", "train.py", "--epochs", "90"]), 3 * GIB, train[-1]),
            JobStatus(job("notebook", JobState.HIBERNATED, None, ["jupyter", "lab"]), None, notebook[-1]),
            JobStatus(job(HOSTILE_NAME, JobState.RUNNING, 4343, ["sh", "-c", HOSTILE_COMMAND]), 60 * MIB, hostile[-1]),
        ],
        train + notebook + hostile,
    )  # fmt: skip
    steps = range(0, 3600, 5)
    history = {
        "train": [(now - 3600 + t, 2 * GIB + (t % 600) * 2 * MIB + t * 100_000) for t in steps],
        "notebook": [(now - 3600 + t, 0 if t > 2400 else 600 * MIB + (t % 300) * MIB // 3) for t in steps],
        HOSTILE_NAME: [(now - 1800 + t, 60 * MIB) for t in range(0, 1800, 5)],
    }
    queue = {
        "budget": 16 * GIB, "reserve": 3 * GIB, "held": 9 * GIB, "free": 7 * GIB, "mem_available": 22 * GIB,
        "psi_full_avg10": 0.0,
        "jobs": [
            {"name": "eval", "state": "queued", "request": 8 * GIB, "usage": 0, "limit": None, "priority": 1,
             "effective_priority": 1.2345678, "project": "ml", "submitted_at": now - 252, "waited_s": 252.123456,
             "hibernated_by": None, "why": "needs 8.0 GiB; 7.0 GiB free of the budget"},
            {"name": "train", "state": "running", "request": 6 * GIB, "usage": 3 * GIB, "limit": 7 * GIB,
             "priority": 1, "effective_priority": 1, "project": "ml", "submitted_at": now - 4000,
             "waited_s": 0.010898351669311523, "hibernated_by": None, "why": None},
            {"name": "notebook", "state": "hibernated", "request": 1 * GIB, "usage": 600 * MIB, "limit": None,
             "priority": 0, "effective_priority": 0, "project": "default", "submitted_at": now - 4000,
             "waited_s": 0.0, "hibernated_by": "reclaimed", "why": "idle"},
        ],
    }  # fmt: skip
    events = [
        Event(1, now - 4000, "train", "start", "6.0 GiB fits", {"pid": 4242, "waited_s": 0.010898351669311523, "request": 6 * GIB}),
        Event(2, now - 1200, "notebook", "hibernate", "idle: no CPU used for 15m", {"checkpoint": notebook[0].id, "freeze_s": 0.1107, "size_bytes": 700 * MIB, "freed_bytes": 640 * MIB}),
        Event(3, now - 300, HOSTILE_NAME, "checkpoint", HOSTILE_COMMAND, {"checkpoint": hostile[0].id, "freeze_s": 0.0123, "total_s": 1.53}),
    ]  # fmt: skip
    return node, history, queue, events


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


# -- signing in over TCP ------------------------------------------------------------------------------------

SECRET = "a-token-for-the-page-test-0123456789"


def cookie_of(response: httpx.Response) -> dict[str, str]:
    """The attributes of the session cookie ``response`` sets, by lower-case name (flags map to "")."""
    [header] = [h for h in response.headers.get_list("set-cookie") if h.startswith(f"{SESSION_COOKIE}=")]
    first, *attributes = (part.strip() for part in header.split(";"))
    found = {"value": first.partition("=")[2]}
    for attribute in attributes:
        name, _, value = attribute.partition("=")
        found[name.lower()] = value
    return found


def check_sign_in_over_http(url: str) -> str:
    """The form, a wrong token, the right one and what its cookie opens (the page, not the API); the
    session's id."""
    asked = httpx.get(url + "/")
    assert asked.status_code == 401 and 'name="token"' in asked.text and 'action="/login"' in asked.text
    assert "form-action 'self'" in asked.headers["content-security-policy"]
    assert asked.headers["cache-control"] == "no-store"
    assert httpx.get(url + "/v1/jobs").status_code == 401
    started = time.monotonic()
    wrong = httpx.post(url + "/login", data={"token": SECRET[:-1]})
    assert time.monotonic() - started >= login.WRONG_TOKEN_DELAY_S
    assert wrong.status_code == 401 and "That is not the agent&#x27;s token." in wrong.text
    assert "set-cookie" not in wrong.headers
    right = httpx.post(url + "/login", data={"token": SECRET})
    assert right.status_code == 303 and right.headers["location"] == "/"
    cookie = cookie_of(right)
    assert set(cookie) == {"value", "httponly", "samesite", "path", "max-age"}  # not Secure: plain HTTP
    assert cookie["samesite"].lower() == "strict" and cookie["path"] == "/"
    assert int(cookie["max-age"]) == SESSION_LIFETIME_S and len(cookie["value"]) >= 40
    session = {SESSION_COOKIE: cookie["value"]}
    page = httpx.get(url + "/", cookies=session)
    assert page.status_code == 200 and 'action="/logout"' in page.text and "<h2>Jobs</h2>" in page.text
    # the cookie opens the page only: the API asks for the bearer token still, reading or acting
    assert httpx.get(url + "/v1/jobs", cookies=session).status_code == 401
    assert httpx.get(url + "/metrics", cookies=session).status_code == 401
    assert httpx.post(url + "/v1/drain", cookies=session, json={}).status_code == 401
    unknown = httpx.get(url + "/", cookies={SESSION_COOKIE: "x" * 43})
    assert unknown.status_code == 401 and 'name="token"' in unknown.text
    assert httpx.post(url + "/login", content=b"token=" + b"a" * 5000).status_code == 413
    return cookie["value"]


def test_a_session_ends_at_its_time_or_when_signed_out_and_the_form_asks_again() -> None:
    clock = [time.time()]
    sessions = Sessions(lifetime_s=SESSION_LIFETIME_S, clock=lambda: clock[0])
    page_login = PageLogin(SECRET, sessions)
    node, history, _, events = made_up_node(time.time())
    app = FastAPI()
    app.middleware("http")(page_login.middleware())
    page_login.add_routes(app)
    web.add_routes(
        app, lambda: node, lambda: events, dict, 0, history=lambda: history, signed_in=page_login.signed_in
    )
    with serving(app) as url:
        session = check_sign_in_over_http(url)
        clock[0] += SESSION_LIFETIME_S
        expired = httpx.get(url + "/", cookies={SESSION_COOKIE: session})
        assert expired.status_code == 401 and 'name="token"' in expired.text

        # behind a TLS proxy on the same machine (it says so from 127.0.0.1): the cookie is Secure
        proxied = cookie_of(
            httpx.post(url + "/login", data={"token": SECRET}, headers={"X-Forwarded-Proto": "https"})
        )
        assert "secure" in proxied and proxied["samesite"].lower() == "strict"
        second = cookie_of(httpx.post(url + "/login", data={"token": SECRET}))["value"]
        out = httpx.post(url + "/logout", cookies={SESSION_COOKIE: second})
        assert out.status_code == 303 and cookie_of(out)["max-age"] == "0"
        assert httpx.get(url + "/", cookies={SESSION_COOKIE: second}).status_code == 401


def sign_in_with_the_browser(browser: Any, url: str, folder: Path) -> None:
    """The form in the browser: a wrong token says so, the right one opens the page with its cookie."""
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(url + "/")
    shown = read_page(browser)
    assert shown["signIn"] and not shown["jobs"] and shown["scripts"] == 0
    screenshot(browser, folder, "sign-in")
    browser.find_element(By.ID, "token").send_keys("not-the-token-at-all")
    browser.find_element(By.CSS_SELECTOR, "form.sign-in button").click()
    shown = wait_shown(browser, lambda page: bool(page["error"]), "the sign-in error")
    assert shown["error"] == "That is not the agent's token." and shown["signIn"]
    screenshot(browser, folder, "sign-in-wrong")
    browser.find_element(By.ID, "token").send_keys(SECRET)
    browser.find_element(By.CSS_SELECTOR, "form.sign-in button").click()
    wait_shown(browser, lambda page: page["signOut"] and bool(page["summary"]), "the page after signing in")
    cookie = browser.get_cookie(SESSION_COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert not cookie["secure"] and abs(cookie["expiry"] - (time.time() + SESSION_LIFETIME_S)) < 120
    assert browser.execute_script("return document.cookie") == ""  # HttpOnly: no script could read it


def sign_out_with_the_browser(browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, "form.sign-out button").click()
    wait_shown(browser, lambda page: page["signIn"], "the form after signing out")
    assert browser.get_cookie(SESSION_COOKIE) is None


@pytest.mark.criu
@pytest.mark.timeout(300)
def test_over_tcp_the_agent_asks_for_the_token_once_then_shows_its_jobs_queue_budget_and_charts(
    browser: Any, torpor: Torpor, agent: AgentProcess, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(SECRET)
    token.chmod(0o600)
    port = free_port()
    sleeper = [sys.executable, "-c", "import time; time.sleep(100000)"]
    torpor.run(
        "run", "--name", "gamma", "--checkpoint-every", "4s", "--budget", "50%", *python_job("counter.py")
    )
    torpor.run("run", "--name", "delta", "--", *sleeper)
    agent.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", "1G")
    url = f"http://127.0.0.1:{port}"
    torpor.run("submit", "--name", "holder", "--memory", "600M", "--", *sleeper)
    torpor.wait_for(
        lambda: {j["name"]: j["state"] for j in torpor.json("queue")["jobs"]}.get("holder") == "running",
        what="the holder to run",
    )
    torpor.run("submit", "--name", "waiter", "--memory", "500M", "--project", "eval", "--", *sleeper)
    agent.wait_event("checkpoint", "gamma", timeout=60)
    time.sleep(11)  # two samples of delta's memory before it sleeps (one each 5 s)
    torpor.run("hibernate", "delta", "--wait")
    check_sign_in_over_http(url)
    sign_in_with_the_browser(browser, url, tmp_path)

    shown = wait_shown(
        browser,
        lambda page: (
            page["charts"].get("gamma", {}).get("points", 0) >= 3
            and len(page["charts"]["gamma"]["marks"]) >= 2
            and any(row["key"] == "waiter" for row in page["queue"])
        ),
        "gamma's memory with its checkpoints, and the waiter in the queue",
        timeout=60,
    )
    jobs = {row["key"]: row["cells"] for row in shown["jobs"]}
    assert (
        jobs["gamma"]["state-cell"] in ("running", "checkpointing")
        and jobs["gamma"]["policy"] == "checkpoint every 4s"
    )
    assert jobs["delta"]["state-cell"].startswith("hibernated")
    assert shown["charts"]["delta"]["marks"][-1][0] == "hibernate" and shown["charts"]["delta"]["points"] >= 2
    assert " · sampled since " in shown["charts"]["gamma"]["caption"]  # an agent started within the hour
    queued = {row["key"]: row["cells"] for row in shown["queue"]}
    assert next(iter(queued)) == "waiter" and queued["waiter"]["state-cell"] == "queued"
    assert queued["waiter"]["request"] == "500.0 MiB" and queued["waiter"]["project"] == "eval"
    assert queued["waiter"]["since"].splitlines()[1].endswith(" ago")
    assert queued["holder"]["state-cell"] == "running" and queued["holder"]["request"] == "600.0 MiB"
    assert shown["budget"].startswith("Memory budget 1.0 GiB: held ")
    assert not RAW_FLOAT.search(shown["body"]), RAW_FLOAT.findall(shown["body"])
    screenshot(browser, tmp_path, "agent-over-tcp")
    sign_out_with_the_browser(browser)

    # Prometheus brings the bearer token, and nothing else is asked of it
    scraped = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {SECRET}"})
    assert scraped.status_code == 200 and 'torpor_jobs{state="hibernated"} 1.0' in scraped.text
    page = httpx.get(url + "/", headers={"Authorization": f"Bearer {SECRET}"})
    assert page.status_code == 200 and 'action="/logout"' not in page.text


def test_a_session_lasts_its_lifetime_and_ends_when_signed_out() -> None:
    clock = [1_800_000_000.0]
    sessions = Sessions(lifetime_s=60, clock=lambda: clock[0])
    first, second = sessions.open(), sessions.open()
    assert first != second and len(first) >= 40
    assert sessions.valid(first) and not sessions.valid("guessed") and not sessions.valid(None)
    sessions.close(second)
    assert not sessions.valid(second)
    clock[0] += 60
    assert not sessions.valid(first)
    many = Sessions(lifetime_s=60, clock=lambda: clock[0])
    opened = [many.open() for _ in range(MAX_SESSIONS + 1)]
    assert not many.valid(opened[0]) and many.valid(opened[-1])  # the oldest goes first
