"""When a warm start's first run is ready (torpor.policy.ready): ``--ready-when`` SPECs read and written
back, refused with why; each rule's verdicts (port, log, idle and its window) with the job's exit and the
timeout; what a later decision still needs; and how often to look."""

from __future__ import annotations

import itertools

import pytest

from torpor.policy.ready import (
    DEFAULT_TIMEOUT_S,
    IDLE_THRESHOLD,
    MAX_POLL_S,
    MIN_POLL_S,
    Observation,
    Outcome,
    ReadyKind,
    ReadyWhen,
    decide,
    parse_ready_when,
    poll_interval,
    trim,
)

PORT = ReadyWhen.port_open(8080)
LOG = ReadyWhen.log_match(r"Listening on \d+")
IDLE = ReadyWhen.cpu_idle(2.0)

# -- reading SPECs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("port:8080", ReadyWhen(ReadyKind.PORT, host="127.0.0.1", port=8080)),
        ("port:1", ReadyWhen.port_open(1)),
        ("port:65535", ReadyWhen.port_open(65535)),
        (" PORT : 8080 ", ReadyWhen.port_open(8080)),
        ("port:localhost:80", ReadyWhen.port_open(80, "localhost")),
        ("port:LocalHost:80", ReadyWhen.port_open(80, "localhost")),
        ("port:10.0.0.2:5432", ReadyWhen.port_open(5432, "10.0.0.2")),
        ("port:::1:8080", ReadyWhen.port_open(8080, "::1")),
        ("port:[::1]:8080", ReadyWhen.port_open(8080, "::1")),
        ("port:[0:0::1]:8080", ReadyWhen.port_open(8080, "::1")),
        ("log:Listening on", ReadyWhen(ReadyKind.LOG, pattern="Listening on")),
        ("log: ready ", ReadyWhen.log_match(" ready ")),  # a pattern is taken as written
        ("log:a:b", ReadyWhen.log_match("a:b")),
        ("idle:2s", ReadyWhen(ReadyKind.IDLE, window_s=2.0)),
        ("idle:500ms", ReadyWhen.cpu_idle(0.5)),
        ("idle:1m", ReadyWhen.cpu_idle(60.0)),
        ("Idle:1h30m", ReadyWhen.cpu_idle(5400.0)),
    ],
)
def test_specs_read_as_users_write_them(text: str, expected: ReadyWhen) -> None:
    assert parse_ready_when(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "port:8080",
        "port:localhost:80",
        "port:10.0.0.2:5432",
        "port:[::1]:8080",
        "log:Listening on \\d+$",
        "log: ready ",
        "idle:2s",
        "idle:500ms",
        "idle:90m",
    ],
)
def test_the_canonical_form_reads_back_to_itself(text: str) -> None:
    assert str(parse_ready_when(text)) == text


@pytest.mark.parametrize(
    "text", [" PORT : 8080 ", "port:127.0.0.1:8080", "port:::1:80", "idle:1h30m", "idle:0.5s", "idle:1.5s"]
)
def test_any_spec_written_back_reads_as_the_same(text: str) -> None:
    first = parse_ready_when(text)
    assert parse_ready_when(str(first)) == first


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("8080", "names no kind"),
        ("wait:3s", "unknown kind 'wait'"),
        (":8080", "unknown kind ''"),
        ("port:", "a port number is needed"),
        ("port:0", "1 to 65535, not 0"),
        ("port:65536", "1 to 65535, not 65536"),
        ("port:http", "'http' is not a port number"),
        ("port:-1", "'-1' is not a port number"),
        ("port:80.5", "'80.5' is not a port number"),
        ("port:example.com:80", "'example.com' is not an IP address"),
        ("port:[::1]:", "a port number is needed"),
        ("log:", "a regular expression is needed"),
        ("log:(", "not a regular expression (missing ), unterminated subpattern"),
        ("log:a{2,1}", "not a regular expression (min repeat greater than max repeat"),
        ("idle:", "is not a duration"),
        ("idle:2", "'2' is not a duration"),
        ("idle:soon", "is not a duration"),
        ("idle:0s", "not a duration longer than zero"),
        ("idle:100ms", "at least 200ms, not 100ms"),
    ],
)
def test_a_bad_spec_is_refused_in_one_line_that_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_ready_when(text)
    message = str(refused.value)
    assert message.startswith(f"--ready-when '{text}'")
    assert why in message
    assert "\n" not in message


def test_a_value_built_directly_is_checked_as_a_parsed_one() -> None:
    with pytest.raises(ValueError, match="1 to 65535"):
        ReadyWhen.port_open(70000)
    with pytest.raises(ValueError, match="not an IP address"):
        ReadyWhen.port_open(80, "example.com")
    with pytest.raises(ValueError, match="not a regular expression"):
        ReadyWhen.log_match("[")
    with pytest.raises(ValueError, match="at least 200ms"):
        ReadyWhen.cpu_idle(0.1)


def test_a_log_rule_searches_anywhere_in_the_line_and_only_a_log_rule_matches() -> None:
    assert LOG.matches("INFO  Listening on 8080 (pid 7)")
    assert not LOG.matches("Listening on port")
    assert not ReadyWhen.log_match("^ready$").matches("not ready")
    assert not PORT.matches("Listening on 8080")


# -- deciding ------------------------------------------------------------------------------------------


def test_nothing_observed_is_wait() -> None:
    assert decide(PORT, []).outcome == Outcome.WAIT


def test_port_is_ready_once_it_accepts() -> None:
    refused = decide(PORT, [Observation(1.0)])
    assert (refused.outcome, refused.at) == (Outcome.WAIT, 1.0)
    assert "127.0.0.1:8080 did not accept" in refused.reason
    accepted = decide(PORT, [Observation(1.0), Observation(1.5, port_accepts=True)])
    assert (accepted.outcome, accepted.at) == (Outcome.READY, 1.5)
    assert accepted.reason == "port 127.0.0.1:8080 accepted a connection after 1.5s"


def test_port_is_judged_on_the_latest_look_only() -> None:
    assert decide(PORT, [Observation(1.0, port_accepts=True), Observation(1.5)]).outcome == Outcome.WAIT


def test_log_is_ready_once_a_line_matched() -> None:
    assert decide(LOG, [Observation(0.2)]).outcome == Outcome.WAIT
    verdict = decide(LOG, [Observation(0.2), Observation(0.4, log_matched=True)])
    assert verdict.outcome == Outcome.READY
    assert "matched 'Listening on \\d+'" in verdict.reason


@pytest.mark.parametrize("ready_when", [PORT, LOG, ReadyWhen.cpu_idle(0.2)], ids=["port", "log", "idle"])
def test_a_job_that_exited_gives_up_even_if_it_got_ready_first(ready_when: ReadyWhen) -> None:
    gone = Observation(5.0, alive=False, port_accepts=True, log_matched=True, cpu_s=0.0)
    verdict = decide(ready_when, [gone])
    assert verdict.outcome == Outcome.GIVE_UP
    assert "exited" in verdict.reason


def test_it_gives_up_at_the_timeout_unless_ready_then() -> None:
    assert decide(PORT, [Observation(9.9)], timeout_s=10).outcome == Outcome.WAIT
    late = decide(PORT, [Observation(10.0)], timeout_s=10)
    assert late.outcome == Outcome.GIVE_UP
    assert late.reason.startswith("not ready after 10s: port 127.0.0.1:8080 did not accept")
    assert decide(PORT, [Observation(10.0, port_accepts=True)], timeout_s=10).outcome == Outcome.READY


def test_the_default_timeout_is_ten_minutes() -> None:
    assert DEFAULT_TIMEOUT_S == 600
    assert decide(LOG, [Observation(599.0)]).outcome == Outcome.WAIT
    assert decide(LOG, [Observation(600.0)]).outcome == Outcome.GIVE_UP


# -- the idle window -----------------------------------------------------------------------------------


def cpu(*points: tuple[float, float]) -> list[Observation]:
    """Observations at (seconds since start, CPU seconds used so far)."""
    return [Observation(at, cpu_s=used) for at, used in points]


def looks(every: float, until: float, used: float = 0.0) -> list[Observation]:
    steps = round(until / every)
    return cpu(*((round(i * every, 6), used) for i in range(1, steps + 1)))


def test_a_job_idle_from_its_first_instant_is_ready_after_the_window() -> None:
    assert decide(IDLE, looks(0.1, 1.9)).outcome == Outcome.WAIT
    verdict = decide(IDLE, looks(0.1, 2.0))
    assert (verdict.outcome, verdict.at) == (Outcome.READY, 2.0)
    assert "0% of one core" in verdict.reason


def test_the_start_counts_as_zero_used_so_startup_work_delays_readiness() -> None:
    # 0.5 s of CPU by the first look at 0.1 s: the window from the start holds it
    history = cpu((0.1, 0.5), *((round(0.1 * i, 6), 0.5) for i in range(2, 22)))
    assert decide(IDLE, history[:20]).outcome == Outcome.WAIT  # at 2.0: [0, 2.0] holds the 0.5 s
    assert decide(IDLE, history).outcome == Outcome.READY  # at 2.1: [0.1, 2.1] used nothing


def test_a_busy_start_then_quiet_is_ready_a_window_after_the_work_stopped() -> None:
    # one core busy until 3 s, then quiet
    history = cpu(*((t / 2, min(t / 2, 3.0)) for t in range(1, 13)))
    verdicts = [decide(IDLE, history[: i + 1]) for i in range(len(history))]
    first_ready = next(v.at for v in verdicts if v.outcome == Outcome.READY)
    assert first_ready == 5.0
    busy = verdicts[5]  # at 3 s
    assert busy.outcome == Outcome.WAIT
    assert "100% of one core" in busy.reason


def test_the_threshold_is_a_share_of_one_core_over_the_window() -> None:
    assert IDLE_THRESHOLD == 0.05
    under = cpu((1.0, 1.0), (3.0, 1.0 + 0.099))  # 4.95 % of 2 s
    over = cpu((1.0, 1.0), (3.0, 1.0 + 0.1))  # 5 % exactly is not under
    assert decide(IDLE, under).outcome == Outcome.READY
    assert decide(IDLE, over).outcome == Outcome.WAIT


def test_the_window_starts_at_the_last_look_before_it_so_the_measured_span_is_at_least_the_window() -> None:
    # looks at 1 and 2.5: at 3.5 the window [1.5, 3.5] is measured from 1 (2.5 s), and the CPU used
    # between 1 and 2.5 counts in it: 0.15 s, 6 % of 2.5 s
    history = cpu((1.0, 1.0), (2.5, 1.15), (3.5, 1.15))
    verdict = decide(IDLE, history)
    assert verdict.outcome == Outcome.WAIT
    assert "0.15s in 2.5s" in verdict.reason
    assert decide(IDLE, [*history, *cpu((4.5, 1.15))]).outcome == Outcome.READY  # from 2.5: none used


def test_cpu_time_that_went_down_counts_as_none_used() -> None:
    # a process of the tree ended between two looks, taking 3 s with it
    history = cpu((1.0, 5.0), (2.0, 2.0), (3.0, 2.0), (4.0, 2.0))
    assert decide(IDLE, history).outcome == Outcome.READY


def test_looks_without_cpu_time_are_left_out_and_one_last_leaves_the_window_unmeasured() -> None:
    history = [*cpu((0.5, 0.0)), Observation(1.0), *cpu((2.5, 0.0))]
    assert decide(IDLE, history).outcome == Outcome.READY
    assert decide(IDLE, [*history, Observation(3.0)]).outcome == Outcome.WAIT


def test_an_idle_job_that_never_goes_quiet_gives_up_at_the_timeout() -> None:
    busy = cpu(*((float(t), t * 0.5) for t in range(1, 11)))  # half a core
    assert decide(IDLE, busy, timeout_s=10).outcome == Outcome.GIVE_UP


# -- what a later decision needs -----------------------------------------------------------------------


def test_port_and_log_keep_only_the_latest_look() -> None:
    history = [Observation(1.0), Observation(2.0, port_accepts=True)]
    assert trim(PORT, history) == [history[-1]]
    assert trim(LOG, []) == []


def test_idle_keeps_the_window_and_the_look_before_it() -> None:
    history = looks(0.5, 5.0)
    kept = trim(IDLE, history)
    assert [o.at for o in kept] == [3.0, 3.5, 4.0, 4.5, 5.0]


def test_deciding_on_trimmed_looks_is_deciding_on_all() -> None:
    # busy, quiet, a burst, quiet again: looks every 0.3 s
    def used(at: float) -> float:
        return min(at, 2.0) + (0.4 if at > 4.0 else 0.0)

    history = cpu(*((round(0.3 * i, 6), used(0.3 * i)) for i in range(1, 40)))
    kept: list[Observation] = []
    for i, observation in enumerate(history):
        kept = [*trim(IDLE, kept), observation]
        assert decide(IDLE, kept) == decide(IDLE, history[: i + 1])


# -- how often to look ---------------------------------------------------------------------------------


def test_looks_start_at_50ms_and_back_off_to_half_a_second() -> None:
    assert poll_interval(PORT, 0.0) == MIN_POLL_S == 0.05
    assert poll_interval(PORT, 1.0) == pytest.approx(0.1)
    assert poll_interval(LOG, 5.0) == MAX_POLL_S == 0.5
    assert poll_interval(LOG, 3600.0) == MAX_POLL_S
    intervals = [poll_interval(PORT, t / 10) for t in range(100)]
    assert intervals == sorted(intervals)


def test_an_idle_window_is_looked_at_four_times_at_least() -> None:
    assert poll_interval(ReadyWhen.cpu_idle(1.0), 60.0) == 0.25
    assert poll_interval(ReadyWhen.cpu_idle(0.2), 60.0) == MIN_POLL_S
    assert poll_interval(ReadyWhen.cpu_idle(60.0), 60.0) == MAX_POLL_S


def test_a_simulated_wait_sees_an_idle_job_ready_soon_after_its_window() -> None:
    # looking as poll_interval says at a job idle from the start: ready within one interval of the window
    rule = ReadyWhen.cpu_idle(1.0)
    history: list[Observation] = []
    at = 0.0
    for _ in itertools.count():
        at += poll_interval(rule, at)
        history = [*trim(rule, history), Observation(at, cpu_s=0.0)]
        verdict = decide(rule, history)
        if verdict.outcome != Outcome.WAIT:
            break
    assert verdict.outcome == Outcome.READY
    assert 1.0 <= verdict.at <= 1.0 + poll_interval(rule, 1.0) + 1e-9
