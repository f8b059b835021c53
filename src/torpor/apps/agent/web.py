"""What the agent did, for a person: the one web page the agent serves at ``/``.

It shows the jobs (state, memory, last checkpoint, policy) and each one's memory over the last hour with
its checkpoints and hibernations marked, the scheduler's budget (held against free) and queue, each job's
checkpoints (size, freeze, whether the image is durable yet) and the timeline of the agent's automatic
actions with their reason and cost. Every value is written for a person: sizes in MiB or GiB, durations
as ``10.9 ms`` or ``4 min 12 s``, times as local time and how long ago.

The page is rendered on the server from one :func:`~torpor.apps.agent.metrics.read_snapshot` and reloads
itself every few seconds: no script, no asset fetched from anywhere (the agent's machine may have no
internet, and the page must work from an SSH tunnel); its charts are inline SVG. Job commands, event
reasons and errors are user input: every value goes through :func:`html.escape`, and the
Content-Security-Policy forbids scripts besides, so a job whose command holds ``<script>`` shows it as
text.

What it leaves to others: reading the state (:mod:`torpor.apps.agent.metrics`), the memory samples
(:mod:`~torpor.apps.agent.history`), drawing the charts (:mod:`~torpor.apps.agent.charts`), signing in over
TCP (:mod:`~torpor.apps.agent.login`), the events and the policies themselves (the daemon's).
"""

from __future__ import annotations

import dataclasses
import html
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from torpor.apps.agent import charts
from torpor.apps.agent.metrics import EngineSource, Event, EventSource, Snapshot, read_snapshot
from torpor.apps.render import human_ago, human_bytes, human_duration, human_time
from torpor.core.recordtypes import Checkpoint, CheckpointKind, JobState
from torpor.core.store import DURABLE, StoredImage
from torpor.errors import TorporError

#: each job's policy as the agent holds it, by job name: anything with a ``describe()`` (the agent's
#: JobPolicy), a dataclass, a mapping or a line of text
PolicySource = Callable[[], Mapping[str, object]]
#: each job's memory samples, (time, bytes) oldest first, by job name (the agent's MemoryHistory)
HistorySource = Callable[[], Mapping[str, Sequence[tuple[float, int]]]]
#: the scheduler's queue and budget, as ``GET /v1/queue`` gives them (``Scheduling.queue``)
QueueSource = Callable[[], Mapping[str, Any]]
#: whether a request came with a session of the sign-in form (it gets a button to sign out)
SignedIn = Callable[[Request], bool]

#: timeline rows shown, newest first; the rest is in ``torpor events``
TIMELINE_ROWS = 200
#: checkpoints shown per job, newest first; the rest is in ``torpor checkpoints JOB``
CHECKPOINT_ROWS = 20

#: no script may run, nothing may be fetched: the page is its own HTML, inline CSS and SVG; a form may post
#: only to the agent (the sign-in form, the button to sign out)
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

_STYLE = """
:root { color-scheme: light dark; --line: #8884; --muted: #888; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em 2em; }
h1 { font-size: 1.4em; margin: 0 0 .2em; }
h2 { font-size: 1.15em; margin: 1.6em 0 .4em; }
h3 { font-size: 1em; margin: 1em 0 .3em; }
p.summary, .muted { color: var(--muted); }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .25em 1.2em .25em 0; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { font-weight: 600; font-size: .85em; text-transform: uppercase; color: var(--muted); }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code { font: .92em ui-monospace, monospace; overflow-wrap: anywhere; }
.state { display: inline-block; padding: 0 .5em; border-radius: .8em; font-size: .9em; background: #8882; }
.running, .durable { background: #2a72; color: #2a7; }
.hibernated, .staged { background: #37d2; color: #37d; }
.checkpointing, .hibernating, .restoring, .starting, .destaging { background: #c802; color: #c80; }
.failed, .missing, .unknown { background: #d332; color: #d33; }
th.num { text-align: right; }
tr.failed td { color: #d33; background: #d331; }
section.checkpoints table { table-layout: fixed; }
section.checkpoints th:nth-child(1) { width: 13em; }
section.checkpoints th:nth-child(2) { width: 11em; }
section.checkpoints th:nth-child(3) { width: 7em; }
section.checkpoints th:nth-child(4), section.checkpoints th:nth-child(5),
section.checkpoints th:nth-child(6) { width: 7em; }
time { white-space: nowrap; }
.age { display: block; font-size: .85em; color: var(--muted); white-space: nowrap; }
header { display: flex; justify-content: space-between; align-items: baseline; gap: 1em; }
form.sign-out button, form.sign-in button { font: inherit; padding: .2em .9em; cursor: pointer; }
.charts { display: flex; flex-wrap: wrap; gap: .8em 2em; }
figure { margin: 0; }
figcaption { font-size: .9em; margin-bottom: .2em; }
figcaption b { margin-right: .6em; }
svg { display: block; max-width: 100%; height: auto; overflow: visible; }
#budget { max-width: 560px; margin: .3em 0 .6em; }
main.sign-in { max-width: 26em; margin: 12vh auto; }
form.sign-in { display: grid; gap: .5em; margin: 1em 0; }
form.sign-in input { font: inherit; padding: .35em .5em; }
p.error { color: #d33; }
main.sign-in code { white-space: nowrap; }
"""

#: the words a badge is coloured by: job states and image states
_STATE_CLASSES = {state.value for state in JobState} | {
    "durable",
    "staged",
    "destaging",
    "missing",
    "unknown",
}


def e(value: object) -> str:
    """``value`` as HTML text: every value on the page passes here (names, commands, reasons are input)."""
    return html.escape(str(value), quote=True)


def _when(at: float | None, now: float) -> str:
    """A moment as local time, and under it how long ago."""
    if at is None:
        return "-"
    iso = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at))
    return f'<time datetime="{e(iso)}">{e(human_time(at))}</time> <span class="age">{e(human_ago(now - at))}</span>'


def _badge(text: str) -> str:
    word = text.split()[0] if text else ""
    css = word if word in _STATE_CLASSES else ""
    return f'<span class="state {e(css)}">{e(text)}</span>'


def describe_policy(policy: object) -> str:
    """One line of text for a job's policy: its own ``describe()`` if it has one (the agent's JobPolicy
    does), else a dataclass's or mapping's set fields, else its text."""
    if policy is None:
        return "-"
    describe = getattr(policy, "describe", None)
    if callable(describe):
        return str(describe())
    items: list[tuple[str, Any]]
    if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
        items = [(f.name, getattr(policy, f.name)) for f in dataclasses.fields(policy)]
    elif isinstance(policy, Mapping):
        items = list(policy.items())
    else:
        return str(policy)
    shown = [
        f"{_label(key)} {describe_value(key, value)}"
        for key, value in items
        if value not in (None, False, (), [], "")  # unset (0 == False: a zero is unset too)
    ]
    return "; ".join(shown) or "-"


#: keys of sizes in bytes whose name does not end in ``_bytes`` (the scheduler's; a policy's ``budget`` is
#: a share of time, not one of them)
_SIZE_KEYS = frozenset({"request", "limit", "usage", "memory", "share", "borrow_limit", "held", "free"})


def describe_value(key: str, value: object) -> str:
    """A value of an event's detail or a policy, for a person, by its key: ``…_s`` a duration, ``…_bytes``
    (and the scheduler's ``request``, ``limit``, ``usage``…) a size, ``…_at`` a time; a list is joined,
    another float shortened. Anything else, or a value that is not the number its key says, as its text."""
    if isinstance(value, list | tuple):
        return ", ".join(str(item) for item in value)
    if not isinstance(value, int | float) or isinstance(value, bool):
        return str(value)
    if key.endswith("_s"):
        return human_duration(value)
    if key.endswith("_bytes") or key in _SIZE_KEYS:
        return human_bytes(int(value))
    if key.endswith("_at"):
        return human_time(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _label(key: str) -> str:
    """A detail's key as words: ``waited_s`` is ``waited``, ``for_job`` is ``for job``, ``seen_at`` is
    ``seen at``."""
    for suffix in ("_s", "_bytes"):
        if key.endswith(suffix) and len(key) > len(suffix):
            key = key.removesuffix(suffix)
            break
    return key.replace("_", " ")


#: detail keys that say what, not what it cost (the evacuation report's bookkeeping, a pid)
_NOT_COSTS = frozenset({"pid", "why", "by", "order", "started_at", "deadline_at", "finished_at"})


def describe_cost(event: Event) -> str:
    """What an action made and cost (checkpoint, frozen, image, freed, durable after…), as text; a failure
    says why. Keys the page does not know are shown as they are (a count for a collection)."""
    detail = event.detail
    parts: list[str] = []
    #: the keys shown in words (a known key whose value is not what it should be is shown as it is)
    used = {"error"} | _NOT_COSTS
    if isinstance(checkpoint := detail.get("checkpoint"), str):
        parts.append(f"checkpoint {checkpoint[:12]}")
        used.add("checkpoint")

    def number(key: str) -> float | None:
        value = detail.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        used.add(key)
        return float(value)

    for key, label in (("freeze_s", "frozen"), ("restore_s", "restored in")):
        if (seconds := number(key)) is not None:
            parts.append(f"{label} {human_duration(seconds)}")
    for key, label in (("size_bytes", "image"), ("freed_bytes", "freed")):
        if (size := number(key)) is not None:
            parts.append(f"{label} {human_bytes(int(size))}")
    for key, label in (("durable_s", "durable after"), ("total_s", "took"), ("deadline_s", "deadline")):
        if (seconds := number(key)) is not None:
            parts.append(f"{label} {human_duration(seconds)}")
    if (share := number("overhead")) is not None:
        parts.append(f"overhead {share * 100:.2g} %")
    for key, value in detail.items():
        if key in used:
            continue
        if isinstance(value, Mapping):
            reasons = [f"{k}: {v}" for k, v in value.items() if isinstance(v, str)]
            parts.append(f"{_label(key)} {len(value)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
        elif isinstance(value, list | tuple):
            parts.append(f"{_label(key)} {len(value)}")
        else:
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            unit_named = _label(key) != key.replace("_", " ")  # a ``…_s`` or ``…_bytes``
            # a duration or size that is not a number: as it is, under its own name
            parts.append(f"{_label(key) if numeric or not unit_named else key} {describe_value(key, value)}")
    if detail.get("error"):
        parts.append(f"failed: {detail['error']}")
    return "; ".join(parts) or "-"


def _jobs_table(snapshot: Snapshot, policies: Mapping[str, object]) -> str:
    if not snapshot.jobs:
        return '<p class="muted" id="no-jobs">No jobs on this node.</p>'
    rows = []
    for status in snapshot.jobs:
        job = status.job
        last = status.last_checkpoint
        if last is None:
            last_text = "-"
        else:
            image = snapshot.images.get(last.id)
            last_text = (
                f"{_when(last.created_at, snapshot.now)} <code>{e(last.id[:12])}</code> "
                f"{_badge(_image_state(image))}"
            )
        state = str(job.state)
        if job.state == JobState.EXITED and job.exit_code is not None:
            state += f" ({job.exit_code})"
        message = f'<div class="muted">{e(job.message)}</div>' if job.message else ""
        rows.append(
            f'<tr data-job="{e(job.name)}">'
            f'<td class="name"><b>{e(job.name)}</b></td>'
            f'<td class="state-cell">{_badge(state)}{message}</td>'
            f'<td class="num pid">{e(job.pid) if job.pid else "-"}</td>'
            f'<td class="num memory">{e(human_bytes(status.rss_bytes))}</td>'
            f'<td class="last-checkpoint">{last_text}</td>'
            f'<td class="policy">{e(describe_policy(policies.get(job.name)))}</td>'
            f'<td class="command"><code>{e(" ".join(job.command))}</code></td>'
            "</tr>"
        )
    return (
        '<table id="jobs"><thead><tr><th>Job</th><th>State</th><th class=num>PID</th><th class=num>Memory</th>'
        "<th>Last checkpoint</th><th>Policy</th><th>Command</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


def _image_state(image: StoredImage | None) -> str:
    return image.state_text if image is not None else "missing"


def _checkpoint_tables(snapshot: Snapshot) -> str:
    if not snapshot.checkpoints:
        return '<p class="muted" id="no-checkpoints">No checkpoints.</p>'
    by_job: dict[str, list[Checkpoint]] = {}
    for checkpoint in snapshot.checkpoints:
        by_job.setdefault(checkpoint.job, []).append(checkpoint)
    sections = []
    for job, checkpoints in by_job.items():
        rows = []
        for checkpoint in list(reversed(checkpoints))[:CHECKPOINT_ROWS]:
            image = snapshot.images.get(checkpoint.id)
            stored = human_bytes(image.stored_bytes) if image is not None and image.state == DURABLE else "-"
            error = f'<div class="muted">{e(image.error)}</div>' if image is not None and image.error else ""
            rows.append(
                f'<tr data-checkpoint="{e(checkpoint.id)}">'
                f'<td class="time">{_when(checkpoint.created_at, snapshot.now)}</td>'
                f'<td class="id"><code>{e(checkpoint.id)}</code></td>'
                f'<td class="kind">{e(checkpoint.kind)}</td>'
                f'<td class="num size">{e(human_bytes(checkpoint.size_bytes))}</td>'
                f'<td class="num stored">{e(stored)}</td>'
                f'<td class="num freeze">{e(human_duration(checkpoint.freeze_s))}</td>'
                f'<td class="image">{_badge(_image_state(image))}{error}</td>'
                "</tr>"
            )
        sections.append(
            f'<section class="checkpoints" data-job="{e(job)}"><h3>{e(job)}</h3>'
            "<table><thead><tr><th>Time</th><th>Checkpoint</th><th>Kind</th><th class=num>Size</th>"
            "<th class=num>Stored</th><th class=num>Frozen</th><th>Image</th></tr></thead><tbody>"
            + "".join(rows)
            + "</tbody></table>"
            + (
                f'<p class="muted">{len(checkpoints) - CHECKPOINT_ROWS} older: see '
                f"<code>torpor checkpoints {e(job)}</code>.</p>"
                if len(checkpoints) > CHECKPOINT_ROWS
                else ""
            )
            + "</section>"
        )
    return "".join(sections)


def _timeline(snapshot: Snapshot) -> str:
    if not snapshot.events:
        return '<p class="muted" id="no-events">The agent has not acted yet.</p>'
    newest = sorted(snapshot.events, key=lambda event: (event.at, event.id), reverse=True)
    rows = [
        f'<tr data-event="{e(event.id)}" class="{"failed" if event.failed else ""}">'
        f'<td class="time">{_when(event.at, snapshot.now)}</td>'
        f'<td class="job">{e(event.job or "-")}</td>'
        f'<td class="action">{e(event.action)}</td>'
        f'<td class="reason">{e(event.reason)}</td>'
        f'<td class="cost">{e(describe_cost(event))}</td>'
        "</tr>"
        for event in newest[:TIMELINE_ROWS]
    ]
    more = len(newest) - TIMELINE_ROWS
    note = f'<p class="muted">{more} older action(s): see <code>torpor events</code>.</p>' if more > 0 else ""
    return (
        '<table id="timeline"><thead><tr><th>Time</th><th>Job</th><th>Action</th><th>Reason</th>'
        "<th>Cost</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>" + note
    )


def _page(title: str, body: str, refresh_s: int) -> str:
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s > 0 else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{refresh}'
        f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>{body}</body></html>"
    )


#: the scheduler's states in which a job holds its memory (its share of the budget bar)
_HOLDING = frozenset({"starting", "running", "hibernating"})


def _memory_charts(snapshot: Snapshot, history: Mapping[str, Sequence[tuple[float, int]]]) -> str:
    """A chart of each job's memory over the last hour, for the jobs that live, sleep or did something
    in that hour."""
    start = snapshot.now - 3600
    marks: dict[str, list[charts.Mark]] = {}
    for checkpoint in snapshot.checkpoints:
        kind = charts.HIBERNATE if checkpoint.kind == CheckpointKind.HIBERNATE else charts.CHECKPOINT
        label = (
            f"{checkpoint.kind} {checkpoint.id[:12]} at {human_time(checkpoint.created_at)}: "
            f"image {human_bytes(checkpoint.size_bytes)}, frozen {human_duration(checkpoint.freeze_s)}"
        )
        marks.setdefault(checkpoint.job, []).append(charts.Mark(checkpoint.created_at, kind, label))
    figures = []
    for status in snapshot.jobs:
        name = status.job.name
        samples = history.get(name, ())
        recent = [sample for sample in samples if sample[0] >= start]
        mine = [mark for mark in marks.get(name, []) if mark.at >= start]
        if not recent and not mine and status.job.state not in _CHARTED_STATES:
            continue
        now_text = f"now {human_bytes(recent[-1][1])}" if recent else "no samples yet"
        peak = f" · peak {human_bytes(max(size for _, size in recent))}" if recent else ""
        if recent and recent[0][0] > start + 60:  # an agent started within the hour has sampled since
            peak += f" · sampled since {human_time(recent[0][0]).split()[1]}"
        svg = charts.memory_chart(name, recent, mine, snapshot.now)
        figures.append(
            f'<figure class="memory" data-job="{e(name)}"><figcaption><b>{e(name)}</b>'
            f'<span class="muted">{e(now_text)}{e(peak)}</span></figcaption>{svg}</figure>'
        )
    if not figures:
        return ""
    return f'<h2>Memory, last hour</h2><div class="charts" id="memory-charts">{"".join(figures)}</div>'


#: job states charted even with no sample or checkpoint in the hour (an agent just started has none)
_CHARTED_STATES = frozenset({state for state in JobState if state not in (JobState.EXITED, JobState.FAILED)})


def _scheduler(queue: Mapping[str, Any], now: float) -> str:
    """The scheduler's budget (a bar: held by each job, free) and its queue."""
    budget, held, free = (
        int(queue.get("budget") or 0),
        int(queue.get("held") or 0),
        int(queue.get("free") or 0),
    )
    jobs: Sequence[Mapping[str, Any]] = queue.get("jobs") or []
    holding = [
        (str(job["name"]), max(int(job.get("request") or 0), int(job.get("usage") or 0)))
        for job in jobs
        if job.get("state") in _HOLDING
    ]
    machine = []
    if (available := queue.get("mem_available")) is not None:
        machine.append(f"the machine has {human_bytes(int(available))} available")
    if queue.get("reserve"):
        machine.append(f"reserve {human_bytes(int(queue['reserve']))}")
    summary = f"budget {human_bytes(budget)}: {human_bytes(held)} held, {human_bytes(free)} free" + "".join(
        f" · {part}" for part in machine
    )
    bar = f'<div id="budget">{charts.budget_bar(budget, holding, held)}</div>'
    if not jobs:
        table = (
            '<p class="muted" id="no-queue">No submitted jobs (<code>torpor submit</code> gives it one).</p>'
        )
    else:
        rows = []
        for job in jobs:
            state = str(job.get("state") or "-")
            if state == "hibernated" and job.get("hibernated_by"):
                state += f" ({job['hibernated_by']})"
            priority = str(job.get("priority", "-"))
            effective = job.get("effective_priority")
            if isinstance(effective, int | float) and effective != job.get("priority"):
                priority += f" (aged {effective:.3g})"
            queued = job.get("state") == "queued"
            since = _when(float(job["submitted_at"]), now) if queued and job.get("submitted_at") else "-"
            rows.append(
                f'<tr data-job="{e(job.get("name"))}">'
                f'<td class="name"><b>{e(job.get("name"))}</b></td>'
                f'<td class="state-cell">{_badge(state)}</td>'
                f'<td class="project">{e(job.get("project") or "-")}</td>'
                f'<td class="num priority">{e(priority)}</td>'
                f'<td class="num request">{e(human_bytes(job.get("request")))}</td>'
                f'<td class="num usage">{e(human_bytes(job.get("usage")) if job.get("usage") else "-")}</td>'
                f'<td class="since">{since}</td>'
                f'<td class="why">{e(job.get("why") or "-")}</td>'
                "</tr>"
            )
        table = (
            '<table id="queue"><thead><tr><th>Job</th><th>State</th><th>Project</th><th class=num>Priority</th>'
            "<th class=num>Request</th><th class=num>Using</th><th>Waiting since</th><th>Why</th></tr></thead>"
            "<tbody>" + "".join(rows) + "</tbody></table>"
        )
    return f'<h2>Scheduler</h2><p class="summary" id="budget-summary">{e(summary)}</p>{bar}{table}'


def render_page(
    snapshot: Snapshot,
    policies: Mapping[str, object],
    host: str,
    refresh_s: int = 5,
    *,
    history: Mapping[str, Sequence[tuple[float, int]]] | None = None,
    queue: Mapping[str, Any] | None = None,
    sign_out: bool = False,
) -> str:
    """The whole page for one snapshot: a pure function of it, of each job's memory ``history`` (time,
    bytes), the scheduler's ``queue`` (none: no scheduler section) and the host name it is titled with;
    ``sign_out``: with the button that ends the session of the sign-in form."""
    states: dict[str, int] = {}
    for status in snapshot.jobs:
        states[status.job.state] = states.get(status.job.state, 0) + 1
    counts = ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "no jobs"
    stored, freed = snapshot.stored_bytes, sum(snapshot.freed_bytes().values())
    updated = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(snapshot.now))
    button = (
        '<form class="sign-out" method="post" action="/logout"><button type="submit">Sign out</button></form>'
        if sign_out
        else ""
    )
    body = (
        f"<header><h1>torpor agent on {e(host)}</h1>{button}</header>"
        f'<p class="summary" id="summary">{e(counts)} · {e(len(snapshot.checkpoints))} checkpoint(s), '
        f"{e(human_bytes(stored))} stored · {e(human_bytes(freed))} freed by hibernation · "
        f"updated {e(updated)}" + (f", every {int(refresh_s)} s" if refresh_s > 0 else "") + "</p>"
        f"<h2>Jobs</h2>{_jobs_table(snapshot, policies)}"
        f"{_memory_charts(snapshot, history or {})}"
        + (_scheduler(queue, snapshot.now) if queue is not None else "")
        + f"<h2>Checkpoints</h2>{_checkpoint_tables(snapshot)}"
        f"<h2>Automatic actions</h2>{_timeline(snapshot)}"
    )
    return _page(f"torpor agent on {host}", body, refresh_s)


def render_sign_in(host: str, error: str | None = None, lifetime_s: float | None = None) -> str:
    """The form that asks for the agent's token over TCP (posted to ``/login``), with ``error`` if the
    last try was wrong."""
    problem = f'<p class="error" id="sign-in-error">{e(error)}</p>' if error else ""
    lasts = f" A session lasts {e(human_duration(lifetime_s))}." if lifetime_s else ""
    body = (
        f'<main class="sign-in"><h1>torpor agent on {e(host)}</h1>{problem}'
        '<form class="sign-in" method="post" action="/login">'
        '<label for="token">Token</label>'
        '<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>'
        '<button type="submit">Sign in</button></form>'
        '<p class="muted">The token is the content of the agent\'s <code>--token-file</code>.'
        f"{lasts}</p></main>"
    )
    return _page(f"torpor agent on {host}: sign in", body, 0)


def add_routes(
    app: FastAPI,
    engine: EngineSource,
    events: EventSource,
    policies: PolicySource | None = None,
    refresh_s: int = 5,
    *,
    history: HistorySource | None = None,
    queue: QueueSource | None = None,
    signed_in: SignedIn | None = None,
) -> None:
    """Serve the page at ``GET /`` on ``app``, reloading itself every ``refresh_s`` seconds (0: never),
    with each job's memory ``history`` and the scheduler's ``queue`` where the agent has them.

    A state directory that cannot be read gives a page (503) that says why, and retries as often.
    """
    host = socket.gethostname()

    def page(request: Request) -> HTMLResponse:
        try:
            snapshot = read_snapshot(engine(), events)
            held = policies() if policies is not None else {}
            waiting = queue() if queue is not None else None
        except TorporError as exc:
            body = f"<h1>torpor agent on {e(host)}</h1><p class='failed'>cannot read torpor's state: {e(exc.message)}</p>"
            return HTMLResponse(_page("torpor agent", body, refresh_s), status_code=503, headers=HEADERS)
        page = render_page(
            snapshot,
            held,
            host,
            refresh_s,
            history=history() if history is not None else None,
            queue=waiting,
            sign_out=signed_in is not None and signed_in(request),
        )
        return HTMLResponse(page, headers=HEADERS)

    app.add_api_route(
        "/",
        page,
        methods=["GET"],
        response_class=HTMLResponse,
        summary="The agent's page: jobs, their memory, the scheduler's queue, checkpoints and the timeline",
    )
