"""Watching for a spot, preemption or maintenance notice: the agent's ``--notice-url``.

:class:`NoticePoller` reads the endpoints :func:`torpor.policy.notices.endpoints` chose for the URL and
format, through :class:`torpor.adapters.notices.MetadataClient` (headers, IMDSv2 token, timeouts), and
reads each answer with :func:`torpor.policy.notices.read`. :class:`NoticeWatcher` polls in a thread and
calls ``on_notice`` once per notice (:func:`torpor.policy.notices.track`). What the agent does then —
evacuate (:mod:`torpor.policy.evacuation`), refuse new jobs, log — is the agent's.

Only a bad configuration raises (:class:`UsageError`, when the poller is made); a service that cannot be
reached or answers nonsense is "no notice" and a problem, which the watcher reports when it appears or
changes, not on every poll.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from torpor.adapters.notices import TIMEOUT_S, Answer, MetadataClient
from torpor.errors import UsageError
from torpor.policy import notices
from torpor.policy.notices import Endpoint, Notice

log = logging.getLogger(__name__)

#: how often to poll: AWS advises every 5 s for its two-minute warning; GCP gives 30 s
INTERVAL_S = 5.0
#: how far ahead of its deadline a notice is reported (AWS lists maintenance events days ahead)
HORIZON_S = 15 * 60.0


@dataclass(frozen=True)
class Poll:
    """One poll of every endpoint at ``at`` (epoch seconds): the notices found (in endpoint order), the
    problems, and the endpoints (URLs) that gave no clear answer (unreachable, or nonsense)."""

    at: float
    notices: tuple[Notice, ...]
    problems: tuple[str, ...]
    unsure: frozenset[str] = frozenset()

    @property
    def problem(self) -> str | None:
        """The problems as one line, ``None`` when there were none."""
        return "; ".join(self.problems) if self.problems else None


class NoticePoller:
    """Reads the metadata endpoints for ``url`` in ``fmt`` (``aws``, ``gcp`` or ``auto``) once per
    :meth:`poll`. ``wall`` (epoch seconds, the policy's ``now``) is an argument so that a test can move it.
    """

    def __init__(
        self,
        url: str,
        fmt: str = notices.AUTO,
        timeout_s: float = TIMEOUT_S,
        *,
        client: MetadataClient | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        resolved = notices.endpoints(url, fmt)
        if isinstance(resolved, str):
            raise UsageError(resolved)
        if not timeout_s > 0:
            raise UsageError(f"the notice timeout must be more than 0 s, not {timeout_s:g}")
        self.endpoints: tuple[Endpoint, ...] = resolved
        self.client = client if client is not None else MetadataClient(timeout_s)
        self._wall = wall

    def poll(self) -> Poll:
        """Read every endpoint once; never raises for what a service did or did not answer."""
        found: list[Notice] = []
        problems: list[str] = []
        unsure: set[str] = set()
        at = self._wall()
        for endpoint in self.endpoints:
            answer = self.client.get(endpoint.url, dict(endpoint.headers), endpoint.token_url)
            if not isinstance(answer, Answer):
                problems.append(answer)
                unsure.add(endpoint.url)
                continue
            reading = notices.read(endpoint, answer.status, answer.body, self._wall())
            if reading.notice is not None:
                found.append(reading.notice)
            if reading.problem is not None:
                problems.append(reading.problem)
                if reading.notice is None:
                    unsure.add(endpoint.url)
        return Poll(at, tuple(found), tuple(problems), frozenset(unsure))


class NoticeWatcher:
    """Polls every ``interval_s`` seconds in a daemon thread; calls ``on_notice(notice)`` once per notice.

    A notice is reported once it is :meth:`~torpor.policy.notices.Notice.due` (its deadline at most
    ``horizon_s`` away); until then it is in :attr:`pending`. It is reported again only if a clear answer
    saw it gone and a later one saw it back (:func:`torpor.policy.notices.track`). ``on_problem(text)`` is
    called when a poll's problems differ from the last poll's — ``None`` once they are over. Both callbacks
    run on the watcher's thread, outside its lock; what they raise is logged and the watcher goes on.
    ``poller`` replaces the one made from ``url``/``fmt``/``timeout_s``.
    """

    def __init__(
        self,
        url: str,
        fmt: str = notices.AUTO,
        interval_s: float = INTERVAL_S,
        on_notice: Callable[[Notice], None] = lambda notice: None,
        *,
        on_problem: Callable[[str | None], None] | None = None,
        horizon_s: float = HORIZON_S,
        timeout_s: float = TIMEOUT_S,
        poller: NoticePoller | None = None,
    ) -> None:
        if not interval_s > 0:
            raise UsageError(f"the notice interval must be more than 0 s, not {interval_s:g}")
        self.poller = poller if poller is not None else NoticePoller(url, fmt, timeout_s)
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        self._on_notice = on_notice
        self._on_problem = on_problem
        self._seen = notices.Seen()
        self._pending: tuple[Notice, ...] = ()
        self._problem: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def problem(self) -> str | None:
        """The last poll's problems, ``None`` when it had none."""
        return self._problem

    @property
    def pending(self) -> tuple[Notice, ...]:
        """Notices seen but not due yet (e.g. an AWS maintenance days away), for the agent to show."""
        return self._pending

    def poll_once(self) -> list[Notice]:
        """Poll now and report what is new; returns the notices this call reported."""
        with self._lock:
            result = self.poller.poll()
            update = notices.track(self._seen, result.notices, result.unsure, result.at, self.horizon_s)
            self._seen = update.seen
            self._pending = update.pending
            changed = result.problem != self._problem
            self._problem = result.problem
        if changed:
            self._call(self._on_problem, result.problem)
        for notice in update.new:
            self._call(self._on_notice, notice)
        return list(update.new)

    @staticmethod
    def _call(callback: Callable[..., None] | None, argument: object) -> None:
        if callback is None:
            return
        try:
            callback(argument)
        except Exception:
            log.exception("a notice callback failed; the watcher goes on")

    def start(self) -> NoticeWatcher:
        """Start polling in a daemon thread, the first poll at once; a second call does nothing."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="torpor-notices", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling; waits up to ``timeout_s`` for a poll under way (each request has its own timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                # a bug, not a service's answer: say so and keep watching (a missed notice loses work)
                log.exception("polling for notices failed")
            self._stop.wait(self.interval_s)

    def __enter__(self) -> NoticeWatcher:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
