"""Running the agent: its sockets, its threads, and what SIGTERM and SIGINT do.

The API listens on ``HOME/agent.sock`` (0600, in the private state directory: root only) and, when asked,
on a TCP address with a bearer token read from a file that must be private to root. The main thread
serves HTTP (uvicorn); a thread runs the agent's rounds. SIGTERM evacuates the node first (every job
hibernated into the durable tier, resumed at the agent's next start: a reboot loses no work) unless the
agent runs with ``--on-sigterm leave``; SIGINT stops at once, leaving the jobs running (the next agent
adopts them).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from torpor.adapters.system import machine, private
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


def read_token(path: Path) -> str:
    """The bearer token in ``path``, which must be a regular file of root's that nobody else can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a fifo must not block us
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link, or a shell's <(...), which is a link to a pipe
            raise UsageError(
                f"the token file {path} is a symbolic link: give a regular file of yours (chmod 600), "
                "not a link or a process substitution like <(...)"
            ) from None
        raise UsageError(f"cannot read the token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(
                f"the token file {path} is not a regular file (a pipe, a device or a folder): "
                "write the token to a file of yours (chmod 600) and give its path"
            )
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise UnsafePath(
                f"the token file {path} must be a regular file of yours that only you can read "
                f"(chmod 600 {path})"
            )
        token = handle.read().decode(errors="replace").strip()
    if len(token) < 16:
        raise UsageError(
            f"the token in {path} is too short: use at least 16 characters (e.g. openssl rand -hex 32)"
        )
    return token


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


def serve(settings: Settings, options: AgentOptions, listen: Listen | None = None) -> int:
    """Run the agent until a signal stops it; 0 when it stopped cleanly."""
    token = read_token(listen.token_file) if listen else None
    agent = Agent(settings, options)  # takes the lock: a second agent stops here
    sockets = [unix_listener(socket_path(settings))]
    if listen:
        sockets.append(tcp_listener(listen.host, listen.port))
    config = uvicorn.Config(create_app(agent, token), log_level="warning", access_log=False, lifespan="off")
    server = _Server(config)

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
        server.should_exit = True

    def on_signal(number: int, _: FrameType | None) -> None:
        if agent.stopping.is_set() or getattr(on_signal, "seen", False):
            server.force_exit = server.should_exit = True
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
        where = str(socket_path(settings)) + (f" and http://{listen.host}:{listen.port}" if listen else "")
        log.info("torpor agent %d serving on %s (state in %s)", os.getpid(), where, settings.home)
        server.run(sockets=sockets)
    finally:
        agent.stopping.set()
        agent.nudge()
        if watcher is not None:
            watcher.stop()
        keeper.close()
        for sock in sockets:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            socket_path(settings).unlink()
        agent.close()
        log.info("torpor agent stopped")
    return 0
