"""Polling a metadata service for notices (torpor.core.notices over torpor.adapters.notices), against a
real HTTP server on 127.0.0.1 that serves the AWS and GCP formats as their documentation says: AWS's 404
then its instance-action JSON, IMDSv2's token (required, expiring, or not offered: IMDSv1), GCP's
preempted and maintenance-event refused without ``Metadata-Flavor: Google``; a malformed answer, a server
that is down or never answers, a redirect, a proxy in the environment; and the watcher's thread, which
reports each notice once and each problem once. Nothing but 127.0.0.1 is contacted."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest

from conftest import free_port
from torpor.adapters.notices import Answer, MetadataClient
from torpor.core.notices import NoticePoller, NoticeWatcher
from torpor.errors import UsageError
from torpor.policy.notices import Notice

from .conftest import TOKEN, Metadata, _serve

SPOT = "/latest/meta-data/spot/instance-action"
SCHEDULED = "/latest/meta-data/events/maintenance/scheduled"
PREEMPTED = "/computeMetadata/v1/instance/preempted"
MAINTENANCE = "/computeMetadata/v1/instance/maintenance-event"
ACTION = b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}'
WALL = 1_700_000_000.0


def _headers_of(meta: Metadata, method: str, path: str) -> list[dict[str, str]]:
    with meta.lock:
        return [headers for m, p, headers in meta.requests if (m, p) == (method, path)]


# -- AWS -------------------------------------------------------------------------------------------------


def test_aws_404_is_no_notice_then_the_instance_action_is_one(service: tuple[str, Metadata]) -> None:
    root, meta = service
    poller = NoticePoller(root + SPOT, "aws", wall=lambda: WALL)
    quiet = poller.poll()
    assert quiet.notices == () and quiet.problems == ()
    _serve(meta, SPOT, 200, ACTION)
    (notice,) = poller.poll().notices
    assert (notice.kind, notice.action, notice.deadline) == ("spot", "terminate", 1505722920.0)
    assert notice.source == root + SPOT


def test_imdsv2_one_token_is_asked_for_and_sent_with_every_read(service: tuple[str, Metadata]) -> None:
    root, meta = service
    meta.imdsv2 = "required"
    _serve(meta, SPOT, 200, ACTION)
    poller = NoticePoller(root + SPOT, "aws")
    for _ in range(3):
        assert len(poller.poll().notices) == 1
    (put,) = _headers_of(meta, "PUT", TOKEN)
    assert put["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    reads = _headers_of(meta, "GET", SPOT)
    assert [headers.get("x-aws-ec2-metadata-token") for headers in reads] == ["token-1"] * 3
    assert poller.client.used_token


def test_imdsv2_a_token_the_service_no_longer_takes_is_replaced_once(service: tuple[str, Metadata]) -> None:
    root, meta = service
    meta.imdsv2 = "required"
    _serve(meta, SPOT, 200, ACTION)
    poller = NoticePoller(root + SPOT, "aws")
    assert len(poller.poll().notices) == 1
    with meta.lock:
        meta.tokens.clear()  # the service forgot it (expired, restarted)
    poll = poller.poll()
    assert len(poll.notices) == 1 and poll.problems == ()
    assert [h.get("x-aws-ec2-metadata-token") for h in _headers_of(meta, "GET", SPOT)] == [
        "token-1",
        "token-1",
        "token-2",
    ]


def test_imdsv2_a_token_is_renewed_before_it_ends(service: tuple[str, Metadata]) -> None:
    root, meta = service
    now = [0.0]
    poller = NoticePoller(root + SPOT, "aws", client=MetadataClient(clock=lambda: now[0]))
    poller.poll()
    now[0] = 21600 - 30  # within the last minute of its 6 h
    poller.poll()
    assert len(_headers_of(meta, "PUT", TOKEN)) == 2


def test_imdsv1_a_service_that_gives_no_token_is_read_without_one(service: tuple[str, Metadata]) -> None:
    root, meta = service
    meta.imdsv2 = "off"
    _serve(meta, SPOT, 200, ACTION)
    poller = NoticePoller(root + SPOT, "aws")
    assert len(poller.poll().notices) == 1
    assert len(poller.poll().notices) == 1
    assert all("x-aws-ec2-metadata-token" not in h for h in _headers_of(meta, "GET", SPOT))
    assert not poller.client.used_token
    # the refused PUT is not repeated on every poll
    assert len(_headers_of(meta, "PUT", TOKEN)) == 1


def test_the_aws_root_reads_the_spot_action_and_the_scheduled_events(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(
        meta,
        SCHEDULED,
        200,
        b'[{"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot", "EventId": "e1", "State": "active"}]',
    )
    poll = NoticePoller(root, "aws").poll()
    assert [(n.kind, n.action) for n in poll.notices] == [("maintenance", "reboot")]
    assert poll.problems == ()  # the spot action's 404 is no problem


# -- GCP -------------------------------------------------------------------------------------------------


def test_gcp_is_asked_with_its_header_which_the_server_requires(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, PREEMPTED, 200, b"FALSE")
    # the server refuses a request without the header, as GCP's does
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(root + PREEMPTED, timeout=5)
    refused.value.close()
    assert refused.value.code == 403
    poller = NoticePoller(root + PREEMPTED, "gcp", wall=lambda: WALL)
    assert poller.poll().notices == ()
    _serve(meta, PREEMPTED, 200, b"TRUE")
    (notice,) = poller.poll().notices
    assert (notice.kind, notice.deadline) == ("spot", WALL + 30)
    asked = _headers_of(meta, "GET", PREEMPTED)[1:]  # the first was the bare request above
    assert len(asked) == 2 and all(h.get("metadata-flavor") == "Google" for h in asked)


@pytest.mark.parametrize(
    ("value", "action"),
    [
        (b"NONE", None),
        (b"MIGRATE_ON_HOST_MAINTENANCE", "migrate"),
        (b"TERMINATE_ON_HOST_MAINTENANCE", "terminate"),
    ],
)
def test_gcp_maintenance_event_values(
    service: tuple[str, Metadata], value: bytes, action: str | None
) -> None:
    root, meta = service
    _serve(meta, MAINTENANCE, 200, value)
    poll = NoticePoller(root + MAINTENANCE, "auto", wall=lambda: WALL).poll()
    assert poll.problems == ()
    assert [n.action for n in poll.notices] == ([action] if action else [])
    if action:
        assert poll.notices[0].deadline == WALL + 60
        assert poll.notices[0].evacuate == (action == "terminate")


def test_the_gcp_root_reads_preempted_and_maintenance_event(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, PREEMPTED, 200, b"TRUE")
    _serve(meta, MAINTENANCE, 200, b"TERMINATE_ON_HOST_MAINTENANCE")
    assert [n.kind for n in NoticePoller(root, "gcp").poll().notices] == ["spot", "maintenance"]


# -- what goes wrong ------------------------------------------------------------------------------------------


def test_a_malformed_body_is_no_notice_and_a_problem(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, SPOT, 200, b"<html>captive portal</html>")
    _serve(meta, PREEMPTED, 200, b"MAYBE")
    aws, gcp = NoticePoller(root + SPOT, "aws").poll(), NoticePoller(root + PREEMPTED, "gcp").poll()
    assert aws.notices == () and gcp.notices == ()
    assert aws.problem is not None and "not a spot instance-action" in aws.problem
    assert gcp.problem is not None and "neither TRUE nor FALSE" in gcp.problem


def test_a_server_that_is_down_is_no_notice_and_a_problem() -> None:
    url = f"http://127.0.0.1:{free_port()}" + SPOT
    poll = NoticePoller(url, "aws").poll()
    assert poll.notices == ()
    assert poll.problems == (f"cannot reach {url}: Connection refused",)
    assert poll.unsure == {url}


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepted by the kernel, never read
        url = f"http://127.0.0.1:{silent.getsockname()[1]}" + PREEMPTED
        poll = NoticePoller(url, "gcp", timeout_s=0.3).poll()
    assert poll.notices == ()
    assert poll.problem is not None and "no answer within 0.3 s" in poll.problem


def test_a_redirect_is_not_followed(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, SPOT, 302, b"")
    poll = NoticePoller(root + SPOT, "aws").poll()
    assert poll.notices == ()
    assert poll.problem is not None and "HTTP 302" in poll.problem
    with meta.lock:
        assert all(path != "/elsewhere" for _, path, _ in meta.requests)


def test_a_proxy_in_the_environment_is_not_used(
    service: tuple[str, Metadata], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, meta = service
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
    _serve(meta, SPOT, 200, ACTION)
    assert len(NoticePoller(root + SPOT, "aws").poll().notices) == 1


def test_the_client_gives_statuses_as_answers(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, "/x", 503, b"busy")
    assert MetadataClient().get(root + "/x") == Answer(503, b"busy")


@pytest.mark.parametrize(
    ("url", "fmt", "says"),
    [
        ("http://127.0.0.1:1/notice", "auto", "cannot tell the format"),
        ("ftp://127.0.0.1/latest/meta-data/spot/instance-action", "aws", "not an http:// URL"),
        ("http://127.0.0.1:1" + SPOT, "azure", "unknown notice format"),
    ],
)
def test_a_bad_configuration_is_refused_when_the_poller_is_made(url: str, fmt: str, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        NoticePoller(url, fmt)


def test_an_interval_that_is_not_positive_is_refused() -> None:
    with pytest.raises(UsageError, match="interval"):
        NoticeWatcher("http://127.0.0.1:1" + SPOT, "aws", interval_s=0)


# -- the watcher's thread ---------------------------------------------------------------------------------------


def test_the_watcher_reports_a_notice_once_however_often_it_polls(service: tuple[str, Metadata]) -> None:
    root, meta = service
    seen: list[Notice] = []
    arrived = threading.Event()

    def on_notice(notice: Notice) -> None:
        seen.append(notice)
        arrived.set()

    with NoticeWatcher(root + MAINTENANCE, "gcp", interval_s=0.02, on_notice=on_notice):
        meta.wait_requests(2)
        assert seen == []
        _serve(meta, MAINTENANCE, 200, b"TERMINATE_ON_HOST_MAINTENANCE")
        assert arrived.wait(10), "the notice was not reported"
        with meta.lock:
            asked = len(meta.requests)
        meta.wait_requests(asked + 5)  # five more polls see it still
        assert len(seen) == 1
        # over, then a new maintenance: reported again
        _serve(meta, MAINTENANCE, 200, b"NONE")
        with meta.lock:
            asked = len(meta.requests)
        meta.wait_requests(asked + 2)
        arrived.clear()
        _serve(meta, MAINTENANCE, 200, b"TERMINATE_ON_HOST_MAINTENANCE")
        assert arrived.wait(10), "the second maintenance was not reported"
    assert len(seen) == 2


def test_the_watcher_reports_a_problem_once_and_its_end(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, PREEMPTED, 200, b"garbage")
    problems: list[str | None] = []
    watcher = NoticeWatcher(root + PREEMPTED, "gcp", interval_s=60, on_problem=problems.append)
    for _ in range(3):
        assert watcher.poll_once() == []
    assert len(problems) == 1 and problems[0] is not None and "garbage" in problems[0]
    assert watcher.problem == problems[0]
    _serve(meta, PREEMPTED, 200, b"FALSE")
    watcher.poll_once()
    watcher.poll_once()
    assert problems[1:] == [None] and watcher.problem is None


def test_a_service_that_went_down_mid_notice_does_not_report_it_again(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(meta, PREEMPTED, 200, b"TRUE")
    watcher = NoticeWatcher(root + PREEMPTED, "gcp", interval_s=60)
    assert len(watcher.poll_once()) == 1
    _serve(meta, PREEMPTED, 500, b"oops")
    assert watcher.poll_once() == []
    _serve(meta, PREEMPTED, 200, b"TRUE")
    assert watcher.poll_once() == []


def test_a_callback_that_raises_does_not_stop_the_watcher(
    service: tuple[str, Metadata], caplog: pytest.LogCaptureFixture
) -> None:
    root, meta = service
    _serve(meta, PREEMPTED, 200, b"TRUE")
    _serve(meta, MAINTENANCE, 200, b"TERMINATE_ON_HOST_MAINTENANCE")
    calls: list[str] = []

    def on_notice(notice: Notice) -> None:
        calls.append(notice.kind)
        raise RuntimeError("agent bug")

    watcher = NoticeWatcher(root, "gcp", interval_s=60, on_notice=on_notice)
    assert len(watcher.poll_once()) == 2
    assert calls == ["spot", "maintenance"]
    assert "a notice callback failed" in caplog.text


def test_a_maintenance_far_ahead_waits_in_pending(service: tuple[str, Metadata]) -> None:
    root, meta = service
    _serve(
        meta,
        SCHEDULED,
        200,
        b'[{"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "instance-stop", "EventId": "e2", "State": "active"}]',
    )
    now = [1548061243.0 - 86400]  # a day before NotBefore
    watcher = NoticeWatcher(
        root, "aws", interval_s=60, horizon_s=900, poller=NoticePoller(root, "aws", wall=lambda: now[0])
    )
    assert watcher.poll_once() == [] and [n.action for n in watcher.pending] == ["stop"]
    now[0] = 1548061243.0 - 600
    assert [n.action for n in watcher.poll_once()] == ["stop"] and watcher.pending == ()


def test_stop_ends_the_thread(service: tuple[str, Metadata]) -> None:
    root, meta = service
    watcher = NoticeWatcher(root + SPOT, "aws", interval_s=0.02).start()
    meta.wait_requests(1)
    thread = watcher._thread
    watcher.stop()
    assert thread is not None and not thread.is_alive()
