"""What a cloud's metadata service says about this machine's end, read into one :class:`Notice`.

A spot machine is taken back, a preemptible one preempted, a host goes into maintenance: AWS and GCP say
so a little ahead (AWS two minutes before a spot interruption, GCP 30 s before a preemption and 60 s
before host maintenance) through their metadata services, which the agent polls. This module knows the
two services' formats: which URLs to read for a configured ``--notice-url``/``--notice-format``
(:func:`endpoints`), with which headers, what each answer means (:func:`read`), and which notices of a
poll are new (:func:`track`). Fetching (urllib, the IMDSv2 token, timeouts) is
:mod:`torpor.adapters.notices`, polling in a thread :mod:`torpor.core.notices`; what the agent does on a
notice is :mod:`torpor.policy.evacuation`'s and the agent's.

The formats, as the services document them:

- AWS ``/latest/meta-data/spot/instance-action``: 404 while there is no interruption; then 200 with
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2017-09-18T08:22:00Z"}`` (UTC).
- AWS ``/latest/meta-data/events/maintenance/scheduled``: a JSON list of events, each with ``Code``
  (``instance-reboot``, ``system-reboot``, ``system-maintenance``, ``instance-retirement``,
  ``instance-stop``), ``NotBefore``/``NotAfter`` as ``"21 Jan 2019 09:00:43 GMT"``, ``EventId``,
  ``Description`` and ``State`` (``active``; ``canceled`` and ``completed`` ones stay listed a while).
  With IMDSv2 a token comes first: ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``,
  then every read carries ``X-aws-ec2-metadata-token``; without one (IMDSv1) reads go bare.
- GCP ``/computeMetadata/v1/instance/preempted``: ``TRUE`` or ``FALSE``;
  ``/computeMetadata/v1/instance/maintenance-event``: ``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE`` or
  ``TERMINATE_ON_HOST_MAINTENANCE``. Every request needs ``Metadata-Flavor: Google`` (refused without).

Nothing here raises on what a server answered: a body that makes no sense is not a notice, and the
:class:`Reading` says why (``problem``), for the agent to log. A bad configuration (a URL whose format
cannot be told) is a reason string from :func:`endpoints`; the caller raises.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# -- configuration -------------------------------------------------------------------------------------

AWS = "aws"
GCP = "gcp"
AUTO = "auto"
#: the values of ``--notice-format``
FORMATS = (AWS, GCP, AUTO)

# what an endpoint is, whichever URL serves it
AWS_SPOT = "aws-spot"
AWS_SCHEDULED = "aws-scheduled"
GCP_PREEMPTED = "gcp-preempted"
GCP_MAINTENANCE = "gcp-maintenance"

#: each endpoint's path on the real service; a URL whose path ends so is that endpoint
PATHS: Mapping[str, str] = {
    AWS_SPOT: "/latest/meta-data/spot/instance-action",
    AWS_SCHEDULED: "/latest/meta-data/events/maintenance/scheduled",
    GCP_PREEMPTED: "/computeMetadata/v1/instance/preempted",
    GCP_MAINTENANCE: "/computeMetadata/v1/instance/maintenance-event",
}
_BY_FORMAT: Mapping[str, tuple[str, ...]] = {
    AWS: (AWS_SPOT, AWS_SCHEDULED),
    GCP: (GCP_PREEMPTED, GCP_MAINTENANCE),
}
#: the suffix that names an endpoint in a URL (so a proxy may serve it under a prefix of its own)
_SUFFIXES: Mapping[str, str] = {
    AWS_SPOT: "/spot/instance-action",
    AWS_SCHEDULED: "/events/maintenance/scheduled",
    GCP_PREEMPTED: "/instance/preempted",
    GCP_MAINTENANCE: "/instance/maintenance-event",
}
AWS_TOKEN_PATH = "/latest/api/token"
GCP_HEADERS: tuple[tuple[str, str], ...] = (("Metadata-Flavor", "Google"),)
_GCP_HOST = "metadata.google.internal"

# -- how long each notice gives, when its answer has no time of its own ---------------------------------

#: AWS sends a spot interruption two minutes ahead (its "time" says when; this is for a body without one)
AWS_SPOT_WARNING_S = 120.0
#: GCP preempts 30 s after ``preempted`` turns TRUE
GCP_PREEMPTION_WARNING_S = 30.0
#: GCP's ``maintenance-event`` changes 60 s before the event
GCP_MAINTENANCE_WARNING_S = 60.0

# -- what a notice says ------------------------------------------------------------------------------

# kinds
SPOT = "spot"  # AWS spot interruption, GCP preemption (spot or preemptible VM)
MAINTENANCE = "maintenance"  # AWS scheduled event, GCP host maintenance
DRAIN = "drain"  # torpor drain (the agent's own)
SHUTDOWN = "shutdown"  # the agent got SIGTERM (the agent's own)

# actions: what happens to this machine's processes
TERMINATE = "terminate"
STOP = "stop"
HIBERNATE = "hibernate"
REBOOT = "reboot"
MIGRATE = "migrate"  # GCP live migration: the processes keep running
CONNECTIVITY = "connectivity"  # AWS system-maintenance: network or power work, the instance stays up

#: actions after which this machine's processes still run: nothing to evacuate
KEEPS_PROCESSES = frozenset({MIGRATE, CONNECTIVITY})

_SPOT_ACTIONS = frozenset({TERMINATE, STOP, HIBERNATE})
_AWS_EVENT_ACTIONS: Mapping[str, str] = {
    "instance-reboot": REBOOT,
    "system-reboot": REBOOT,
    "system-maintenance": CONNECTIVITY,
    "instance-retirement": TERMINATE,
    "instance-stop": STOP,
}
_AWS_EVENT_OVER = frozenset({"canceled", "completed"})
_GCP_MAINTENANCE: Mapping[str, str | None] = {
    "NONE": None,
    "MIGRATE_ON_HOST_MAINTENANCE": MIGRATE,
    "TERMINATE_ON_HOST_MAINTENANCE": TERMINATE,
}


@dataclass(frozen=True)
class Endpoint:
    """One URL to poll: what it is (``AWS_SPOT``…), the headers it needs, and where its IMDSv2 token is."""

    kind: str
    url: str
    headers: tuple[tuple[str, str], ...] = ()
    #: AWS only: where ``PUT`` gives a session token (IMDSv2); ``None``: no token flow
    token_url: str | None = None


@dataclass(frozen=True)
class Notice:
    """The machine is going away (or being worked on): what, from where, by when.

    ``kind``: :data:`SPOT`, :data:`MAINTENANCE`, or the agent's own :data:`DRAIN` and :data:`SHUTDOWN`.
    ``action``, what becomes of this machine's processes: :data:`TERMINATE`, :data:`STOP`,
    :data:`HIBERNATE`, :data:`REBOOT` (they end: :attr:`evacuate`), :data:`MIGRATE`, :data:`CONNECTIVITY`
    (they run on), or a spot action AWS may add later, as it sent it (taken to end them).
    ``source`` is the URL read (``torpor`` for the agent's own). ``text`` is one line for the log.
    ``deadline`` is epoch seconds (``None``: no deadline known, e.g. ``torpor drain``). ``key`` is the same
    for every poll that sees the same notice, so that the watcher reports it once; it leaves out
    ``deadline``, which for a format without a time is "first seen + the format's warning".
    """

    kind: str
    source: str
    deadline: float | None
    text: str
    action: str = TERMINATE
    key: str = ""

    @property
    def evacuate(self) -> bool:
        """Whether this machine's processes end (terminate, stop, hibernate, reboot): save every job."""
        return self.action not in KEEPS_PROCESSES

    def due(self, now: float, horizon_s: float) -> bool:
        """Whether to act now: no deadline, or it is at most ``horizon_s`` away (AWS schedules events days
        ahead; evacuating the moment one is listed would stop the work for nothing until then)."""
        return self.deadline is None or self.deadline - now <= horizon_s


@dataclass(frozen=True)
class Reading:
    """What one answer said: a notice or none, and what could not be understood (``problem``).

    Both may be set: an AWS spot answer whose ``time`` cannot be read is still a notice (with the format's
    default deadline), and the problem says what was wrong.
    """

    notice: Notice | None
    problem: str | None = None


NOTHING = Reading(None)


def endpoints(url: str, fmt: str = AUTO) -> tuple[Endpoint, ...] | str:
    """The endpoints to poll for ``--notice-url URL --notice-format FMT``, or why there are none.

    1. ``fmt`` ``auto`` takes the format from the URL: a path under ``/latest/`` is AWS, one under
       ``/computeMetadata/`` (or the host ``metadata.google.internal``) is GCP; anything else is refused.
    2. A URL with no path (``http://169.254.169.254``) is the service's root: every endpoint of the format
       is polled (AWS: spot/instance-action and events/maintenance/scheduled; GCP: preempted and
       maintenance-event).
    3. A URL whose path ends in one endpoint's path (``…/spot/instance-action``) is that endpoint alone;
       any other path is refused (the reason names the ones that are understood).
    4. AWS endpoints get the token URL ``/latest/api/token`` beside their ``/latest/``; GCP ones the header
       ``Metadata-Flavor: Google``.
    """
    if fmt not in FORMATS:
        return f"unknown notice format '{fmt}': use one of {', '.join(FORMATS)}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"notice URL '{url}' is not an http:// URL with a host"
    try:
        parts.port  # noqa: B018 -- reading it checks it
    except ValueError:
        return f"notice URL '{url}' has a port that is not a number from 0 to 65535"
    if parts.query or parts.fragment:
        return f"notice URL '{url}' has a query or fragment; give the metadata endpoint's plain URL"
    path = parts.path.rstrip("/")
    if fmt == AUTO:
        if "/latest/" in path + "/":
            fmt = AWS
        elif "/computeMetadata/" in path + "/" or parts.hostname == _GCP_HOST:
            fmt = GCP
        else:
            return (
                f"cannot tell the format of notice URL '{url}' from its path; give --notice-format aws or gcp"
            )
    kinds = _BY_FORMAT[fmt]
    if not path:
        return tuple(_endpoint(kind, parts.scheme, parts.netloc, PATHS[kind]) for kind in kinds)
    for kind in kinds:
        if path.endswith(_SUFFIXES[kind]):
            return (_endpoint(kind, parts.scheme, parts.netloc, path),)
    known = ", ".join(f"…{_SUFFIXES[kind]}" for kind in kinds)
    return f"notice URL '{url}' is none of the {fmt} endpoints torpor reads ({known}), nor the service's root"


def _endpoint(kind: str, scheme: str, netloc: str, path: str) -> Endpoint:
    url = urlunsplit((scheme, netloc, path, "", ""))
    if kind in (GCP_PREEMPTED, GCP_MAINTENANCE):
        return Endpoint(kind, url, GCP_HEADERS)
    # the token lives beside this /latest/ (a proxy may serve the service under a prefix)
    prefix = path[: path.find("/latest/")] if "/latest/" in path else ""
    return Endpoint(kind, url, (), urlunsplit((scheme, netloc, prefix + AWS_TOKEN_PATH, "", "")))


def read(endpoint: Endpoint, status: int, body: bytes, now: float) -> Reading:
    """What ``endpoint`` answering HTTP ``status`` with ``body`` at ``now`` (epoch seconds) means."""
    if endpoint.kind == AWS_SPOT:
        return _aws_spot(endpoint, status, body, now)
    if endpoint.kind == AWS_SCHEDULED:
        return _aws_scheduled(endpoint, status, body)
    if endpoint.kind == GCP_PREEMPTED:
        return _gcp_preempted(endpoint, status, body, now)
    if endpoint.kind == GCP_MAINTENANCE:
        return _gcp_maintenance(endpoint, status, body, now)
    return Reading(None, f"{endpoint.url}: unknown endpoint kind '{endpoint.kind}'")


def _unexpected(endpoint: Endpoint, status: int, body: bytes) -> Reading:
    return Reading(None, f"{endpoint.url} answered HTTP {status}: {_excerpt(body)}")


def _excerpt(body: bytes, limit: int = 80) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    if not text:
        return "(empty)"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _json(body: bytes) -> Any:
    """The decoded JSON, or ``None`` for a body that is not JSON (the callers check the shape)."""
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _aws_spot(endpoint: Endpoint, status: int, body: bytes, now: float) -> Reading:
    if status == 404:
        return NOTHING
    if status != 200:
        return _unexpected(endpoint, status, body)
    answer = _json(body)
    action = answer.get("action") if isinstance(answer, dict) else None
    if not isinstance(action, str) or not action:
        return Reading(None, f"{endpoint.url}: not a spot instance-action (no action): {_excerpt(body)}")
    problems = []
    if action not in _SPOT_ACTIONS:
        # a new action AWS added: the instance is still being interrupted, so it is a notice
        problems.append(f"unknown action '{action}'")
    raw_time = answer.get("time")
    deadline = _iso_utc(raw_time) if isinstance(raw_time, str) else None
    when = raw_time if deadline is not None else "soon"
    if deadline is None:
        problems.append(f"time {raw_time!r} is not an ISO 8601 UTC time; assuming {AWS_SPOT_WARNING_S:.0f} s")
        deadline = now + AWS_SPOT_WARNING_S
    notice = Notice(
        SPOT,
        endpoint.url,
        deadline,
        f"AWS spot interruption: {action} at {when}",
        action=action,
        key=f"{AWS_SPOT}:{action}:{raw_time}",
    )
    return Reading(notice, f"{endpoint.url}: " + "; ".join(problems) if problems else None)


def _aws_scheduled(endpoint: Endpoint, status: int, body: bytes) -> Reading:
    """The earliest event still to come; events that are canceled or completed are no notice."""
    if status == 404:
        return NOTHING
    if status != 200:
        return _unexpected(endpoint, status, body)
    answer = _json(body)
    if not isinstance(answer, list):
        return Reading(None, f"{endpoint.url}: not a list of scheduled events: {_excerpt(body)}")
    problems: list[str] = []
    upcoming: list[Notice] = []
    for event in answer:
        code = event.get("Code") if isinstance(event, dict) else None
        if not isinstance(event, dict) or not isinstance(code, str):
            problems.append(f"an event without a Code: {_excerpt(json.dumps(event).encode())}")
            continue
        state = event.get("State")
        description = event.get("Description")
        described = description if isinstance(description, str) else ""
        if state in _AWS_EVENT_OVER or described.startswith(("[Completed]", "[Canceled]")):
            continue
        raw_start = event.get("NotBefore")
        start = _aws_event_time(raw_start) if isinstance(raw_start, str) else None
        if start is None:
            problems.append(f"event {code}: NotBefore {raw_start!r} is not like '21 Jan 2019 09:00:43 GMT'")
            continue
        action = _AWS_EVENT_ACTIONS.get(code)
        if action is None:
            # an event code AWS added: assume the worst (the instance's processes end)
            problems.append(f"unknown event code '{code}'")
            action = TERMINATE
        event_id = event.get("EventId")
        upcoming.append(
            Notice(
                MAINTENANCE,
                endpoint.url,
                start,
                f"AWS scheduled event {code} not before {raw_start}"
                + (f": {described}" if described else ""),
                action=action,
                key=f"{AWS_SCHEDULED}:{event_id if isinstance(event_id, str) else code + '@' + str(raw_start)}",
            )
        )
    first = min(upcoming, key=lambda notice: notice.deadline or 0.0, default=None)
    return Reading(first, f"{endpoint.url}: " + "; ".join(problems) if problems else None)


def _gcp_preempted(endpoint: Endpoint, status: int, body: bytes, now: float) -> Reading:
    if status != 200:
        return _unexpected(endpoint, status, body)
    value = body.decode("utf-8", "replace").strip()
    if value == "FALSE":
        return NOTHING
    if value != "TRUE":
        return Reading(None, f"{endpoint.url}: neither TRUE nor FALSE: {_excerpt(body)}")
    notice = Notice(
        SPOT,
        endpoint.url,
        now + GCP_PREEMPTION_WARNING_S,
        f"GCP preemption: the VM stops in about {GCP_PREEMPTION_WARNING_S:.0f} s",
        action=TERMINATE,
        key=f"{GCP_PREEMPTED}:TRUE",
    )
    return Reading(notice)


def _gcp_maintenance(endpoint: Endpoint, status: int, body: bytes, now: float) -> Reading:
    if status != 200:
        return _unexpected(endpoint, status, body)
    value = body.decode("utf-8", "replace").strip()
    if value not in _GCP_MAINTENANCE:
        return Reading(None, f"{endpoint.url}: not a maintenance event: {_excerpt(body)}")
    action = _GCP_MAINTENANCE[value]
    if action is None:
        return NOTHING
    notice = Notice(
        MAINTENANCE,
        endpoint.url,
        now + GCP_MAINTENANCE_WARNING_S,
        f"GCP host maintenance: {value} in about {GCP_MAINTENANCE_WARNING_S:.0f} s",
        action=action,
        key=f"{GCP_MAINTENANCE}:{value}",
    )
    return Reading(notice)


@dataclass(frozen=True)
class Seen:
    """What a watcher keeps between polls: the notices present at the last one, and the keys of those
    already reported."""

    present: tuple[Notice, ...] = ()
    reported: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Update:
    """After a poll: what to keep (``seen``), what to report now (``new``), what is there but not due."""

    seen: Seen
    new: tuple[Notice, ...]
    pending: tuple[Notice, ...]


def track(
    seen: Seen, found: Sequence[Notice], unsure: Collection[str], now: float, horizon_s: float
) -> Update:
    """Which notices of a poll are new, so that each is reported once.

    1. Present now: what the poll ``found``, and those present before whose endpoint (``source``) gave no
       clear answer this time (``unsure``: unreachable, or an answer that made no sense) — a failed read is
       not the notice's end.
    2. A reported notice no longer present is forgotten: it is over, and if it comes back it is a new one
       (GCP's maintenance-event goes back to NONE between two maintenances).
    3. Each present notice not reported yet is reported if it is :meth:`~Notice.due` at ``now``, else it
       is pending (an AWS event days ahead is reported once it comes within ``horizon_s``).
    """
    present: dict[str, Notice] = {}
    for notice in found:
        present.setdefault(notice.key, notice)
    for notice in seen.present:
        if notice.source in unsure:
            present.setdefault(notice.key, notice)
    reported = set(seen.reported) & present.keys()
    new: list[Notice] = []
    pending: list[Notice] = []
    for key, notice in present.items():
        if key in reported:
            continue
        if notice.due(now, horizon_s):
            reported.add(key)
            new.append(notice)
        else:
            pending.append(notice)
    return Update(Seen(tuple(present.values()), frozenset(reported)), tuple(new), tuple(pending))


def local(kind: str, deadline: float | None, text: str) -> Notice:
    """A notice the agent makes itself: ``DRAIN`` (``torpor drain``: the work leaves this machine, as on
    a termination) or ``SHUTDOWN`` (its own SIGTERM: the processes end and the agent starts again, as on a
    reboot)."""
    action = REBOOT if kind == SHUTDOWN else TERMINATE
    return Notice(kind, "torpor", deadline, text, action=action, key=kind)


# -- time formats ------------------------------------------------------------------------------------

_MONTHS = {
    name: number
    for number, name in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"], 1
    )
}


def _iso_utc(text: str) -> float | None:
    """``2017-09-18T08:22:00Z`` as epoch seconds; a time without a zone is UTC (AWS writes UTC)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _aws_event_time(text: str) -> float | None:
    """``21 Jan 2019 09:00:43 GMT`` as epoch seconds; read without ``strptime``, whose ``%b`` follows
    the process's locale."""
    fields = text.split()
    if len(fields) != 5 or fields[4] != "GMT" or fields[1] not in _MONTHS:
        return None
    day, year, clock = fields[0], fields[2], fields[3].split(":")
    numbers = [day, year, *clock]
    # ASCII digits only: int() would also read other scripts' digits
    if len(clock) != 3 or not all(part.isascii() and part.isdigit() for part in numbers):
        return None
    try:
        moment = datetime(
            int(year), _MONTHS[fields[1]], int(day), int(clock[0]), int(clock[1]), int(clock[2]), tzinfo=UTC
        )
    except ValueError:
        return None
    return moment.timestamp()
