"""What the agent did, measured: the ``/metrics`` endpoint that Prometheus scrapes.

Nothing is counted in this process's memory. Each scrape reads the state directory — the job and
checkpoint records, the store's image states, the agent's events — and builds the metric families from
it (a custom collector, as prometheus_client advises for values kept elsewhere). So an agent that was
restarted, even killed with -9, serves the same totals, and a checkpoint someone took by hand with
``torpor checkpoint`` is counted like the agent's own. The price is a read of the records, the store and
/proc at every scrape, which for one node's jobs is milliseconds.

The counters are sums over the events, which the agent keeps; the checkpoint histograms are built from
the checkpoint records, which retention prunes: an event that names a checkpoint no longer on record
(``detail["checkpoint"]``) still counts with its own ``freeze_s`` and ``size_bytes``, so that the
histograms only grow as long as the events are kept.

What it leaves to others: when the agent acts and what it writes as an event is the daemon's; the page
that shows the same state to a person is :mod:`torpor.apps.agent.web`, which reads it through
:func:`read_snapshot` too.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from torpor.core.engine import JobStatus
from torpor.core.recordtypes import Checkpoint, CheckpointId, JobState
from torpor.core.store import DURABLE, StoredImage
from torpor.errors import TorporError

# -- what is read: the engine's view and the agent's events --------------------------------------------


class EngineView(Protocol):
    """What the page and the metrics ask of :class:`~torpor.core.engine.Engine` (which has it all)."""

    def statuses(self) -> list[JobStatus]: ...

    def checkpoints(self, name: str | None = None) -> list[Checkpoint]: ...

    def image_states(self, checkpoints: list[Checkpoint]) -> dict[CheckpointId, StoredImage | None]: ...


class AgentEvent(Protocol):
    """One automatic action of the agent as its events record it (a dataclass of the daemon's fits)."""

    @property
    def id(self) -> int: ...

    @property
    def at(self) -> float: ...

    @property
    def job(self) -> str | None: ...

    @property
    def action(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def detail(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Event:
    """An event as the page and the metrics use it, whatever form its source gave it in.

    ``action``: checkpoint, hibernate, resume, evacuate, drain, notice, adopt…; ``detail`` holds its cost
    (``freeze_s``, ``total_s``, ``size_bytes``, ``freed_bytes``, ``durable_s``), the checkpoint it made
    (``checkpoint``) and, when it failed, ``error``.
    """

    id: int
    at: float
    job: str | None
    action: str
    reason: str
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.detail.get("error"))

    @classmethod
    def of(cls, item: AgentEvent | Mapping[str, Any]) -> Event:
        """An event from the daemon's record (attributes) or from JSON (a dict with the same keys)."""
        if isinstance(item, Mapping):
            return cls(
                id=int(item["id"]),
                at=float(item["at"]),
                job=item.get("job"),
                action=str(item["action"]),
                reason=str(item.get("reason") or ""),
                detail=dict(item.get("detail") or {}),
            )
        return cls(item.id, item.at, item.job, item.action, item.reason, dict(item.detail))


#: the agent's events so far, oldest first (the daemon's events table, or a list in a test)
EventSource = Callable[[], Iterable[AgentEvent | Mapping[str, Any]]]
#: an engine on the agent's state directory, asked at each request (the daemon's own, or a new one)
EngineSource = Callable[[], EngineView]


@dataclass(frozen=True)
class Snapshot:
    """One reading of everything the page and the metrics show, taken at ``now``."""

    now: float
    jobs: list[JobStatus]
    checkpoints: list[Checkpoint]
    #: where each checkpoint's image is; ``None``: its image is gone
    images: dict[CheckpointId, StoredImage | None]
    events: list[Event]

    @property
    def stored_bytes(self) -> int:
        """What the store spent on the durable images of the checkpoints on record (their new chunks)."""
        return sum(
            image.stored_bytes
            for image in self.images.values()
            if image is not None and image.state == DURABLE
        )

    def freed_bytes(self) -> Counter[str]:
        """Memory the agent's actions freed (their events' ``freed_bytes``), by action."""
        freed: Counter[str] = Counter()
        for event in self.events:
            if (value := _number(event.detail.get("freed_bytes"))) is not None:
                freed[event.action] += int(value)
        return freed


def read_snapshot(engine: EngineView, events: EventSource) -> Snapshot:
    """Read the jobs, checkpoints, images and events once; raises what the engine raises (TorporError)."""
    jobs = engine.statuses()
    checkpoints = engine.checkpoints()
    images = engine.image_states(checkpoints)
    return Snapshot(time.time(), jobs, checkpoints, images, [Event.of(item) for item in events()])


# -- the metric families ---------------------------------------------------------------------------------

#: seconds a checkpoint kept its job frozen: from a small job's tens of milliseconds to a large model's minutes
FREEZE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: bytes of a CRIU image: 1 MiB to 64 GiB, by fours
SIZE_BUCKETS = tuple(float(4**n * 2**20) for n in range(9))
#: seconds from the end of a dump to the image being durable (in the cold tier)
DURABLE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def families(snapshot: Snapshot) -> list[Metric]:
    """The metric families of one snapshot; a pure function of it."""
    by_state = Counter(status.job.state for status in snapshot.jobs)
    jobs = GaugeMetricFamily("torpor_jobs", "Jobs by state.", labels=["state"])
    for state in JobState:
        jobs.add_metric([state.value], by_state[state])

    resident = GaugeMetricFamily(
        "torpor_job_resident_bytes",
        "Memory the job's process tree has resident (the sum of its processes' PSS), per job with processes.",
        labels=["job"],
    )
    for status in snapshot.jobs:
        if status.rss_bytes is not None:
            resident.add_metric([status.job.name], status.rss_bytes)

    # checkpoints retention removed still count, by the first event that names each (with its costs)
    on_record = {checkpoint.id for checkpoint in snapshot.checkpoints}
    first_named: dict[str, Event] = {}
    for event in snapshot.events:
        named = event.detail.get("checkpoint")
        if (
            isinstance(named, str)
            and named not in on_record
            and _number(event.detail.get("freeze_s")) is not None
        ):
            first_named.setdefault(named, event)
    pruned = list(first_named.values())
    freezes = [c.freeze_s for c in snapshot.checkpoints] + _numbers(pruned, "freeze_s")
    sizes = [float(c.size_bytes) for c in snapshot.checkpoints] + _numbers(pruned, "size_bytes")
    durable_times = _numbers(snapshot.events, "durable_s")

    image_states = Counter(
        image.state if image is not None else "missing" for image in snapshot.images.values()
    )
    images = GaugeMetricFamily(
        "torpor_checkpoints",
        "Checkpoints on record by where their image is (staged, destaging, durable, missing…).",
        labels=["image_state"],
    )
    for image_state, count in sorted(image_states.items()):
        images.add_metric([image_state], count)

    stored = GaugeMetricFamily(
        "torpor_store_bytes",
        "Bytes the store spent on the durable images of the checkpoints on record (new chunks of each).",
        value=snapshot.stored_bytes,
    )

    freed = CounterMetricFamily(
        "torpor_hibernation_freed_bytes",
        "Memory freed by the agent's hibernations (their events' freed_bytes), by action.",
        labels=["action"],
    )
    for action, value in sorted(snapshot.freed_bytes().items()):
        freed.add_metric([action], value)
    actions = Counter((event.action, "failed" if event.failed else "ok") for event in snapshot.events)
    done = CounterMetricFamily(
        "torpor_actions",
        "Automatic actions of the agent (its events), by action and outcome (ok, failed).",
        labels=["action", "outcome"],
    )
    for (action, outcome), count in sorted(actions.items()):
        done.add_metric([action, outcome], count)

    return [
        jobs,
        resident,
        _histogram(
            "torpor_checkpoint_freeze_seconds",
            "Seconds each checkpoint kept its job frozen.",
            freezes,
            FREEZE_BUCKETS,
        ),
        _histogram(
            "torpor_checkpoint_size_bytes",
            "Bytes of each checkpoint's CRIU image as dumped.",
            sizes,
            SIZE_BUCKETS,
        ),
        _histogram(
            "torpor_checkpoint_durable_seconds",
            "Seconds from a checkpoint of the agent's to its image being durable (events' durable_s).",
            durable_times,
            DURABLE_BUCKETS,
        ),
        images,
        stored,
        freed,
        done,
    ]


def _number(value: object) -> float | None:
    """A cost from an event's detail; anything else (a string from a newer agent, a bool) is no cost."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _numbers(events: Iterable[Event], key: str) -> list[float]:
    return [value for event in events if (value := _number(event.detail.get(key))) is not None]


def _histogram(name: str, documentation: str, values: Sequence[float], bounds: Sequence[float]) -> Metric:
    buckets: list[tuple[str, float]] = [
        (repr(float(bound)), sum(1 for v in values if v <= bound)) for bound in bounds
    ]
    buckets.append(("+Inf", len(values)))
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=sum(values))


class AgentCollector:
    """A prometheus_client collector that reads a fresh :class:`Snapshot` at every scrape."""

    def __init__(self, engine: EngineSource, events: EventSource) -> None:
        self.engine = engine
        self.events = events

    def collect(self) -> Iterator[Metric]:
        yield from families(read_snapshot(self.engine(), self.events))


def registry_for(engine: EngineSource, events: EventSource) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding only the agent's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(engine, events))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry's metrics in Prometheus's text format, and the content type to serve them with."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def add_routes(app: FastAPI, engine: EngineSource, events: EventSource) -> CollectorRegistry:
    """Serve ``GET /metrics`` on ``app``; returns the registry, to which the agent may add collectors.

    A state directory that cannot be read answers 503 with the one-line reason: Prometheus records the
    scrape as failed instead of a gap that looks like zero jobs.
    """
    registry = registry_for(engine, events)

    def metrics() -> Response:
        try:
            body, content_type = render(registry)
        except TorporError as exc:
            return PlainTextResponse(f"cannot read torpor's state: {exc.message}\n", status_code=503)
        return Response(body, media_type=content_type)

    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        response_class=Response,
        summary="Prometheus metrics: jobs, checkpoints, the store and the agent's actions",
    )
    return registry
