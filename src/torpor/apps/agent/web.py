"""What the agent did, for a person: the one web page the agent serves at ``/``.

It shows the jobs (state, memory, last checkpoint, policy), each job's checkpoints (size, freeze, whether
the image is durable yet) and the timeline of the agent's automatic actions with their reason and cost.
The page is rendered on the server from one :func:`~torpor.apps.agent.metrics.read_snapshot` and reloads
itself every few seconds: no script, no asset fetched from anywhere (the agent's machine may have no
internet, and the page must work from an SSH tunnel). Job commands, event reasons and errors are user
input: every value goes through :func:`html.escape`, and the Content-Security-Policy forbids scripts
besides, so a job whose command holds ``<script>`` shows it as text.

What it leaves to others: reading the state (:mod:`torpor.apps.agent.metrics`), the events and the
policies themselves (the daemon's).
"""

from __future__ import annotations

import dataclasses
import html
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from torpor.apps.agent.metrics import EngineSource, Event, EventSource, Snapshot, read_snapshot
from torpor.apps.render import human_age, human_bytes
from torpor.core.recordtypes import Checkpoint, JobState
from torpor.core.store import DURABLE, StoredImage
from torpor.errors import TorporError

#: each job's policy as the agent holds it, by job name: anything with a ``describe()`` (the agent's
#: JobPolicy), a dataclass, a mapping or a line of text
PolicySource = Callable[[], Mapping[str, object]]

#: timeline rows shown, newest first; the rest is in ``torpor events``
TIMELINE_ROWS = 200
#: checkpoints shown per job, newest first; the rest is in ``torpor checkpoints JOB``
CHECKPOINT_ROWS = 20

#: no script may run, nothing may be fetched: the page is its own HTML and inline CSS
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
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
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font: .92em ui-monospace, monospace; overflow-wrap: anywhere; }
.state { display: inline-block; padding: 0 .5em; border-radius: .8em; font-size: .9em; background: #8882; }
.running, .durable { background: #2a72; color: #2a7; }
.hibernated, .staged { background: #37d2; color: #37d; }
.checkpointing, .hibernating, .restoring, .starting, .destaging { background: #c802; color: #c80; }
.failed, .missing, .unknown { background: #d332; color: #d33; }
th.num { text-align: right; }
tr.failed td { color: #d33; background: #d331; }
section.checkpoints table { table-layout: fixed; }
section.checkpoints th:nth-child(1) { width: 9em; }
section.checkpoints th:nth-child(2) { width: 11em; }
section.checkpoints th:nth-child(3) { width: 7em; }
section.checkpoints th:nth-child(4), section.checkpoints th:nth-child(5),
section.checkpoints th:nth-child(6) { width: 7em; }
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
    if at is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    iso = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at))
    return f'<time datetime="{e(iso)}" title="{e(stamp)}">{e(human_age(now - at))} ago</time>'


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
        f"{key.replace('_', '-')} {', '.join(map(str, value)) if isinstance(value, list | tuple) else value}"
        for key, value in items
        if value not in (None, False, (), [], "")  # unset (0 == False: a zero is unset too)
    ]
    return "; ".join(shown) or "-"


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
            parts.append(f"{label} {seconds:.2f} s")
    for key, label in (("size_bytes", "image"), ("freed_bytes", "freed")):
        if (size := number(key)) is not None:
            parts.append(f"{label} {human_bytes(int(size))}")
    for key, label in (("durable_s", "durable after"), ("total_s", "took"), ("deadline_s", "deadline")):
        if (seconds := number(key)) is not None:
            parts.append(f"{label} {seconds:.2f} s")
    if (share := number("overhead")) is not None:
        parts.append(f"overhead {share * 100:.2f} %")
    for key, value in detail.items():
        if key in used:
            continue
        if isinstance(value, Mapping):
            reasons = [f"{k}: {v}" for k, v in value.items() if isinstance(v, str)]
            parts.append(f"{key} {len(value)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
        elif isinstance(value, list | tuple):
            parts.append(f"{key} {len(value)}")
        else:
            parts.append(f"{key} {value}")
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
                f'<td class="num freeze">{e(f"{checkpoint.freeze_s:.3f} s")}</td>'
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


def render_page(snapshot: Snapshot, policies: Mapping[str, object], host: str, refresh_s: int = 5) -> str:
    """The whole page for one snapshot: a pure function of it (and of the host name it is titled with)."""
    states: dict[str, int] = {}
    for status in snapshot.jobs:
        states[status.job.state] = states.get(status.job.state, 0) + 1
    counts = ", ".join(f"{count} {state}" for state, count in sorted(states.items())) or "no jobs"
    stored, freed = snapshot.stored_bytes, sum(snapshot.freed_bytes().values())
    updated = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(snapshot.now))
    body = (
        f"<h1>torpor agent on {e(host)}</h1>"
        f'<p class="summary" id="summary">{e(counts)} · {e(len(snapshot.checkpoints))} checkpoint(s), '
        f"{e(human_bytes(stored))} stored · {e(human_bytes(freed))} freed by hibernation · "
        f"updated {e(updated)}" + (f", every {int(refresh_s)} s" if refresh_s > 0 else "") + "</p>"
        f"<h2>Jobs</h2>{_jobs_table(snapshot, policies)}"
        f"<h2>Checkpoints</h2>{_checkpoint_tables(snapshot)}"
        f"<h2>Automatic actions</h2>{_timeline(snapshot)}"
    )
    return _page(f"torpor agent on {host}", body, refresh_s)


def add_routes(
    app: FastAPI,
    engine: EngineSource,
    events: EventSource,
    policies: PolicySource | None = None,
    refresh_s: int = 5,
) -> None:
    """Serve the page at ``GET /`` on ``app``, reloading itself every ``refresh_s`` seconds (0: never).

    A state directory that cannot be read gives a page (503) that says why, and retries as often.
    """
    host = socket.gethostname()

    def page() -> HTMLResponse:
        try:
            snapshot = read_snapshot(engine(), events)
            held = policies() if policies is not None else {}
        except TorporError as exc:
            body = f"<h1>torpor agent on {e(host)}</h1><p class='failed'>cannot read torpor's state: {e(exc.message)}</p>"
            return HTMLResponse(_page("torpor agent", body, refresh_s), status_code=503, headers=HEADERS)
        return HTMLResponse(render_page(snapshot, held, host, refresh_s), headers=HEADERS)

    app.add_api_route(
        "/",
        page,
        methods=["GET"],
        response_class=HTMLResponse,
        summary="The agent's page: jobs, checkpoints and the timeline of its automatic actions",
    )
