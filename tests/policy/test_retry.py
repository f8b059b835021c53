"""Whether a failed dump is tried again: only a passing CRIU error, only while attempts are left."""

from __future__ import annotations

import pytest

from torpor.policy.retry import (
    DUMP_ATTEMPTS,
    GIVE_UP,
    STALE_CWD_FOLDER_S,
    Retry,
    after_failed_dump,
    after_failed_resume,
    cwd_folder_wait,
    stale_cwd_folder,
)

ZOMBIE = "(00.058879) Error (criu/seize.c:882): Zombies with threads are not supported"
OTHER = "(00.1) Error (criu/files.c:1): Can't dump a process with an unsupported file"


@pytest.mark.parametrize(("attempt", "delay"), [(1, 0.1), (2, 0.2)])
def test_a_passing_error_is_tried_again_with_a_growing_delay(attempt: int, delay: float) -> None:
    assert after_failed_dump(attempt, [OTHER, ZOMBIE]) == Retry(again=True, delay_s=pytest.approx(delay))


def test_the_last_attempt_gives_up() -> None:
    assert DUMP_ATTEMPTS == 3
    assert after_failed_dump(DUMP_ATTEMPTS, [ZOMBIE]) == GIVE_UP
    assert after_failed_dump(DUMP_ATTEMPTS + 1, [ZOMBIE]) == GIVE_UP


def test_any_other_error_gives_up_at_once() -> None:
    assert after_failed_dump(1, [OTHER]) == GIVE_UP


def test_no_log_lines_give_up() -> None:
    assert after_failed_dump(1, []) == GIVE_UP


def test_a_failed_resume_is_tried_again_later_and_later_up_to_five_minutes() -> None:
    waits = [after_failed_resume(n) for n in range(1, 10)]
    assert waits[:4] == [5.0, 10.0, 20.0, 40.0]
    assert waits == sorted(waits) and max(waits) == 300.0


def test_a_dump_without_the_tcp_options_that_met_a_connection_is_made_again_at_once_with_them() -> None:
    tcp_error = "(00.2) Error (criu/sk-inet.c:197): inet: Connected TCP socket, consider using --tcp-established option."
    assert after_failed_dump(1, [tcp_error], tcp=False) == Retry(again=True, tcp=True)
    assert after_failed_dump(1, [tcp_error], tcp=True) == GIVE_UP  # with them already: it is something else
    assert after_failed_dump(DUMP_ATTEMPTS, [tcp_error], tcp=False) == GIVE_UP
    assert after_failed_dump(1, [ZOMBIE], tcp=False) == Retry(
        again=True, delay_s=pytest.approx(0.1), tcp=False
    )


def test_a_dump_that_met_another_in_the_same_folder_is_made_again_after_a_jittered_delay() -> None:
    busy = "pie: 1: Error (criu/pie/parasite.c:634): Can't create a directory (-17)"
    assert after_failed_dump(1, [busy], tcp=False, jitter=0.0) == Retry(
        again=True, delay_s=pytest.approx(0.1), tcp=False
    )
    assert after_failed_dump(2, [busy], jitter=0.5) == Retry(again=True, delay_s=pytest.approx(0.3))
    assert after_failed_dump(DUMP_ATTEMPTS, [busy]) == GIVE_UP


def test_only_a_folder_of_root_s_older_than_a_dump_s_moment_is_taken_for_a_dead_criu_s() -> None:
    assert stale_cwd_folder(STALE_CWD_FOLDER_S + 1, 0)
    assert not stale_cwd_folder(0.01, 0)  # another dump's, there for a moment
    assert not stale_cwd_folder(3600, 1000)  # put there by a user: not torpor's to remove


def test_a_young_folder_of_root_s_is_waited_for_until_it_would_be_stale_and_no_longer() -> None:
    """A dump that meets one a CRIU killed a moment ago waits it out (then removes it) rather than
    failing every attempt; one to remove now, or someone else's, is not waited for."""
    wait = cwd_folder_wait(1.0, 0)
    assert STALE_CWD_FOLDER_S - 1.0 < wait <= STALE_CWD_FOLDER_S
    assert stale_cwd_folder(1.0 + wait, 0)
    assert cwd_folder_wait(STALE_CWD_FOLDER_S + 1, 0) == 0.0
    assert cwd_folder_wait(0.5, 1000) == 0.0
    assert cwd_folder_wait(-2.0, 0) <= STALE_CWD_FOLDER_S + 1  # a clock set back: still bounded
