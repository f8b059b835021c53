"""The agent's pure decisions: durations, a job's policy, periodic checkpoints within a budget, idleness."""

from __future__ import annotations

import pytest

from torpor.policy import idle, periodic
from torpor.policy.jobpolicy import JobPolicy, format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("10m", 600),
        ("2h", 7200),
        ("1d", 86400),
        ("500ms", 0.5),
        ("1h30m", 5400),
        (" 2M ", 120),
        ("1.5s", 1.5),
    ],
)
def test_durations_read_as_users_write_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "", "s", "10 minutes", "-5s", "0s", "5x", "1h 30m", "m10"])
def test_a_duration_without_a_unit_or_malformed_is_refused_with_why(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0.5, 1, 45, 60, 90, 600, 3600, 5400, 86400, 1.5])
def test_format_duration_reads_back(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_a_policy_lists_every_problem_and_round_trips_through_its_json() -> None:
    assert JobPolicy().problems() == [] and JobPolicy().is_empty
    bad = JobPolicy(checkpoint_every_s=0.5, budget=0.9, keep=0, idle_after_s=None, wake_on=(0, 8000, 8000))
    problems = bad.problems()
    assert len(problems) == 6, problems
    assert any("--wake-on wakes a job that was hibernated when idle" in p for p in problems)
    good = JobPolicy(checkpoint_every_s=600, keep=3, idle_after_s=900, wake_on=(8888,), priority=2)
    assert JobPolicy.from_dict(good.to_dict()) == good
    assert (
        good.describe()
        == "checkpoint every 10m, keep 3; hibernate after 15m idle; wake on port 8888; priority 2"
    )
    with pytest.raises(ValueError, match="unknown policy field"):
        JobPolicy.from_dict({"colour": "red"})


def test_the_interval_is_asked_for_until_freezes_would_exceed_the_budget() -> None:
    assert periodic.interval(600, 0.02, []) == 600  # nothing measured yet
    assert periodic.interval(600, 0.02, [1.0, 1.0]) == 600  # 1 s per 600 s: 0.17 %
    assert periodic.interval(10, 0.02, [2.0]) == pytest.approx(100)  # 2 s at 2 %: every 100 s at most
    # the mean of the last five: an old slow one is forgotten
    assert periodic.interval(10, 0.02, [30.0, 1, 1, 1, 1, 1]) == pytest.approx(50)


def test_the_next_checkpoint_is_one_interval_after_the_last_or_after_the_job_started() -> None:
    assert periodic.next_due(60, 0.02, [], None, running_since=1000) == 1060
    assert periodic.next_due(60, 0.02, [0.5], 1100, running_since=1000) == 1160
    # restored since its last checkpoint: counted from the restore
    assert periodic.next_due(60, 0.02, [0.5], 1100, running_since=1500) == 1560
    assert periodic.overhead([1, 1], 100) == 0.02 and periodic.overhead([1], 0) == 0


def samples(*points: tuple[float, float]) -> list[idle.Sample]:
    return [idle.Sample(at, cpu) for at, cpu in points]


def test_idle_only_when_watched_for_the_whole_window_with_almost_no_cpu() -> None:
    quiet = samples((0, 5.0), (5, 5.01), (10, 5.02))
    assert idle.is_idle(quiet, idle_after_s=10, now=10) is False  # the first sample is at the window's start
    assert idle.is_idle(quiet, idle_after_s=9, now=10)
    busy = samples((0, 5.0), (5, 6.0), (10, 7.0))  # 20 % of a core
    assert not idle.is_idle(busy, idle_after_s=9, now=10)
    assert not idle.is_idle(samples((9, 1.0), (10, 1.0)), idle_after_s=5, now=10)  # not watched long enough
    assert not idle.is_idle([], idle_after_s=5, now=10)


def test_cpu_time_lost_with_an_ended_process_is_no_negative_use() -> None:
    # a child ended between samples (its time left the sum), the rest used a lot: not idle
    points = samples((0, 10.0), (5, 2.0), (10, 4.0))
    assert not idle.is_idle(points, idle_after_s=9, now=10)


def test_trim_keeps_what_the_window_needs() -> None:
    points = samples((0, 1), (3, 1), (6, 1), (9, 1))
    assert idle.trim(points, idle_after_s=4, now=9) == samples((3, 1), (6, 1), (9, 1))
