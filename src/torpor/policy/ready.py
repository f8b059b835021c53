"""When a warm start's first, cold run is *ready*, so that its template (a checkpoint) is worth saving.

``torpor run --warm-start --ready-when SPEC`` runs a job cold the first time and checkpoints it once it is
ready; later starts restore that template instead of starting again. SPEC says what ready means:

- ``port:N`` (or ``port:HOST:N``, HOST an IPv4 or IPv6 literal or ``localhost``; ``[::1]`` may be
  bracketed): TCP port N on HOST (127.0.0.1 by default) accepts a connection;
- ``log:REGEX``: a line the job wrote to its log since it started matches REGEX (``re.search``, the line
  without its end of line);
- ``idle:D`` (D a duration: ``2s``, ``500ms``, ``1m``): the job's processes together used less than
  :data:`IDLE_THRESHOLD` of one core over the last D, counted from the job's start, so a job idle from
  its first instant is ready after D.

This module parses SPEC (:func:`parse_ready_when`), decides from what was observed (:func:`decide`) and
says when to look again (:func:`poll_interval`). It does no I/O: looking — connecting to the port,
following the log, reading the processes' CPU time — is :mod:`torpor.adapters.readiness`'s, and acting on
the verdict (saving the template, or not) the launcher's. Bad input raises ValueError with a one-line
message for the user; the caller turns it into a ``UsageError`` (this layer imports nothing of torpor's
outside it).
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from torpor.policy.jobpolicy import format_duration, parse_duration

#: the share of one core under which a job counts as idle (5 %): a server at its accept loop, with a
#: heartbeat or garbage-collector thread, stays well below it, while loading (imports, weights, a JIT)
#: runs at ~100 %; and /proc counts CPU time in 10 ms ticks, so 1 % could not be told from 0 over a window
#: shorter than a second, where 5 % of ``idle:500ms`` still allows two ticks
IDLE_THRESHOLD = 0.05

#: the shortest ``idle:`` window: under it, 5 % of the window is less than one 10 ms tick of /proc
MIN_IDLE_S = 0.2

#: how long a caller waits for readiness before it gives up (10 min: a model server loading its weights
#: takes minutes; one still not ready after ten is not a start worth a template)
DEFAULT_TIMEOUT_S = 600.0

#: the first interval between two looks: a job ready at once is seen within 50 ms
MIN_POLL_S = 0.05

#: the longest interval between two looks, reached after 5 s of waiting
MAX_POLL_S = 0.5

#: the host ``port:N`` connects to
DEFAULT_HOST = "127.0.0.1"

_PORT = re.compile(r"[0-9]+")


class ReadyKind(enum.StrEnum):
    """What readiness is watched for: the word before the first ``:`` of SPEC."""

    PORT = "port"
    LOG = "log"
    IDLE = "idle"


@dataclass(frozen=True)
class ReadyWhen:
    """One ``--ready-when`` SPEC; ``str()`` writes it back in its canonical form, which parses to an equal one.

    Only the fields of its ``kind`` are meaningful; the others keep their defaults. Build one with
    :func:`parse_ready_when` or the class methods; the constructor checks the fields (ValueError).
    """

    kind: ReadyKind
    #: ``port``: the host to connect to (a normalised IP literal, or ``localhost``)
    host: str = DEFAULT_HOST
    #: ``port``: the TCP port, 1 to 65535
    port: int = 0
    #: ``log``: the regular expression a line must contain a match of
    pattern: str = ""
    #: ``idle``: the window (seconds) over which the job must stay under :data:`IDLE_THRESHOLD`
    window_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind == ReadyKind.PORT:
            if not 0 < self.port < 65536:
                raise ValueError(f"a TCP port is 1 to 65535, not {self.port}")
            object.__setattr__(self, "host", _host(self.host))
        elif self.kind == ReadyKind.LOG:
            if not self.pattern:
                raise ValueError("a regular expression is needed, e.g. log:Listening on")
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"not a regular expression ({exc})") from None
        elif self.window_s < MIN_IDLE_S:
            raise ValueError(
                f"the idle window must be at least {format_duration(MIN_IDLE_S)}, not "
                f"{format_duration(self.window_s)} (CPU time is counted in 10 ms ticks)"
            )

    @classmethod
    def port_open(cls, port: int, host: str = DEFAULT_HOST) -> ReadyWhen:
        return cls(ReadyKind.PORT, host=host, port=port)

    @classmethod
    def log_match(cls, pattern: str) -> ReadyWhen:
        return cls(ReadyKind.LOG, pattern=pattern)

    @classmethod
    def cpu_idle(cls, window_s: float) -> ReadyWhen:
        return cls(ReadyKind.IDLE, window_s=window_s)

    def matches(self, line: str) -> bool:
        """Whether ``line`` (a log line without its end of line) makes a ``log:`` job ready."""
        return self.kind == ReadyKind.LOG and re.search(self.pattern, line) is not None

    def __str__(self) -> str:
        if self.kind == ReadyKind.PORT:
            if self.host == DEFAULT_HOST:
                return f"port:{self.port}"
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"port:{host}:{self.port}"
        if self.kind == ReadyKind.LOG:
            return f"log:{self.pattern}"
        return f"idle:{format_duration(self.window_s)}"


def _host(text: str) -> str:
    """``text`` as an IP literal in its normal form (``::1``, not ``0:0::1``), or ``localhost``."""
    if text.lower() == "localhost":
        return "localhost"
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError(
            f"'{text}' is not an IP address: write an IPv4 or IPv6 literal, or localhost"
        ) from None


def parse_ready_when(text: str) -> ReadyWhen:
    """The :class:`ReadyWhen` that ``text`` (``port:8080``, ``log:Listening on``, ``idle:2s``) says.

    The kind is read without regard to case and blanks around it; a ``log:`` pattern is taken as written,
    blanks included. Raises ValueError, with a one-line message that quotes ``text``, for an empty SPEC, an
    unknown kind, a port outside 1..65535 or a host that is not an IP literal or ``localhost``, a pattern
    that does not compile (with the ``re`` error) and a duration that does not parse or is too short.
    """
    kinds = ", ".join(f"{kind}:" for kind in ReadyKind)
    word, colon, rest = text.partition(":")
    if not colon:
        what = "is empty" if not text.strip() else "names no kind"
        raise ValueError(f"--ready-when '{text}' {what}: write {kinds} and its value, e.g. port:8080")
    try:
        kind = ReadyKind(word.strip().lower())
    except ValueError:
        raise ValueError(f"--ready-when '{text}': unknown kind '{word.strip()}' (known: {kinds})") from None
    try:
        if kind == ReadyKind.PORT:
            host, port = _host_and_port(rest.strip())
            return ReadyWhen.port_open(port, host)
        if kind == ReadyKind.LOG:
            return ReadyWhen.log_match(rest)
        return ReadyWhen.cpu_idle(parse_duration(rest))
    except ValueError as exc:
        raise ValueError(f"--ready-when '{text}': {exc}") from None


def _host_and_port(text: str) -> tuple[str, int]:
    """``N``, ``HOST:N`` or ``[HOST]:N`` split into host and port (DEFAULT_HOST when none is given)."""
    host, _, port = text.rpartition(":")
    if not port:
        raise ValueError("a port number is needed, e.g. port:8080 or port:HOST:8080")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not _PORT.fullmatch(port):
        raise ValueError(f"'{port}' is not a port number: write port:N or port:HOST:N, e.g. port:8080")
    return host or DEFAULT_HOST, int(port)


@dataclass(frozen=True)
class Observation:
    """What the watcher saw of the job at one moment, ``at`` seconds after the job started.

    Only what the rule needs is looked at; the rest keeps its default.
    """

    at: float
    #: whether the job still runs (its first process has not exited)
    alive: bool = True
    #: ``port``: whether the port accepted a connection now
    port_accepts: bool = False
    #: ``log``: whether a matching line has been written since the job started (up to ``at``): once
    #: true, it stays true in later observations
    log_matched: bool = False
    #: ``idle``: the CPU time (user + system, seconds) the job's processes have used since it started
    cpu_s: float | None = None


class Outcome(enum.StrEnum):
    READY = "ready"  # save the template now
    WAIT = "wait"  # look again after poll_interval()
    GIVE_UP = "give-up"  # no template: the job exited, or did not get ready in time


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` concluded, why (one line for the job's log), and when (seconds since start)."""

    outcome: Outcome
    reason: str
    at: float


def decide(
    ready_when: ReadyWhen, history: Sequence[Observation], timeout_s: float = DEFAULT_TIMEOUT_S
) -> Verdict:
    """Whether the job is ready, judged on the observations so far (oldest first; :func:`trim` tells which
    the next call still needs). The latest one's ``at`` is the time elapsed since the job started.

    In this order: GIVE_UP when the latest observation saw the job gone (there is nothing left to save, even
    if it got ready first); READY when the rule holds; GIVE_UP once ``timeout_s`` have passed; WAIT
    otherwise. GIVE_UP only means no template: the job itself runs on, untouched. A rule met at the timeout
    is READY.

    - ``port``: the latest observation's port accepted;
    - ``log``: a matching line was seen (the latest observation says so);
    - ``idle``: the CPU used between the last observation at or before ``at - window_s`` (the job's start,
      with 0 s used, when there is none) and the latest is under :data:`IDLE_THRESHOLD` of that span. Before
      ``window_s`` have passed it is not ready: the window is counted from the start. CPU time that went
      down between two observations (a process ended, taking its time with it) counts as none used, not
      as negative use. Observations without ``cpu_s`` are left out.
    """
    if not history:
        return Verdict(Outcome.WAIT, "nothing observed yet", 0.0)
    latest = history[-1]
    at = latest.at
    if not latest.alive:
        return Verdict(Outcome.GIVE_UP, f"the job exited after {at:.1f}s, before it was ready", at)
    ready, why = _rule(ready_when, history)
    if ready:
        return Verdict(Outcome.READY, f"{why} after {at:.1f}s", at)
    if at >= timeout_s:
        return Verdict(Outcome.GIVE_UP, f"not ready after {format_duration(timeout_s)}: {why}", at)
    return Verdict(Outcome.WAIT, why, at)


def _rule(ready_when: ReadyWhen, history: Sequence[Observation]) -> tuple[bool, str]:
    """Whether the rule holds on ``history``, and the words that say so (or say why not)."""
    latest = history[-1]
    if ready_when.kind == ReadyKind.PORT:
        address = f"{ready_when.host}:{ready_when.port}"
        if latest.port_accepts:
            return True, f"port {address} accepted a connection"
        return False, f"port {address} did not accept a connection"
    if ready_when.kind == ReadyKind.LOG:
        if latest.log_matched:
            return True, f"a line of the log matched '{ready_when.pattern}'"
        return False, f"no line of the log matched '{ready_when.pattern}'"
    window = format_duration(ready_when.window_s)
    measured = _cpu_window(ready_when.window_s, history)
    if measured is None:
        return False, f"watched for less than {window}"
    used, span = measured
    share = used / span
    ready = used < IDLE_THRESHOLD * span
    words = "under" if ready else "not under"
    return ready, (
        f"CPU use over the last {window} was {share:.0%} of one core ({used:.2f}s in {span:.1f}s), "
        f"{words} {IDLE_THRESHOLD:.0%}"
    )


def _cpu_window(window_s: float, history: Sequence[Observation]) -> tuple[float, float] | None:
    """CPU seconds used over the window that ends at the latest observation, and that window's measured
    span (at least ``window_s``); None before ``window_s`` have passed, or when the latest observation has
    no CPU time (the window is not measured to its end)."""
    latest = history[-1]
    start = latest.at - window_s
    if start < 0 or latest.cpu_s is None:
        return None
    # the job's start is a sample: its processes had used nothing yet
    samples = [(0.0, 0.0), *((o.at, o.cpu_s) for o in history if o.cpu_s is not None)]
    first = max(i for i, (at, _) in enumerate(samples) if at <= start)
    points = samples[first:]
    used = sum(max(0.0, b - a) for (_, a), (_, b) in pairwise(points))
    return used, points[-1][0] - points[0][0]


def trim(ready_when: ReadyWhen, history: Sequence[Observation]) -> list[Observation]:
    """The observations a later :func:`decide` still needs, once a newer one is added: the latest for
    ``port`` and ``log``; for ``idle``, those with a CPU time at most ``window_s`` old and the newest one
    before them, and the latest."""
    if not history:
        return []
    if ready_when.kind != ReadyKind.IDLE:
        return [history[-1]]
    latest = history[-1]
    start = latest.at - ready_when.window_s
    measured = [o for o in history[:-1] if o.cpu_s is not None]
    before = [o for o in measured if o.at <= start]
    return [*before[-1:], *(o for o in measured if o.at > start), latest]


def poll_interval(ready_when: ReadyWhen, elapsed_s: float) -> float:
    """Seconds until the next look, ``elapsed_s`` after the job started: a tenth of the time waited so far,
    from :data:`MIN_POLL_S` up to :data:`MAX_POLL_S`, so the template is taken at most ~10 % later than the
    job got ready. An ``idle`` rule looks at least four times per window, so that the window is measured
    close to its length."""
    interval = min(MAX_POLL_S, max(MIN_POLL_S, elapsed_s / 10))
    if ready_when.kind == ReadyKind.IDLE:
        interval = min(interval, max(MIN_POLL_S, ready_when.window_s / 4))
    return interval
