"""What the page's tests share: Debian's chromium driven by Selenium, what it shows read in one call, full-page
screenshots, and a node made up for the page (the engine's view of it, an hour of memory samples, the
scheduler's queue, hostile job names) where one cannot be made here.

Screenshots are saved in the test's folder, and copied into the folder ``TORPOR_TESTS_SCREENSHOTS`` names
when that is set (a fixed path in /tmp would be one another user can plant a link at).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from torpor.apps.agent import metrics, web
from torpor.apps.agent.metrics import EngineSource, Event, EventSource
from torpor.apps.agent.web import HistorySource, PolicySource, QueueSource
from torpor.core.engine import JobStatus
from torpor.core.recordtypes import Checkpoint, CheckpointId, CheckpointKind, Job, JobName, JobState
from torpor.core.store.base import StoredImage

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
