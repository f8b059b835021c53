"""The SIGTERM → SIGKILL escalation of ``torpor stop`` as data."""

from __future__ import annotations

import signal

from torpor.policy.stop import KILL_WAIT_S, StopStep, escalation


def test_a_grace_period_gives_sigterm_first_then_sigkill() -> None:
    assert escalation(5.0) == (StopStep(signal.SIGTERM, 5.0), StopStep(signal.SIGKILL, KILL_WAIT_S))


def test_no_grace_goes_straight_to_sigkill() -> None:
    assert escalation(0) == (StopStep(signal.SIGKILL, KILL_WAIT_S),)
    assert escalation(-1.0) == (StopStep(signal.SIGKILL, KILL_WAIT_S),)


def test_a_tiny_grace_still_sends_sigterm() -> None:
    assert escalation(0.01)[0] == StopStep(signal.SIGTERM, 0.01)
