"""Signing in to the page over TCP: a form asks for the agent's token once, a session cookie does after.

Over TCP every request of the API must bring ``Authorization: Bearer TOKEN``, which a browser cannot
send by itself. So the page alone (``GET /``) also opens with a session: ``POST /login`` with the right
token (form-encoded, compared in constant time) answers with a cookie that names a session of the
agent's; ``POST /logout`` ends it. Without either, ``GET /`` answers the form (401).

Why the page only: a browser sends a cookie with every request to the agent by itself, so an API that
took one would let another site's page act on the agent (cross-site request forgery). SameSite=Strict
keeps most such requests from carrying it, but not a sibling site on the same domain; the page only
reads, so it is the one thing a cookie opens. The cookie is HttpOnly (no script reads it), SameSite=Strict,
Path=/, expires with its session (:data:`SESSION_LIFETIME_S`) and is Secure when the request came over
HTTPS (the agent serves plain HTTP: a TLS proxy in front of it on the same machine says so with
``X-Forwarded-Proto``, which uvicorn believes from 127.0.0.1).

The sessions are in the agent's memory: an agent started again has none, and the page asks for the token
again. On the unix socket, which only root can open, nothing is asked.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from torpor.apps.agent import web

#: the cookie that names a session
SESSION_COOKIE = "torpor_session"
#: how long a session lasts from its sign-in, in seconds (then the form asks again)
SESSION_LIFETIME_S = 12 * 3600
#: sessions kept at most; the oldest goes first (each sign-in makes one)
MAX_SESSIONS = 1000
#: seconds a wrong token waits for its answer (a guess a second, per connection)
WRONG_TOKEN_DELAY_S = 0.5
#: a sign-in form's body at most, in bytes
MAX_FORM_BYTES = 4096
#: what a session opens (with the form and the button that sign in and out)
PAGE_PATHS = frozenset({"/", "/login", "/logout"})


class Sessions:
    """The sessions of the sign-in form: a random id each, with the time it ends."""

    def __init__(
        self, lifetime_s: float = SESSION_LIFETIME_S, clock: Callable[[], float] = time.time
    ) -> None:
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._ends: dict[str, float] = {}
        self._lock = threading.Lock()

    def open(self) -> str:
        """A new session's id (unguessable: 256 random bits)."""
        now = self._clock()
        session = secrets.token_urlsafe(32)
        with self._lock:
            for old in [s for s, ends in self._ends.items() if ends <= now]:
                del self._ends[old]
            while len(self._ends) >= MAX_SESSIONS:
                del self._ends[min(self._ends, key=self._ends.__getitem__)]
            self._ends[session] = now + self.lifetime_s
        return session

    def valid(self, session: str | None) -> bool:
        if not session:
            return False
        with self._lock:
            ends = self._ends.get(session)
            if ends is not None and ends <= self._clock():
                del self._ends[session]
                ends = None
        return ends is not None

    def close(self, session: str | None) -> None:
        with self._lock:
            self._ends.pop(session or "", None)


def on_tcp(request: Request) -> bool:
    """Whether ``request`` came over TCP (its server is a host and port; the unix socket's has no port)."""
    server = request.scope.get("server")
    return server is not None and server[1] is not None


class PageLogin:
    """The sign-in form, its sessions and what a request over TCP without the bearer token may see."""

    def __init__(self, token: str | None, sessions: Sessions | None = None) -> None:
        self.token = token
        self.sessions = sessions or Sessions()

    def has_bearer(self, request: Request) -> bool:
        sent = request.headers.get("authorization", "")
        return self.token is not None and hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode())

    def signed_in(self, request: Request) -> bool:
        """Whether ``request`` brings a live session of the sign-in form."""
        return on_tcp(request) and self.sessions.valid(request.cookies.get(SESSION_COOKIE))

    def refusal(self, request: Request) -> Response | None:
        """What a request over TCP without the bearer token gets instead of what it asked (None: it goes
        on): the form for the page without a session, 401 for the rest of the API."""
        if request.url.path not in PAGE_PATHS:
            return _no_bearer()
        if request.url.path != "/" or self.signed_in(request):
            return None  # the form's own routes, and the page with a session
        return self.form(status=401)

    def form(self, error: str | None = None, status: int = 200) -> HTMLResponse:
        return HTMLResponse(
            web.render_sign_in(socket.gethostname(), error, self.sessions.lifetime_s),
            status_code=status,
            headers={**web.HEADERS, "WWW-Authenticate": "Bearer"} if status == 401 else web.HEADERS,
        )

    def add_routes(self, app: FastAPI) -> None:
        """``GET``/``POST /login`` and ``POST /logout`` on ``app``."""

        def ask(request: Request) -> Response:
            if not on_tcp(request) or self.signed_in(request):
                return _to_page()
            return self.form()

        async def sign_in(request: Request) -> Response:
            if not on_tcp(request):
                return _to_page()  # the unix socket asks for nothing
            body = await _limited_body(request)
            if body is None:
                return self.form("the form was too large", status=413)
            sent = urllib.parse.parse_qs(body.decode(errors="replace")).get("token", [""])[0].strip()
            if self.token is None or not hmac.compare_digest(sent.encode(), self.token.encode()):
                await asyncio.sleep(WRONG_TOKEN_DELAY_S)
                return self.form("That is not the agent's token.", status=401)
            response = _to_page()
            response.set_cookie(
                SESSION_COOKIE,
                self.sessions.open(),
                max_age=int(self.sessions.lifetime_s),
                path="/",
                secure=request.url.scheme == "https",
                httponly=True,
                samesite="strict",
            )
            return response

        def sign_out(request: Request) -> Response:
            self.sessions.close(request.cookies.get(SESSION_COOKIE))
            response = _to_page()
            response.delete_cookie(
                SESSION_COOKIE,
                path="/",
                secure=request.url.scheme == "https",
                httponly=True,
                samesite="strict",
            )
            return response

        app.add_api_route("/login", ask, methods=["GET"], summary="The page's sign-in form (over TCP)")
        app.add_api_route(
            "/login",
            sign_in,
            methods=["POST"],
            summary="Sign in to the page with the token: a session cookie",
        )
        app.add_api_route("/logout", sign_out, methods=["POST"], summary="End the page's session")

    def middleware(
        self,
    ) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
        """The check of every request: on TCP, the bearer token, or the page's session (or its form)."""

        async def check(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            if on_tcp(request) and not self.has_bearer(request):
                refused = self.refusal(request)
                if refused is not None:
                    return refused
            return await call_next(request)

        return check


async def _limited_body(request: Request) -> bytes | None:
    """The request's body, or None past :data:`MAX_FORM_BYTES`."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    return body


def _to_page() -> RedirectResponse:
    return RedirectResponse("/", status_code=303, headers={"Cache-Control": "no-store"})


def _no_bearer() -> Response:
    return JSONResponse(
        {"error": "missing or wrong bearer token", "details": [], "exit_code": 2},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )
