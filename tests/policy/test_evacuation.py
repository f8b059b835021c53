"""The evacuation's decisions (torpor.policy.evacuation): the order of the jobs (priority, then the longest
since a checkpoint), which are hibernated, waited for or left alone, when each is expected durable with
N checkpoints at a time; the report of what was saved; and which jobs the next start resumes — on
snapshots built in a line, and as properties over many random ones."""

from __future__ import annotations

import random

import pytest

from torpor.policy import notices
from torpor.policy.evacuation import (
    HIBERNATE,
    MOVED,
    WAIT,
    Failure,
    Job,
    Outcome,
    Plan,
    Skip,
    Step,
    durable_estimate,
    plan,
    rank,
    report,
    resumes_at_boot,
    to_resume,
)

NOW = 10_000.0
MiB = 1 << 20


def _names(jobs: list[Job]) -> list[str]:
    return [job.name for job in jobs]


# -- the order -------------------------------------------------------------------------------------------


def test_higher_priority_goes_first_whatever_its_checkpoints() -> None:
    jobs = [Job("low", "running", priority=0), Job("high", "running", priority=5, last_checkpoint_at=NOW - 1)]
    assert _names(rank(jobs)) == ["high", "low"]


def test_within_a_priority_the_longest_since_its_last_checkpoint_goes_first() -> None:
    jobs = [
        Job("recent", "running", last_checkpoint_at=NOW - 60),
        Job("old", "running", last_checkpoint_at=NOW - 3600),
        Job("middle", "running", last_checkpoint_at=NOW - 600),
    ]
    assert _names(rank(jobs)) == ["old", "middle", "recent"]


def test_never_checkpointed_counts_as_longest_and_of_those_the_one_running_longest_goes_first() -> None:
    jobs = [
        Job("ancient-checkpoint", "running", last_checkpoint_at=0.0, started_at=0.0),
        Job("fresh", "running", started_at=NOW - 5),
        Job("long", "running", started_at=NOW - 7200),
    ]
    assert _names(rank(jobs)) == ["long", "fresh", "ancient-checkpoint"]


def test_ties_go_by_name_so_the_order_does_not_depend_on_the_input_s() -> None:
    jobs = [Job("b", "running"), Job("c", "running"), Job("a", "running")]
    assert _names(rank(jobs)) == ["a", "b", "c"]


# -- what is done with each job --------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["running", "starting", "checkpointing", "restoring"])
def test_a_job_with_processes_is_hibernated(state: str) -> None:
    assert plan([Job("j", state, durable_s=3)], NOW, NOW + 120).steps == (
        Step("j", HIBERNATE, NOW, NOW + 3, True),
    )


def test_a_hibernation_under_way_or_an_image_not_durable_yet_is_waited_for() -> None:
    jobs = [
        Job("going", "hibernating", durable_s=4),
        Job("uploading", "hibernated", image_durable=False, durable_s=2),
    ]
    steps = plan(jobs, NOW, NOW + 120).steps
    assert {(s.name, s.action, s.done_at) for s in steps} == {
        ("going", WAIT, NOW + 4),
        ("uploading", WAIT, NOW + 2),
    }


def test_jobs_with_nothing_to_save_are_left_alone_saying_why() -> None:
    jobs = [
        Job("safe", "hibernated"),
        Job("done", "exited"),
        Job("broke", "failed"),
        Job("odd", "zombie"),
        Job("away", MOVED, image_durable=False),
    ]
    evacuation = plan(jobs, NOW, NOW + 120)
    assert evacuation.steps == ()
    assert evacuation.skipped == (
        Skip("away", "moved to a peer: it is that machine's"),
        Skip("broke", "failed: no processes to save"),
        Skip("done", "exited: no processes to save"),
        Skip("odd", "state 'zombie' is not one an evacuation knows"),
        Skip("safe", "hibernated, its image durable already", safe=True),
    )
    assert evacuation.done_at == NOW and evacuation.fits


# -- when each is expected durable --------------------------------------------------------------------------


def test_checkpoints_share_the_slots_in_order_and_those_past_the_deadline_are_marked_late() -> None:
    jobs = [Job(name, "running", priority=p, durable_s=10) for name, p in [("a", 3), ("b", 2), ("c", 1)]]
    evacuation = plan(jobs, NOW, NOW + 15, parallelism=2)
    assert evacuation.steps == (
        Step("a", HIBERNATE, NOW, NOW + 10, True),
        Step("b", HIBERNATE, NOW, NOW + 10, True),
        Step("c", HIBERNATE, NOW + 10, NOW + 20, False),
    )
    assert evacuation.late == ("c",) and not evacuation.fits and evacuation.done_at == NOW + 20


def test_a_late_job_is_still_planned_the_deadline_is_only_a_promise() -> None:
    evacuation = plan([Job("huge", "running", durable_s=600)], NOW, NOW + 120)
    assert [s.name for s in evacuation.steps] == ["huge"] and evacuation.late == ("huge",)


def test_a_wait_takes_no_checkpoint_slot() -> None:
    jobs = [
        Job("up", "hibernated", priority=9, image_durable=False, durable_s=50),
        Job("run", "running", durable_s=5),
    ]
    steps = {s.name: s for s in plan(jobs, NOW, NOW + 120, parallelism=1).steps}
    assert steps["run"].start_at == NOW


def test_no_deadline_fits_everything_and_no_parallelism_means_one() -> None:
    evacuation = plan(
        [Job("a", "running", durable_s=5), Job("b", "running", durable_s=5)], NOW, None, parallelism=0
    )
    assert evacuation.parallelism == 1 and evacuation.fits and evacuation.done_at == NOW + 10


def _random_jobs(chance: random.Random) -> list[Job]:
    states = [
        "running",
        "running",
        "starting",
        "checkpointing",
        "restoring",
        "hibernating",
        "hibernated",
        "exited",
        "failed",
    ]
    jobs = []
    for index in range(chance.randrange(0, 30)):
        checkpointed = chance.random() < 0.7
        jobs.append(
            Job(
                f"job{index}",
                chance.choice(states),
                priority=chance.randrange(-2, 3),
                last_checkpoint_at=chance.uniform(0, NOW) if checkpointed else None,
                started_at=chance.uniform(0, NOW),
                durable_s=chance.uniform(0, 60),
                image_durable=chance.random() < 0.5,
            )
        )
    return jobs


def test_properties_of_plans_over_random_snapshots() -> None:
    chance = random.Random(4)
    for _ in range(500):
        jobs = _random_jobs(chance)
        parallelism = chance.randrange(1, 5)
        deadline = NOW + chance.uniform(0, 120)
        evacuation = plan(jobs, NOW, deadline, parallelism)
        # every job appears exactly once, and every one with processes is hibernated
        listed = [s.name for s in evacuation.steps] + [s.name for s in evacuation.skipped]
        assert sorted(listed) == sorted(job.name for job in jobs)
        by_name = {job.name: job for job in jobs}
        hibernated = [s for s in evacuation.steps if s.action == HIBERNATE]
        assert {s.name for s in hibernated} == {
            j.name for j in jobs if j.state in {"running", "starting", "checkpointing", "restoring"}
        }
        # the order respects priority, then never checkpointed, then the oldest checkpoint
        keys = [
            (
                -by_name[s.name].priority,
                by_name[s.name].last_checkpoint_at is not None,
                by_name[s.name].last_checkpoint_at or 0.0,
            )
            for s in hibernated
        ]
        assert keys == sorted(keys)
        # checkpoints start in order, never more than `parallelism` at a time, each as long as its estimate
        starts = [s.start_at for s in hibernated]
        assert starts == sorted(starts)
        for step in hibernated:
            running = sum(1 for other in hibernated if other.start_at <= step.start_at < other.done_at)
            assert running <= parallelism
            assert step.done_at == pytest.approx(step.start_at + by_name[step.name].durable_s)
            assert step.fits == (step.done_at <= deadline)
        # the same jobs in another order give the same plan
        shuffled = list(jobs)
        chance.shuffle(shuffled)
        assert plan(shuffled, NOW, deadline, parallelism) == evacuation


# -- estimates ------------------------------------------------------------------------------------------------


def test_the_durable_estimate_goes_at_the_last_checkpoint_s_rate_or_a_default_one() -> None:
    assert durable_estimate(1024 * MiB, last_size_bytes=512 * MiB, last_durable_s=2.0) == pytest.approx(4.0)
    assert durable_estimate(512 * MiB) == pytest.approx(2.0)  # the default 256 MiB/s
    assert durable_estimate(512 * MiB, last_size_bytes=512 * MiB, last_durable_s=0.0) == pytest.approx(2.0)
    assert durable_estimate(0) == 0.0


# -- the report ------------------------------------------------------------------------------------------------


def _evacuation() -> Plan:
    jobs = [
        Job("a", "running", priority=4, durable_s=5),
        Job("b", "running", priority=3, durable_s=5),
        Job("c", "running", priority=2, durable_s=5),
        Job("d", "running", priority=1, durable_s=5),
        Job("up", "hibernated", image_durable=False, durable_s=1),
        Job("safe", "hibernated"),
        Job("gone", "exited"),
    ]
    return plan(jobs, NOW, NOW + 30, parallelism=2)


def test_the_report_sorts_every_job_by_what_became_of_it() -> None:
    outcomes = [
        Outcome("a", True, NOW + 5, checkpoint="c1"),
        Outcome("b", False, NOW + 3, error="CRIU: Can't dump io_uring"),
        Outcome("c", True, NOW + 40),
        Outcome("up", True, NOW + 2),
    ]
    done = report(_evacuation(), outcomes, at=NOW + 45)
    assert done.saved == ("a", "up")
    assert done.late == ("c",)
    assert done.failed == (Failure("b", "CRIU: Can't dump io_uring"),)
    assert done.unfinished == ("d",)
    assert done.already_safe == ("safe",)
    assert done.skipped == (Skip("gone", "exited: no processes to save"),)
    assert done.not_in_time == ("c", "d") and not done.complete
    # only the jobs it hibernated itself are candidates to resume: not "up", hibernated before it began
    assert done.hibernated == ("a", "c")
    assert done.summary == (
        "2 of 5 jobs saved by the deadline, 1 late (c), 1 not finished (d), "
        "1 failed (b: CRIU: Can't dump io_uring), 1 already safe"
    )


def test_a_job_a_peer_took_is_saved_and_not_one_to_resume_here() -> None:
    outcomes = [Outcome("a", True, NOW + 5, moved_to="b"), Outcome("c", True, NOW + 9)]
    done = report(_evacuation(), outcomes, at=NOW + 45)
    assert done.saved == ("a", "c") and done.moved == (("a", "b"),)
    assert done.hibernated == ("c",)
    assert done.summary.startswith("2 of 5 jobs saved by the deadline, 1 moved to peers (a to b), ")


def test_what_had_not_happened_yet_when_the_report_was_made_is_unfinished() -> None:
    done = report(_evacuation(), [Outcome("a", True, NOW + 5), Outcome("b", True, NOW + 50)], at=NOW + 20)
    assert done.saved == ("a",) and "b" in done.unfinished


def test_outcomes_of_other_jobs_are_left_out_and_the_last_of_a_job_counts() -> None:
    outcomes = [
        Outcome("stranger", True, NOW),
        Outcome("a", False, NOW + 1, error="x"),
        Outcome("a", True, NOW + 6),
    ]
    done = report(_evacuation(), outcomes, at=NOW + 10)
    assert done.saved == ("a",) and done.failed == ()
    assert "stranger" not in done.saved + done.late + done.unfinished


def test_a_failure_without_a_message_still_says_failed() -> None:
    assert report(_evacuation(), [Outcome("a", False, NOW)], at=NOW + 1).failed == (Failure("a", "failed"),)


def test_everything_saved_in_time_is_complete() -> None:
    evacuation = plan([Job("a", "running", durable_s=1)], NOW, NOW + 10)
    done = report(evacuation, [Outcome("a", True, NOW + 1)], at=NOW + 1)
    assert done.complete and done.summary == "1 of 1 jobs saved by the deadline"


def test_every_job_of_a_plan_is_in_exactly_one_list_of_its_report() -> None:
    chance = random.Random(9)
    for _ in range(300):
        evacuation = plan(_random_jobs(chance), NOW, NOW + 60, chance.randrange(1, 4))
        outcomes = [
            Outcome(
                step.name,
                chance.random() < 0.7,
                NOW + chance.uniform(0, 100),
                error=chance.choice([None, "boom"]),
            )
            for step in evacuation.steps
            if chance.random() < 0.8
        ]
        done = report(evacuation, outcomes, at=NOW + chance.uniform(0, 100))
        lists = [
            *done.saved,
            *done.late,
            *(f.name for f in done.failed),
            *done.unfinished,
            *done.already_safe,
            *(s.name for s in done.skipped),
        ]
        expected = [s.name for s in evacuation.steps] + [s.name for s in evacuation.skipped]
        assert sorted(lists) == sorted(expected)
        assert set(done.hibernated) <= set(done.saved + done.late)


# -- at the next start ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("notice", "resumes"),
    [
        (notices.local(notices.SHUTDOWN, None, "SIGTERM"), True),
        (notices.local(notices.DRAIN, None, "torpor drain"), False),
        (notices.Notice("spot", "u", NOW, "t", action="terminate"), False),
        (notices.Notice("spot", "u", NOW, "t", action="stop"), True),
        (notices.Notice("spot", "u", NOW, "t", action="hibernate"), True),
        (notices.Notice("maintenance", "u", NOW, "t", action="reboot"), True),
        (notices.Notice("maintenance", "u", NOW, "t", action="terminate"), False),
    ],
)
def test_which_evacuations_resume_their_jobs_at_the_next_start(notice: notices.Notice, resumes: bool) -> None:
    assert resumes_at_boot(notice) is resumes


def test_at_the_next_start_only_jobs_still_hibernated_are_resumed_most_valuable_first() -> None:
    states = {"a": "hibernated", "b": "running", "c": "hibernated", "d": "hibernated"}
    assert to_resume(["c", "a", "b", "gone", "c"], states) == ("c", "a")
