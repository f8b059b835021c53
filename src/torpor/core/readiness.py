"""Waiting for a warm start's first run to be ready: :func:`watch` looks at the job until
:mod:`torpor.policy.ready` says READY or GIVE_UP.

It blocks; the launcher runs it in a thread of its own and saves the template, or not, on the verdict. What
ready means and when to look again are the policy's; the looking — a connection to the port, the lines
appended to the log, the CPU time of the job's processes — is :mod:`torpor.adapters.readiness`'s and
:mod:`torpor.adapters.system.procfs`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from torpor.adapters import readiness
from torpor.adapters.system import procfs
from torpor.errors import UsageError
from torpor.policy import ready
from torpor.policy.ready import Observation, Outcome, ReadyKind, ReadyWhen, Verdict

#: how long one connection attempt to the job's port may take
CONNECT_TIMEOUT_S = 1.0


def read_ready_when(text: str) -> ReadyWhen:
    """``--ready-when``'s SPEC (:func:`torpor.policy.ready.parse_ready_when`); :class:`UsageError` if bad."""
    try:
        return ready.parse_ready_when(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def watch(
    ready_when: ReadyWhen,
    root_pid: int,
    log_path: Path,
    log_offset: int,
    *,
    stop: threading.Event | None = None,
    timeout_s: float = ready.DEFAULT_TIMEOUT_S,
    started_at: float | None = None,
    members: Callable[[int], list[int]] = procfs.namespace_members,
    clock: Callable[[], float] = time.monotonic,
) -> Verdict:
    """Look at the job until :func:`~torpor.policy.ready.decide` says READY or GIVE_UP, and return that.

    ``root_pid`` is the job's first process: once it has exited (or its pid names another process) the
    verdict is GIVE_UP. ``log_offset`` is the log's size when the job started: what was there before is
    not the job's. ``started_at`` is when the job started, on ``clock`` (default: now); the elapsed time,
    the ``idle`` window and ``timeout_s`` count from it, and the verdict's ``at`` is the seconds it took.
    ``members`` gives the processes whose CPU time counts, with the children they reaped (default: the
    PID namespace whose init is ``root_pid``). When ``stop`` is set first, the latest WAIT verdict is
    returned, within a poll interval (at most half a second).

    Nothing is looked at but what the rule needs: ``port:`` connects (a connection the job may still hold
    when the template is dumped: see :func:`torpor.adapters.readiness.port_accepts`), ``log:`` reads the
    log, ``idle:`` reads /proc.
    """
    start = clock() if started_at is None else started_at
    stop = stop if stop is not None else threading.Event()
    ticks = procfs.start_ticks(root_pid)
    follower = readiness.LogFollower(log_path, log_offset)
    matched = False
    history: list[Observation] = []
    verdict = Verdict(Outcome.WAIT, "nothing observed yet", 0.0)
    while not stop.is_set():
        alive = ticks is not None and procfs.is_alive(root_pid) and procfs.start_ticks(root_pid) == ticks
        accepts, cpu = False, None
        if ready_when.kind == ReadyKind.PORT:
            accepts = readiness.port_accepts(ready_when.host, ready_when.port, CONNECT_TIMEOUT_S)
        elif ready_when.kind == ReadyKind.LOG:
            matched = matched or any(ready_when.matches(line) for line in follower.new_lines())
        else:
            cpu = procfs.cpu_seconds_with_children(members(root_pid))
        history.append(Observation(clock() - start, alive, accepts, matched, cpu))
        verdict = ready.decide(ready_when, history, timeout_s)
        if verdict.outcome != Outcome.WAIT:
            return verdict
        history = ready.trim(ready_when, history)
        stop.wait(ready.poll_interval(ready_when, verdict.at))
    return verdict
