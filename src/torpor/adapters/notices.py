"""HTTP to a cloud's metadata service: one GET, with AWS's IMDSv2 token when the service gives one.

The metadata service is link-local and answers in milliseconds, or not at all: every request has a short
timeout, goes to the URL's host only (no proxy from the environment, no redirect followed) and reads a
bounded answer. What the answer means is :mod:`torpor.policy.notices`'s; polling in a thread and telling
the agent once per notice is :mod:`torpor.core.notices`'s.

Nothing here raises for what a service did: an HTTP status is an :class:`Answer` (AWS's 404 means "no
notice"), no answer at all (connection refused, timeout, a reset) is a one-line reason string, the same
for the same failure on every poll so that the caller can report it once.

IMDSv2: before a read of an AWS endpoint, ``PUT`` on its token URL with
``X-aws-ec2-metadata-token-ttl-seconds`` gives a session token, sent with every read as
``X-aws-ec2-metadata-token`` until a minute before it ends. A service that gives none (IMDSv1, or a
container one hop too far, whose PUT never comes back) is read without one, and asked again after
:data:`TOKEN_RETRY_S` — at once if a read answers 401 (the token expired, or IMDSv2 became required).
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: seconds a request may wait for the service (it is on the machine's own link)
TIMEOUT_S = 2.0
#: the IMDSv2 token's lifetime asked for (AWS's maximum, 6 h)
TOKEN_TTL_S = 21600
#: how long before its end a token is renewed
TOKEN_MARGIN_S = 60.0
#: after no token could be had, how long to read without one before asking again
TOKEN_RETRY_S = 300.0
#: the most of an answer read: a notice is a few hundred bytes
MAX_BODY = 64 * 1024

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"


@dataclass(frozen=True)
class Answer:
    """What the service answered: its HTTP status and (the first :data:`MAX_BODY` bytes of) its body."""

    status: int
    body: bytes


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A metadata service does not redirect; following one would send the poll to some other host."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


@dataclass
class _Token:
    value: str | None = None
    until: float = 0.0  # clock() before which ``value`` is used
    bare_until: float = 0.0  # clock() before which no token is asked for (the last PUT gave none)


class MetadataClient:
    """GETs from a metadata service; keeps one IMDSv2 token per token URL.

    ``clock`` (monotonic seconds, for the token's lifetime) is an argument so that a test can move it.
    Not thread-safe: one poller uses one client.
    """

    def __init__(self, timeout_s: float = TIMEOUT_S, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        # no ProxyHandler from the environment: http_proxy must not carry a link-local request elsewhere
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
        self._tokens: dict[str, _Token] = {}
        #: whether the last :meth:`get` sent an IMDSv2 token
        self.used_token = False

    def get(
        self, url: str, headers: Mapping[str, str] | None = None, token_url: str | None = None
    ) -> Answer | str:
        """GET ``url`` with ``headers``; with an IMDSv2 token from ``token_url`` when one is given and the
        service gives a token. The answer, or why there is none."""
        sent = dict(headers or {})
        token = self._token(token_url) if token_url is not None else None
        answer = self._request("GET", url, sent if token is None else sent | {TOKEN_HEADER: token})
        if token_url is not None and isinstance(answer, Answer) and answer.status == 401:
            self._tokens[token_url] = _Token()  # forget the token, and the pause after a failed PUT
            token = self._token(token_url)
            if token is not None:
                answer = self._request("GET", url, sent | {TOKEN_HEADER: token})
        self.used_token = token is not None
        return answer

    def _token(self, token_url: str) -> str | None:
        state = self._tokens.setdefault(token_url, _Token())
        now = self._clock()
        if state.value is not None and now < state.until:
            return state.value
        if now < state.bare_until:
            return None
        answer = self._request("PUT", token_url, {TOKEN_TTL_HEADER: str(TOKEN_TTL_S)}, data=b"")
        value = answer.body.decode("ascii", "replace").strip() if isinstance(answer, Answer) else ""
        if not isinstance(answer, Answer) or answer.status != 200 or not value:
            self._tokens[token_url] = _Token(bare_until=now + TOKEN_RETRY_S)
            return None
        self._tokens[token_url] = _Token(value, now + max(0.0, TOKEN_TTL_S - TOKEN_MARGIN_S))
        return value

    def _request(
        self, method: str, url: str, headers: Mapping[str, str], data: bytes | None = None
    ) -> Answer | str:
        request = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return Answer(int(response.status), response.read(MAX_BODY))
        except urllib.error.HTTPError as exc:
            # a 4xx/5xx is an answer (AWS's 404 is "no notice"); its body may say why
            with exc:
                return Answer(exc.code, exc.read(MAX_BODY))
        except urllib.error.URLError as exc:
            return f"cannot reach {url}: {_reason(exc.reason, self.timeout_s)}"
        except (OSError, http.client.HTTPException) as exc:
            # a timeout or reset while reading the answer, a malformed status line
            return f"cannot read {url}: {_reason(exc, self.timeout_s)}"


def _reason(reason: object, timeout_s: float) -> str:
    """A one-line reason that reads the same for the same failure on every poll."""
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__
