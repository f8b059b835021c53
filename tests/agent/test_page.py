"""The agent's web page in a real browser: Debian's chromium, headless, driven by Selenium.

A FastAPI app built with the page's and the metrics' ``add_routes`` is served by a real uvicorn on
127.0.0.1; the jobs are real (checkpointed by CRIU where marked), their events and policies are written
into the real records as the agent writes them. The tests read what the browser shows — the rendered text,
not the HTML — and the page's own reloads bring in what changed. A screenshot of the full page is saved
in the test's folder, and copied to the path in ``TORPOR_TESTS_SCREENSHOT`` when that is set (a fixed
path in /tmp would be one another user can plant a link at).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from conftest import Torpor, free_port, python_job, serving
from torpor.apps.agent import metrics, web
from torpor.apps.agent.metrics import EngineSource, Event, EventSource, Snapshot
from torpor.apps.agent.web import PolicySource
from torpor.apps.render import human_bytes
from torpor.core.engine import Engine, JobStatus
from torpor.core.recordtypes import Checkpoint, CheckpointId, CheckpointKind, Job, JobName, JobState
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
return {
  title: document.title, scripts: document.scripts.length, refresh: refresh ? refresh.content : null,
  summary: (document.getElementById('summary') || {}).innerText, body: document.body.innerText,
  jobs: rows(document, '#jobs tbody tr'), timeline: rows(document, '#timeline tbody tr'),
  checkpoints: Object.fromEntries([...document.querySelectorAll('section.checkpoints')].map(
    s => [s.dataset.job, rows(s, 'tbody tr')])),
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


def agent_app(engine: EngineSource, events: EventSource, policies: PolicySource, refresh_s: int) -> FastAPI:
    """The app as the agent wires it: the page and /metrics, on one engine and one source of events."""
    app = FastAPI()
    web.add_routes(app, engine, events, policies, refresh_s=refresh_s)
    metrics.add_routes(app, engine, events)
    return app


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


def screenshot(driver: Any, folder: Path) -> Path:
    """A PNG of the whole page (the window grown to its height), copied where TORPOR_TESTS_SCREENSHOT says."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(int(height) + 40, 600), 4000))
    path = folder / "agent-page.png"
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    if copy := os.environ.get("TORPOR_TESTS_SCREENSHOT"):
        shutil.copyfile(path, copy)
    return path


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
    assert drain["cells"]["job"] == "-" and 30 <= int(drain["cells"]["time"].removesuffix("s ago")) < 60
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
    assert periodic == "checkpoint 0123456789ab; frozen 0.43 s; image 3.0 MiB; took 2.50 s; overhead 1.23 %"
    assert cost(checkpoint="c1", restore_s=0.81, pid=4242) == "checkpoint c1; restored in 0.81 s"
    # the evacuation's report: what was saved, failed (and why) and is still pending, not its bookkeeping
    report = cost(
        why="spot", by="notice", started_at=1.0, deadline_at=2.0, order=["a", "b"], finished_at=1.5,
        saved={"a": {"freeze_s": 1.0}}, failed={"b": "criu dump failed"}, pending=[],
    )  # fmt: skip
    assert report == "saved 1; failed 1 (b: criu dump failed); pending 0"
    assert cost(deadline_s=600, flavour="new") == "deadline 600.00 s; flavour new"
    assert cost(freed_bytes=True, error="no CRIU") == "freed_bytes True; failed: no CRIU"


def test_a_policy_reads_as_one_line() -> None:
    assert web.describe_policy(JobPolicy(checkpoint_every_s=600, keep=3)) == "checkpoint every 10m, keep 3"
    assert web.describe_policy(JobPolicy()) == "-"
    assert web.describe_policy(None) == "-"
    # from the JSON API (a dict) or any other dataclass: its set fields
    listed = {"checkpoint_every_s": 600, "wake_on": [8888, 8889], "idle_after_s": None, "keep": 0}
    assert web.describe_policy(listed) == "checkpoint-every-s 600; wake-on 8888, 8889"
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
        assert cells["freeze"] == f"{first['freeze_s']:.3f} s" and cells["stored"].endswith("B")
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
            f"checkpoint {hibernated['id'][:12]}; frozen {hibernated['freeze_s']:.2f} s; image {human_bytes(hibernated['size_bytes'])}; "
            f"freed {human_bytes(hibernated['freed_rss_bytes'])}"
        )
        assert f"{human_bytes(hibernated['freed_rss_bytes'])} freed by hibernation" in shown["summary"]
        assert shown["summary"].startswith("1 hibernated, 1 running · 2 checkpoint(s)")
        screenshot(browser, tmp_path)

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
        assert later["timeline"][0]["cells"]["cost"] == f"frozen {second['freeze_s']:.2f} s"


@pytest.mark.criu
def test_the_agent_serves_its_page_and_metrics_over_tcp_to_whoever_has_the_token(
    browser: Any, torpor: Torpor, agent: AgentProcess, tmp_path: Path
) -> None:
    secret = "a-token-for-the-page-test-0123456789"
    token = tmp_path / "token"
    token.write_text(secret)
    token.chmod(0o600)
    port = free_port()
    torpor.run(
        "run", "--name", "gamma", "--checkpoint-every", "1s", "--budget", "50%", *python_job("counter.py")
    )
    agent.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token))
    agent.wait_event("checkpoint", "gamma", timeout=60)
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(url + "/").status_code == 401  # the page shows jobs' commands: not without the token
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {secret}"}})
    try:
        browser.get(url + "/")
        shown = wait_shown(
            browser,
            lambda page: (
                any(row["key"] == "gamma" for row in page["jobs"])
                and any(row["cells"].get("action") == "checkpoint" for row in page["timeline"])
            ),
            "job gamma and the agent's periodic checkpoint",
        )
        [gamma] = [row["cells"] for row in shown["jobs"] if row["key"] == "gamma"]
        assert gamma["state-cell"] == "running" and gamma["policy"] == "checkpoint every 1s"
        reasons = [row["cells"]["reason"] for row in shown["timeline"]]
        assert any(reason.startswith("agent started (pid ") for reason in reasons)
        screenshot(browser, tmp_path)
    finally:
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {}})
    scraped = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {secret}"})
    assert scraped.status_code == 200

    def counted_running() -> bool:  # checkpointed every second, the job is now and then "checkpointing"
        text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {secret}"}).text
        return 'torpor_jobs{state="running"} 1.0' in text

    torpor.wait_for(counted_running, 20, "the metrics to count job gamma as running")
