"""The agent's /metrics: what a Prometheus scrape of a real state directory reads, parsed as Prometheus would.

Each test builds a FastAPI app with :func:`torpor.apps.agent.metrics.add_routes`, serves it with a real
uvicorn on 127.0.0.1 and scrapes it over HTTP; the jobs are real (and checkpointed with CRIU where marked),
the events come from the records (the agent's events table) or, for their forms, from a list a test gives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import prometheus_client
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from conftest import Torpor, python_job, serving
from torpor.apps.agent import metrics
from torpor.apps.agent.metrics import Event
from torpor.core.engine import Engine
from torpor.settings import Settings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[httpx.Response, Samples]:
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return response, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


def buckets(samples: Samples, name: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts by their ``le`` bound."""
    return {dict(labels)["le"]: v for (sample, labels), v in samples.items() if sample == f"{name}_bucket"}


@pytest.fixture
def events() -> list[Any]:
    """The agent's events as the served app sees them at each scrape; a test appends to it."""
    return []


@pytest.fixture
def served(torpor: Torpor, events: list[Any]) -> Iterator[str]:
    app = FastAPI()
    metrics.add_routes(app, torpor.engine, lambda: events)
    with serving(app) as url:
        yield url


def test_events_alone_make_the_counters_and_the_durable_histogram(served: str, events: list[Any]) -> None:
    now = time.time()
    # as the daemon's JSON would carry them (dicts), and one as its record (attributes)
    events += [
        {"id": 1, "at": now, "job": "a", "action": "hibernate", "reason": "idle for 15m",
         "detail": {"freed_bytes": 3 << 20, "durable_s": 0.3, "freeze_s": 0.2, "checkpoint": "gone1"}},
        {"id": 2, "at": now, "job": "b", "action": "hibernate", "reason": "idle for 15m",
         "detail": {"freed_bytes": 5 << 20, "durable_s": 4.0, "freeze_s": 9.0}},
        # the same checkpoint named again (a later report of it) is still one checkpoint
        Event(6, now, "a", "report", "", {"checkpoint": "gone1", "freeze_s": 0.2, "size_bytes": 1 << 20}),
        Event(3, now, "c", "evacuate", "spot notice", {"error": "criu dump failed", "durable_s": 700.0}),
        Event(4, now, None, "notice", "spot instance-action", {"freed_bytes": "a lot"}),
    ]  # fmt: skip
    response, samples = scrape(served)
    assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST

    # no job yet: every state is there, at zero
    assert {dict(labels)["state"] for name, labels in samples if name == "torpor_jobs"} == {
        "starting", "running", "checkpointing", "hibernating", "hibernated", "restoring", "exited", "failed",
    }  # fmt: skip
    assert all(v == 0 for (name, _), v in samples.items() if name == "torpor_jobs")
    assert value(samples, "torpor_store_bytes") == 0

    assert value(samples, "torpor_actions_total", action="hibernate", outcome="ok") == 2
    assert value(samples, "torpor_actions_total", action="evacuate", outcome="failed") == 1
    assert value(samples, "torpor_actions_total", action="notice", outcome="ok") == 1
    assert value(samples, "torpor_actions_total", action="report", outcome="ok") == 1
    # a freed_bytes that is no number is no cost (a newer agent's detail must not break the scrape)
    assert value(samples, "torpor_hibernation_freed_bytes_total", action="hibernate") == 8 << 20
    assert ("torpor_hibernation_freed_bytes_total", (("action", "notice"),)) not in samples

    durable = buckets(samples, "torpor_checkpoint_durable_seconds")
    assert (durable["0.25"], durable["0.5"], durable["5.0"], durable["600.0"], durable["1800.0"]) == (
        0,
        1,
        2,
        2,
        3,
    )
    assert durable["+Inf"] == value(samples, "torpor_checkpoint_durable_seconds_count") == 3
    assert value(samples, "torpor_checkpoint_durable_seconds_sum") == pytest.approx(704.3)

    # the event that names its checkpoint (no longer on record) counts; the one that names none might be
    # a checkpoint still on record, so it does not (it would count twice)
    assert value(samples, "torpor_checkpoint_freeze_seconds_count") == 1
    assert value(samples, "torpor_checkpoint_freeze_seconds_sum") == pytest.approx(0.2)
    assert value(samples, "torpor_checkpoint_size_bytes_count") == 0  # the first event gave no size

    # read again at each scrape, nothing cached
    events.append(Event(5, now, "a", "resume", "a client connected to port 8888", {"total_s": 0.8}))
    assert value(scrape(served)[1], "torpor_actions_total", action="resume", outcome="ok") == 1


def test_the_registry_is_the_agents_own(served: str) -> None:
    scrape(served)
    assert b"torpor_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_a_state_directory_that_cannot_be_read_answers_503_with_the_reason(tmp_path: Path) -> None:
    home = tmp_path / "not-a-folder"
    home.write_text("")
    app = FastAPI()
    metrics.add_routes(app, lambda: Engine(Settings(home=home)), list)
    with serving(app) as url:
        response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 503
    assert response.text.startswith("cannot read torpor's state: ")
    assert str(home) in response.text and response.text.count("\n") == 1


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_a_scrape_reads_the_jobs_their_checkpoints_and_the_store(torpor: Torpor) -> None:
    torpor.run("run", "--name", "alpha", *python_job("counter.py"))
    torpor.run("run", "--name", "beta", *python_job("memory_hog.py", "16"))
    torpor.wait_log("alpha", "step 3")
    torpor.wait_log("beta", "step 3")
    first = torpor.json("checkpoint", "alpha", "--wait")
    hibernated = torpor.json("hibernate", "beta", "--wait")
    # what the agent records of its actions, in its records (the daemon's costs: service._costs)
    records = torpor.engine().records
    records.add_event("alpha", "checkpoint", "every 10m", checkpoint=first["id"], freeze_s=first["freeze_s"],
                      size_bytes=first["size_bytes"], durable_s=0.7)  # fmt: skip
    records.add_event("beta", "hibernate", "idle for 15m", checkpoint=hibernated["id"],
                      freeze_s=hibernated["freeze_s"], freed_bytes=hibernated["freed_rss_bytes"])  # fmt: skip
    app = FastAPI()
    metrics.add_routes(app, torpor.engine, records.events)
    with serving(app) as served:
        _, samples = scrape(served)
        assert value(samples, "torpor_jobs", state="running") == 1
        assert value(samples, "torpor_jobs", state="hibernated") == 1
        assert value(samples, "torpor_job_resident_bytes", job="alpha") > 1 << 20
        assert (
            "torpor_job_resident_bytes",
            (("job", "beta"),),
        ) not in samples  # hibernated: nothing resident

        recorded = torpor.json("checkpoints")
        assert len(recorded) == 2 and all(c["state"] == "durable" for c in recorded)
        assert value(samples, "torpor_checkpoints", image_state="durable") == 2
        assert value(samples, "torpor_store_bytes") == sum(c["stored_bytes"] for c in recorded) > 0
        # the events name checkpoints on record: the records count, the events do not count them again
        assert value(samples, "torpor_checkpoint_freeze_seconds_count") == 2
        assert value(samples, "torpor_checkpoint_freeze_seconds_sum") == pytest.approx(
            first["freeze_s"] + hibernated["freeze_s"]
        )
        assert value(samples, "torpor_checkpoint_size_bytes_sum") == sum(c["size_bytes"] for c in recorded)
        sizes = buckets(samples, "torpor_checkpoint_size_bytes")
        assert list(sizes.values()) == sorted(sizes.values())  # cumulative
        # beta holds 16 MiB of random bytes: its image is over 16 MiB, under 64 MiB
        assert sizes["16777216.0"] <= 1 and sizes["67108864.0"] == 2
        freed = value(samples, "torpor_hibernation_freed_bytes_total", action="hibernate")
        assert freed == hibernated["freed_rss_bytes"] > 16 << 20
        assert value(samples, "torpor_checkpoint_durable_seconds_count") == 1
        assert value(samples, "torpor_checkpoint_durable_seconds_sum") == pytest.approx(0.7)
        assert value(samples, "torpor_actions_total", action="checkpoint", outcome="ok") == 1

        # a checkpoint by hand counts at the next scrape; one pruned with its job still counts by its event
        second = torpor.json("checkpoint", "alpha")
        _, samples = scrape(served)
        assert value(samples, "torpor_checkpoint_freeze_seconds_count") == 3
        torpor.run("rm", "--force", "alpha")
        _, samples = scrape(served)
        assert value(samples, "torpor_jobs", state="running") == 0
        # beta's record, and alpha's first checkpoint by its event
        assert value(samples, "torpor_checkpoint_freeze_seconds_count") == 2
        assert value(samples, "torpor_checkpoint_freeze_seconds_sum") == pytest.approx(
            first["freeze_s"] + hibernated["freeze_s"]
        )
        assert second["id"] not in {c["id"] for c in torpor.json("checkpoints")}
