"""Reading a metadata service's notice (torpor.policy.notices): which endpoints a ``--notice-url`` and
``--notice-format`` mean, what each documented AWS and GCP answer says (and that no answer, however
malformed, raises), and which notices of a poll are new — on answers built in a line."""

from __future__ import annotations

import calendar
import json
import random

import pytest

from torpor.policy import notices
from torpor.policy.notices import (
    AWS_SCHEDULED,
    AWS_SPOT,
    GCP_HEADERS,
    GCP_MAINTENANCE,
    GCP_PREEMPTED,
    Endpoint,
    Notice,
    Reading,
    Seen,
    endpoints,
    read,
    track,
)

NOW = 1_700_000_000.0
AWS_ROOT = "http://169.254.169.254"
GCP_ROOT = "http://metadata.google.internal"
SPOT = Endpoint(AWS_SPOT, AWS_ROOT + notices.PATHS[AWS_SPOT], (), AWS_ROOT + "/latest/api/token")
SCHEDULED = Endpoint(
    AWS_SCHEDULED, AWS_ROOT + notices.PATHS[AWS_SCHEDULED], (), AWS_ROOT + "/latest/api/token"
)
PREEMPTED = Endpoint(GCP_PREEMPTED, GCP_ROOT + notices.PATHS[GCP_PREEMPTED], GCP_HEADERS)
MAINTENANCE = Endpoint(GCP_MAINTENANCE, GCP_ROOT + notices.PATHS[GCP_MAINTENANCE], GCP_HEADERS)


def _utc(*fields: int) -> float:
    return float(calendar.timegm((*fields, 0, 0, 0)))


def _only(resolved: tuple[Endpoint, ...] | str) -> Endpoint:
    assert not isinstance(resolved, str), resolved
    (endpoint,) = resolved
    return endpoint


# -- which endpoints a configuration means ----------------------------------------------------------


def test_the_aws_root_polls_the_spot_action_and_the_scheduled_events_each_with_its_token_url() -> None:
    assert endpoints(AWS_ROOT, "aws") == (SPOT, SCHEDULED)
    assert endpoints(AWS_ROOT + "/", "aws") == (SPOT, SCHEDULED)


def test_the_gcp_root_polls_preempted_and_maintenance_event_with_the_metadata_flavor_header() -> None:
    assert endpoints(GCP_ROOT, "gcp") == (PREEMPTED, MAINTENANCE)
    assert dict(PREEMPTED.headers) == {"Metadata-Flavor": "Google"}
    assert PREEMPTED.token_url is None


def test_one_endpoint_s_url_is_that_endpoint_alone() -> None:
    assert _only(endpoints(SPOT.url, "aws")) == SPOT
    assert _only(endpoints(MAINTENANCE.url, "gcp")) == MAINTENANCE


def test_auto_tells_the_format_from_the_path_or_the_gcp_host() -> None:
    assert _only(endpoints("http://127.0.0.1:8080/latest/meta-data/spot/instance-action")).kind == AWS_SPOT
    assert (
        _only(endpoints("http://127.0.0.1:8080/computeMetadata/v1/instance/preempted")).kind == GCP_PREEMPTED
    )
    assert endpoints(GCP_ROOT) == (PREEMPTED, MAINTENANCE)


def test_an_endpoint_served_under_a_prefix_gets_its_token_beside_its_own_latest() -> None:
    endpoint = _only(endpoints("http://127.0.0.1:9/imds/latest/meta-data/spot/instance-action", "aws"))
    assert endpoint.url == "http://127.0.0.1:9/imds/latest/meta-data/spot/instance-action"
    assert endpoint.token_url == "http://127.0.0.1:9/imds/latest/api/token"


@pytest.mark.parametrize(
    ("url", "fmt", "says"),
    [
        (AWS_ROOT, "azure", "unknown notice format 'azure'"),
        ("ftp://169.254.169.254/latest/meta-data/spot/instance-action", "aws", "not an http:// URL"),
        ("http:///latest/meta-data/spot/instance-action", "aws", "not an http:// URL"),
        (AWS_ROOT, "auto", "cannot tell the format"),
        ("http://169.254.169.254:99999", "aws", "port"),
        ("http://169.254.169.254:x", "aws", "port"),
        ("http://127.0.0.1:8080/notice", "auto", "cannot tell the format"),
        (AWS_ROOT + "/latest/meta-data/instance-id", "aws", "none of the aws endpoints"),
        (SPOT.url, "gcp", "none of the gcp endpoints"),
        (SPOT.url + "?x=1", "aws", "query or fragment"),
    ],
)
def test_a_configuration_that_names_no_endpoint_is_refused_saying_why(url: str, fmt: str, says: str) -> None:
    reason = endpoints(url, fmt)
    assert isinstance(reason, str)
    assert says in reason
    assert "\n" not in reason


# -- AWS spot/instance-action ------------------------------------------------------------------------


def test_aws_spot_404_is_no_notice() -> None:
    assert read(SPOT, 404, b"<html>Not Found</html>", NOW) == Reading(None)


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_spot_action_is_a_notice_due_at_its_time(action: str) -> None:
    body = json.dumps({"action": action, "time": "2017-09-18T08:22:00Z"}).encode()
    reading = read(SPOT, 200, body, NOW)
    assert reading.problem is None
    notice = reading.notice
    assert notice is not None
    assert (notice.kind, notice.action, notice.source) == ("spot", action, SPOT.url)
    assert notice.deadline == _utc(2017, 9, 18, 8, 22, 0)
    assert notice.evacuate
    assert "2017-09-18T08:22:00Z" in notice.text


def test_aws_spot_action_without_a_time_gives_two_minutes_and_says_so() -> None:
    reading = read(SPOT, 200, b'{"action": "terminate"}', NOW)
    assert reading.notice is not None
    assert reading.notice.deadline == NOW + 120
    assert reading.problem is not None and "time" in reading.problem


def test_aws_spot_action_with_an_unreadable_time_is_still_a_notice() -> None:
    reading = read(SPOT, 200, b'{"action": "stop", "time": "tomorrow"}', NOW)
    assert reading.notice is not None and reading.notice.deadline == NOW + 120
    assert reading.problem is not None and "'tomorrow'" in reading.problem


def test_an_aws_spot_action_aws_may_add_later_is_a_notice_that_evacuates() -> None:
    reading = read(SPOT, 200, b'{"action": "vanish", "time": "2017-09-18T08:22:00Z"}', NOW)
    assert reading.notice is not None and reading.notice.evacuate
    assert reading.problem is not None and "unknown action 'vanish'" in reading.problem


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"terminate",
        b"{not json",
        b'["terminate"]',
        b'{"time": "2017-09-18T08:22:00Z"}',
        b'{"action": 3}',
        b"\xff\xfe",
    ],
)
def test_a_malformed_aws_spot_answer_is_no_notice_and_says_why(body: bytes) -> None:
    reading = read(SPOT, 200, body, NOW)
    assert reading.notice is None
    assert reading.problem is not None and SPOT.url in reading.problem


def test_an_aws_error_status_is_no_notice_and_names_the_status() -> None:
    reading = read(SPOT, 500, b"Internal Server Error", NOW)
    assert reading.notice is None
    assert (
        reading.problem is not None
        and "HTTP 500" in reading.problem
        and "Internal Server Error" in reading.problem
    )


def test_the_same_spot_action_has_the_same_key_on_every_poll() -> None:
    body = b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}'
    first, later = read(SPOT, 200, body, NOW).notice, read(SPOT, 200, body, NOW + 5).notice
    assert first is not None and later is not None and first.key == later.key


# -- AWS events/maintenance/scheduled ------------------------------------------------------------------


def _event(
    code: str = "system-reboot",
    state: str = "active",
    not_before: str = "21 Jan 2019 09:00:43 GMT",
    **more: str,
) -> dict[str, str]:
    return {
        "NotBefore": not_before,
        "Code": code,
        "Description": "scheduled reboot",
        "EventId": f"instance-event-{code}-{not_before[:2]}",
        "NotAfter": "21 Jan 2019 09:17:23 GMT",
        "State": state,
        **more,
    }


def test_an_active_scheduled_reboot_is_a_notice_due_at_not_before() -> None:
    reading = read(SCHEDULED, 200, json.dumps([_event()]).encode(), NOW)
    assert reading.problem is None
    notice = reading.notice
    assert notice is not None
    assert (notice.kind, notice.action, notice.deadline) == (
        "maintenance",
        "reboot",
        _utc(2019, 1, 21, 9, 0, 43),
    )
    assert notice.evacuate
    assert notice.key == "aws-scheduled:instance-event-system-reboot-21"


def test_no_scheduled_events_is_no_notice() -> None:
    assert read(SCHEDULED, 200, b"[]", NOW) == Reading(None)
    assert read(SCHEDULED, 404, b"", NOW) == Reading(None)


def test_canceled_and_completed_events_are_no_notice() -> None:
    events = [
        _event(state="canceled"),
        _event(state="completed"),
        _event(state="active", Description="[Completed] scheduled reboot"),
    ]
    assert read(SCHEDULED, 200, json.dumps(events).encode(), NOW) == Reading(None)


def test_of_several_events_the_earliest_is_the_notice() -> None:
    events = [
        _event("instance-stop", not_before="25 Jan 2019 09:00:00 GMT"),
        _event("instance-retirement", not_before="22 Jan 2019 10:00:00 GMT"),
    ]
    notice = read(SCHEDULED, 200, json.dumps(events).encode(), NOW).notice
    assert notice is not None
    assert (notice.action, notice.deadline) == ("terminate", _utc(2019, 1, 22, 10, 0, 0))


def test_system_maintenance_keeps_the_processes_so_it_does_not_evacuate() -> None:
    notice = read(SCHEDULED, 200, json.dumps([_event("system-maintenance")]).encode(), NOW).notice
    assert notice is not None and not notice.evacuate


def test_an_event_whose_time_cannot_be_read_is_left_out_and_reported() -> None:
    events = [
        _event(not_before="2019-01-21T09:00:43Z"),
        _event("instance-stop", not_before="23 Jan 2019 09:00:00 GMT"),
    ]
    reading = read(SCHEDULED, 200, json.dumps(events).encode(), NOW)
    assert reading.notice is not None and reading.notice.action == "stop"
    assert reading.problem is not None and "NotBefore" in reading.problem


def test_an_unknown_event_code_is_taken_for_the_worst() -> None:
    reading = read(SCHEDULED, 200, json.dumps([_event("instance-melt")]).encode(), NOW)
    assert reading.notice is not None and reading.notice.action == "terminate"
    assert reading.problem is not None and "instance-melt" in reading.problem


@pytest.mark.parametrize("body", [b'{"Code": "system-reboot"}', b"[1, 2]", b'[{"State": "active"}]', b"nope"])
def test_malformed_scheduled_events_are_no_notice_and_say_why(body: bytes) -> None:
    reading = read(SCHEDULED, 200, body, NOW)
    assert reading.notice is None
    assert reading.problem is not None


@pytest.mark.parametrize(
    "text",
    [
        "21 Foo 2019 09:00:43 GMT",
        "32 Jan 2019 09:00:43 GMT",
        "21 Jan 2019 9:00 GMT",
        "21 Jan 2019 09:00:43 CET",
        "٢١ Jan 2019 09:00:43 GMT",
    ],
)
def test_a_not_before_that_is_not_aws_s_format_is_refused(text: str) -> None:
    reading = read(SCHEDULED, 200, json.dumps([_event(not_before=text)]).encode(), NOW)
    assert reading.notice is None and reading.problem is not None


# -- GCP ----------------------------------------------------------------------------------------------


def test_gcp_preempted_false_is_no_notice_and_true_gives_thirty_seconds() -> None:
    assert read(PREEMPTED, 200, b"FALSE", NOW) == Reading(None)
    reading = read(PREEMPTED, 200, b"TRUE\n", NOW)
    assert reading.problem is None and reading.notice is not None
    assert (reading.notice.kind, reading.notice.deadline, reading.notice.evacuate) == ("spot", NOW + 30, True)


def test_gcp_preemption_has_one_key_though_its_deadline_moves_with_now() -> None:
    first, later = read(PREEMPTED, 200, b"TRUE", NOW).notice, read(PREEMPTED, 200, b"TRUE", NOW + 5).notice
    assert first is not None and later is not None
    assert first.key == later.key and first.deadline != later.deadline


def test_gcp_maintenance_events() -> None:
    assert read(MAINTENANCE, 200, b"NONE", NOW) == Reading(None)
    migrate = read(MAINTENANCE, 200, b"MIGRATE_ON_HOST_MAINTENANCE", NOW).notice
    assert migrate is not None and migrate.action == "migrate" and not migrate.evacuate
    terminate = read(MAINTENANCE, 200, b"TERMINATE_ON_HOST_MAINTENANCE", NOW).notice
    assert terminate is not None and terminate.evacuate
    assert (terminate.kind, terminate.deadline) == ("maintenance", NOW + 60)
    assert migrate.key != terminate.key


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (PREEMPTED, b"true"),
        (PREEMPTED, b"YES"),
        (PREEMPTED, b""),
        (MAINTENANCE, b"MAINTENANCE"),
        (MAINTENANCE, b"none"),
    ],
)
def test_a_malformed_gcp_answer_is_no_notice_and_says_why(endpoint: Endpoint, body: bytes) -> None:
    reading = read(endpoint, 200, body, NOW)
    assert reading.notice is None
    assert reading.problem is not None and endpoint.url in reading.problem


def test_gcp_refusing_a_request_without_its_header_is_a_problem_not_a_notice() -> None:
    reading = read(PREEMPTED, 403, b"Missing required header: Metadata-Flavor", NOW)
    assert reading.notice is None
    assert reading.problem is not None and "HTTP 403" in reading.problem


def test_no_answer_of_any_shape_raises() -> None:
    # whatever a server sends, reading it returns: random bytes, and JSON of every shape
    chance = random.Random(14)
    shapes: list[object] = [
        None,
        1,
        "x",
        [],
        {},
        [{}],
        [{"Code": 1}],
        {"action": None},
        [{"Code": "system-reboot", "NotBefore": 5}],
    ]
    for _ in range(2000):
        endpoint = chance.choice([SPOT, SCHEDULED, PREEMPTED, MAINTENANCE, Endpoint("what", "http://x")])
        if chance.random() < 0.5:
            body = bytes(chance.randrange(256) for _ in range(chance.randrange(40)))
        else:
            body = json.dumps(chance.choice(shapes)).encode()
        reading = read(endpoint, chance.choice([200, 200, 404, 403, 500]), body, NOW)
        assert isinstance(reading, Reading)
        assert reading.problem is None or "\n" not in reading.problem


# -- when a notice is due, and the agent's own ---------------------------------------------------------


def test_a_notice_is_due_within_the_horizon_and_one_without_a_deadline_always() -> None:
    far = Notice("maintenance", "u", NOW + 3600, "t")
    assert not far.due(NOW, 900)
    assert far.due(NOW + 2700, 900)
    assert Notice("drain", "torpor", None, "t").due(NOW, 0)


def test_the_agent_s_own_notices() -> None:
    shutdown = notices.local(notices.SHUTDOWN, NOW + 90, "SIGTERM")
    drain = notices.local(notices.DRAIN, None, "torpor drain")
    assert (shutdown.action, shutdown.evacuate, shutdown.deadline) == ("reboot", True, NOW + 90)
    assert (drain.action, drain.evacuate, drain.deadline) == ("terminate", True, None)


# -- which notices of a poll are new ---------------------------------------------------------------------


def _notice(key: str, deadline: float | None = NOW + 30, source: str = SPOT.url) -> Notice:
    return Notice("spot", source, deadline, key, key=key)


def test_a_notice_is_new_once_then_not_again_while_it_lasts() -> None:
    first = track(Seen(), [_notice("a")], set(), NOW, 900)
    assert [n.key for n in first.new] == ["a"]
    again = track(first.seen, [_notice("a", NOW + 35)], set(), NOW + 5, 900)
    assert again.new == ()


def test_a_notice_that_went_and_came_back_is_new_again() -> None:
    seen = track(Seen(), [_notice("a")], set(), NOW, 900).seen
    gone = track(seen, [], set(), NOW + 5, 900)
    assert gone.new == () and gone.seen.present == ()
    assert [n.key for n in track(gone.seen, [_notice("a")], set(), NOW + 10, 900).new] == ["a"]


def test_a_poll_that_could_not_read_the_endpoint_does_not_end_its_notice() -> None:
    seen = track(Seen(), [_notice("a")], set(), NOW, 900).seen
    failed = track(seen, [], {SPOT.url}, NOW + 5, 900)
    assert [n.key for n in failed.seen.present] == ["a"]
    assert track(failed.seen, [_notice("a")], set(), NOW + 10, 900).new == ()


def test_a_failure_elsewhere_does_not_keep_a_notice_that_its_own_endpoint_says_is_over() -> None:
    seen = track(Seen(), [_notice("a")], set(), NOW, 900).seen
    assert track(seen, [], {MAINTENANCE.url}, NOW + 5, 900).seen.present == ()


def test_a_notice_far_ahead_is_pending_until_it_comes_within_the_horizon() -> None:
    later = _notice("event", NOW + 86400, SCHEDULED.url)
    waiting = track(Seen(), [later], set(), NOW, 900)
    assert waiting.new == () and waiting.pending == (later,)
    due = track(waiting.seen, [later], set(), NOW + 86400 - 600, 900)
    assert due.new == (later,) and due.pending == ()


def test_two_notices_at_once_are_both_new() -> None:
    update = track(Seen(), [_notice("a"), _notice("b", source=SCHEDULED.url)], set(), NOW, 900)
    assert [n.key for n in update.new] == ["a", "b"]
