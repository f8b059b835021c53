"""Running the agent: its sockets, its threads, and what SIGTERM and SIGINT do.

The API listens on ``HOME/agent.sock`` (0600, in the private state directory: root only) and, when asked,
on a TCP address with a bearer token read from a file that must be private to root: with TLS
(``--tls-cert``/``--tls-key``), which any address other than loopback needs (policy.peers). The main
thread serves HTTP (uvicorn), a second one the TLS address (uvicorn gives all the sockets of one server
the same TLS or none); a thread runs the agent's rounds. SIGTERM evacuates the node first (every job
hibernated into the durable tier, resumed at the agent's next start: a reboot loses no work) unless the
agent runs with ``--on-sigterm leave``; SIGINT stops at once, leaving the jobs running (the next agent
adopts them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from torpor.adapters.system import machine, private
from torpor.apps.agent import tokens
from torpor.apps.agent.api import create_app
from torpor.apps.agent.locate import socket_path
from torpor.apps.agent.service import BY_SHUTDOWN, Agent, AgentOptions
from torpor.apps.agent.waking import WakeKeeper
from torpor.core.notices import NoticeWatcher
from torpor.errors import EnvironmentProblem, UnsafePath, UsageError
from torpor.settings import Settings

log = logging.getLogger("torpor.agent")


@dataclass(frozen=True)
class Listen:
    """Where the API is served besides the unix socket."""

    host: str
    port: int
    token_file: Path
    #: the certificate and key of TLS on that address (both or neither; neither: loopback only)
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls_cert else 'http'}://{host}:{self.port}"


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server side of TLS with ``cert`` (PEM, its chain after it) and ``key``, a private file."""
    tokens.read_private(key, "the TLS key file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise UsageError(f"cannot read the TLS certificate {exc.filename or cert}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise UsageError(
            f"cannot serve TLS with the certificate {cert} and the key {key}: {exc} "
            "(give a PEM certificate and the private key that matches it)"
        ) from None
    return context


def unix_listener(path: Path) -> socket.socket:
    """A listening unix socket at ``path``, 0600 from its creation (bound under umask 077)."""
    private.make_private_dirs(path.parent)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise UnsafePath(f"{path} exists and is not a socket: remove it if it is not yours")
        path.unlink()  # a dead agent's: the lock taken before says no live one uses it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def tcp_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EnvironmentProblem(f"the agent cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, without its signal handlers: the agent's decide what a signal does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _serve_or_stop(server: uvicorn.Server, sockets: list[socket.socket], main: uvicorn.Server) -> None:
    """Serve ``sockets`` with ``server``; should it stop by itself, the agent stops too (``main``)."""
    try:
        server.run(sockets=sockets)
    except Exception:  # a bug: said in the log, and the agent stops rather than serve half its API
        log.exception("the TLS server failed")
    finally:
        main.should_exit = True


def serve(settings: Settings, options: AgentOptions, listen: Listen | None = None) -> int:
    """Run the agent until a signal stops it; 0 when it stopped cleanly."""
    token = tokens.read_token(listen.token_file) if listen else None
    tls = None
    if listen and listen.tls_cert and listen.tls_key:
        tls = tls_context(listen.tls_cert, listen.tls_key)
    agent = Agent(settings, options)  # takes the lock: a second agent stops here
    sockets = [unix_listener(socket_path(settings))]
    tls_sockets: list[socket.socket] = []
    if listen:
        (tls_sockets if tls else sockets).append(tcp_listener(listen.host, listen.port))
    app = create_app(agent, token)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    # uvicorn serves every socket of a server with or without TLS: the unix socket is served without
    servers = [server]
    if tls:
        tls_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        tls_config.load()
        tls_config.ssl = tls  # what load() builds from file names: this one's files were checked already
        servers.append(_Server(tls_config))

    def shutdown(why: str, evacuate: bool) -> None:
        if evacuate:
            report = agent.evacuate(why, BY_SHUTDOWN)
            log.info(
                "shutdown: %d saved, %d failed, %d pending",
                len(report.saved),
                len(report.failed),
                len(report.pending),
            )
        agent.stopping.set()
        agent.nudge()
        for each in servers:
            each.should_exit = True

    def on_signal(number: int, _: FrameType | None) -> None:
        if agent.stopping.is_set() or getattr(on_signal, "seen", False):
            for each in servers:
                each.force_exit = each.should_exit = True
            return
        on_signal.seen = True  # type: ignore[attr-defined]
        evacuate = number == signal.SIGTERM and (
            options.on_sigterm == "hibernate"
            or (options.on_sigterm == "auto" and machine.system_stopping() is not False)
        )
        log.info(
            "%s: %s", signal.Signals(number).name, "evacuating, then stopping" if evacuate else "stopping"
        )
        threading.Thread(target=shutdown, args=(signal.Signals(number).name, evacuate), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rounds = threading.Thread(target=agent.loop, name="torpor-agent-rounds", daemon=True)
    keeper = WakeKeeper(agent)
    agent.round_hooks.append(keeper)
    agent.before_restore.append(keeper.let_go)
    watcher = None
    tls_thread = None
    try:
        agent.adopt()
        rounds.start()
        if options.notice_url:
            watcher = NoticeWatcher(
                options.notice_url,
                options.notice_format,
                options.notice_interval_s,
                agent.on_notice,
                on_problem=agent.on_notice_problem,
            ).start()
        where = str(socket_path(settings)) + (f" and {listen.url}" if listen else "")
        log.info("torpor agent %d serving on %s (state in %s)", os.getpid(), where, settings.home)
        if tls:
            tls_thread = threading.Thread(
                target=_serve_or_stop,
                args=(servers[1], tls_sockets, server),
                name="torpor-agent-tls",
                daemon=True,
            )
            tls_thread.start()
        server.run(sockets=sockets)
    finally:
        for each in servers:
            each.should_exit = True
        if tls_thread is not None:
            tls_thread.join(10)
        agent.stopping.set()
        agent.nudge()
        if watcher is not None:
            watcher.stop()
        keeper.close()
        for sock in sockets + tls_sockets:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            socket_path(settings).unlink()
        agent.close()
        log.info("torpor agent stopped")
    return 0
