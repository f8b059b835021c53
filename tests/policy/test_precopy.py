"""policy.precopy: when the rounds of a pre-copied checkpoint stop and the job is frozen."""

from __future__ import annotations

from torpor.policy.precopy import Limits, Round, next_step

GIB = 2**30
MIB = 2**20


def test_the_first_round_copies_everything_and_a_resting_job_is_frozen_after_it() -> None:
    assert next_step([], 4 * GIB).again
    done = [Round(4 * GIB, 3.0)]
    frozen = next_step(done, 40 * 4096)
    assert not frozen.again and "little is left" in frozen.why


def test_a_job_that_rewrites_all_its_memory_gets_one_round() -> None:
    stop = next_step([Round(GIB, 1.0)], GIB - MIB)  # a training step rewrote nearly all of it
    assert not stop.again and "as fast as the rounds copy" in stop.why


def test_rounds_go_on_while_they_shrink_and_end_at_the_most() -> None:
    rounds = [Round(4 * GIB, 3.0), Round(400 * MIB, 0.3), Round(40 * MIB, 0.03)]
    assert next_step(rounds, 4 * MIB).again  # 10 % of the round before
    assert not next_step(rounds, 39 * MIB).again  # shrank by less than 10 %
    many = [Round(GIB >> n, 0.1) for n in range(8)]
    last = next_step(many, 1 * MIB)
    assert not last.again and last.why == "8 rounds, the most"
    assert next_step(many, 1 * MIB, Limits(most=9)).again
