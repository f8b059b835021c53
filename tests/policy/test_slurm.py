"""The Slurm supervisor's decisions (torpor.policy.slurm): which runs are restarts, the order in which a
restart tries checkpoints and falls back to a cold start, the cold start's name, and what becomes of the
Slurm job after each signal — on plain values, without Slurm."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from torpor.policy.slurm import (
    HOLD,
    PREEMPT,
    TERM,
    After,
    SlurmState,
    after_stop,
    asks_slurm,
    cold_start_name,
    fallback,
    intent,
    owns,
    restore_order,
    restores,
)


@dataclass(frozen=True)
class Ckpt:
    id: str
    job: str
    created_at: float


# -- starting -------------------------------------------------------------------------------------------


def test_only_a_restart_restores() -> None:
    assert not restores(0)
    assert restores(1) and restores(7)


def test_a_slurm_job_owns_its_first_run_and_its_cold_restarts_only() -> None:
    assert owns("42", "slurm-42") and owns("42", "slurm-42-r1") and owns("42", "slurm-42-r3-2")
    assert not owns("42", "slurm-421") and not owns("42", "slurm-4") and not owns("42", "other")


def test_a_restart_tries_the_jobs_checkpoints_newest_first_over_all_its_runs() -> None:
    checkpoints = [
        Ckpt("a", "slurm-42", 1),
        Ckpt("other", "slurm-421", 9),  # another Slurm job's
        Ckpt("c", "slurm-42-r1", 3),
        Ckpt("b", "slurm-42", 2),
        Ckpt("b2", "slurm-42", 2),  # as old as b: after it, as given
    ]
    assert [c.id for c in restore_order("42", checkpoints)] == ["c", "b", "b2", "a"]
    assert restore_order("42", []) == []


def test_each_failed_restore_falls_back_to_the_one_before_then_to_a_cold_start() -> None:
    candidates = restore_order("42", [Ckpt("a", "slurm-42", 1), Ckpt("b", "slurm-42", 2)])
    assert fallback(candidates, 0) == Ckpt("a", "slurm-42", 1)
    assert fallback(candidates, 1) is None


def test_a_cold_start_runs_under_a_name_of_its_own() -> None:
    assert cold_start_name("42", 0, set()) == "slurm-42"
    assert cold_start_name("42", 2, {"slurm-42"}) == "slurm-42-r2"
    assert cold_start_name("42", 2, {"slurm-42-r2", "slurm-42-r2-2"}) == "slurm-42-r2-3"


# -- stopping -------------------------------------------------------------------------------------------


def test_usr2_holds_and_the_other_signals_requeue() -> None:
    assert intent(HOLD) is After.HOLD
    assert intent(PREEMPT) is After.REQUEUE and intent(TERM) is After.REQUEUE
    assert (intent(HOLD).value, intent(PREEMPT).value) == ("hold", "requeue")  # the words the log uses


def test_only_sigterm_asks_slurm_first() -> None:
    assert asks_slurm(TERM) and not asks_slurm(PREEMPT) and not asks_slurm(HOLD)
    assert after_stop(PREEMPT, 0) is After.REQUEUE
    assert after_stop(HOLD, 3) is After.HOLD
    with pytest.raises(ValueError, match="Slurm's view"):
        after_stop(TERM, 0)


@pytest.mark.parametrize(
    ("slurm", "restart_count", "after"),
    [
        (SlurmState("RUNNING", 0), 0, After.REQUEUE),  # a SIGTERM not from Slurm (e.g. kill by hand)
        (SlurmState("RUNNING", 1), 0, After.SLURM_REQUEUES),  # Slurm's requeue already counted
        (SlurmState("COMPLETING", 1), 0, After.SLURM_REQUEUES),
        (SlurmState("CANCELLED", 0), 0, After.SLURM_ENDS),  # scancel
        (SlurmState("TIMEOUT", 2), 2, After.SLURM_ENDS),  # out of time, on its third run
        (SlurmState("RUNNING", 2), 2, After.REQUEUE),
    ],
)
def test_after_sigterm_slurm_may_be_requeueing_or_ending_the_job_itself(
    slurm: SlurmState, restart_count: int, after: After
) -> None:
    assert after_stop(TERM, restart_count, slurm) is after
