"""How a job is stopped: the SIGTERM → SIGKILL escalation, as data.

The core sends each step's signal to the job's root (PID 1 of its namespace) and waits up to the step's
time for it to be gone, stopping at the first step after which it is; sending signals and watching
/proc is the core's (:meth:`torpor.core.engine.Engine.stop`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

#: how long to wait after SIGKILL for the job's root to be gone
KILL_WAIT_S = 10.0


@dataclass(frozen=True)
class StopStep:
    """Send ``signal``, then wait up to ``wait_s`` seconds for the job to be gone."""

    signal: signal.Signals
    wait_s: float


def escalation(grace_s: float) -> tuple[StopStep, ...]:
    """SIGTERM with ``grace_s`` to handle it, then SIGKILL; no SIGTERM at all when ``grace_s`` <= 0."""
    kill = StopStep(signal.SIGKILL, KILL_WAIT_S)
    if grace_s <= 0:
        return (kill,)
    return (StopStep(signal.SIGTERM, grace_s), kill)
