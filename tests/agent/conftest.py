"""A real ``torpor agent`` for the agent's tests: started as a user would (the CLI, in the foreground),
on the test's own state directory, and stopped (or killed) by the test.
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import TORPOR, Torpor, free_port
from torpor.adapters import cgroups, jobnet
from torpor.apps.agent.locate import answers
from torpor.core.engine import Engine
from torpor.policy.addresses import overlapping
from torpor.settings import Settings


class AgentProcess:
    """``torpor agent`` in a subprocess, its log in a file; ``api`` speaks to its unix socket."""

    def __init__(self, torpor: Torpor, log: Path) -> None:
        self.torpor = torpor
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None
        self.api = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://agent", timeout=120
        )

    @property
    def socket(self) -> Path:
        return self.torpor.home / "agent.sock"

    def start(self, *flags: str, prefix: Sequence[str] = ()) -> AgentProcess:
        """``torpor agent FLAGS…`` (run by ``prefix``, a command that runs the rest, if given)."""
        assert self.process is None or self.process.poll() is not None, "an agent runs already"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*prefix, TORPOR, "agent", "--round", "200ms", *flags],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.torpor.env,
            )
        self.wait_for(self._answers, 30, "the agent to answer on its socket")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the agent exited {self.process.returncode}:\n{self.log()}")
        return answers(self.socket) and self.api.get("/v1/health", timeout=10).status_code == 200

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        """Send ``sig`` and wait for the agent to exit; its exit code."""
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def events(self, job: str | None = None) -> list[dict[str, Any]]:
        # filtered here: 'torpor events --job' refuses a name with no job yet (a submission still queued)
        events = json.loads(self.torpor.run("events", "--json").stdout)
        return [e for e in events if job is None or e["job"] == job]

    def wait_event(
        self, action: str, job: str | None = None, timeout: float = 60, after: int = 0
    ) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.events(job) if e["action"] == action and e["id"] > after]
            return bool(found)

        self.wait_for(seen, timeout, f"a {action} event" + (f" of {job}" if job else ""))
        return found[0]

    def last_event_id(self) -> int:
        events = self.events()
        return int(events[-1]["id"]) if events else 0

    def rounds(self) -> int:
        return int(self.api.get("/v1/health").json()["rounds"])

    def wait_rounds(self, count: int, timeout: float = 60) -> None:
        """Until the agent has done ``count`` more rounds: a window in which something must not happen,
        counted in the agent's own rounds rather than in seconds a loaded machine stretches."""
        until = self.rounds() + count
        self.wait_for(lambda: self.rounds() >= until, timeout, f"{count} rounds of the agent")

    def wait_for(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\nagent log:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # leaves the jobs running, for the torpor fixture's rm
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.api.close()


@pytest.fixture
def other(tmp_path: Path) -> Iterator[Torpor]:
    """A second state directory: a peer's (tests/agent/test_peers.py, test_migrate.py)."""
    yield from state_directory(tmp_path / "peer-home")


@pytest.fixture
def third(tmp_path: Path) -> Iterator[Torpor]:
    """A third state directory: a second peer's."""
    yield from state_directory(tmp_path / "peer2-home")


def state_directory(home: Path) -> Iterator[Torpor]:
    """A state directory of its own at ``home``, with a hot tier of its own, removed after."""
    env = {
        **os.environ,
        "TORPOR_HOME": str(home),
        "TORPOR_HOT_DIR": f"/dev/shm/torpor-test-{uuid.uuid4().hex[:8]}",
    }
    yield Torpor(home, env)
    subprocess.run(["rm", "-rf", env["TORPOR_HOT_DIR"]], check=False)


@dataclass
class LoopbackPeer:
    """A peer's agent on a loopback port of its own, with a token, known to the source as ``name``."""

    agent: AgentProcess
    flags: tuple[str, ...]
    prefix: tuple[str, ...] = ()

    def start(self) -> None:
        """(Again, after a kill.)"""
        self.agent.start(*self.flags, prefix=self.prefix)


def loopback_peer(
    here: Torpor, peer: Torpor, name: str, folder: Path, budget: str = "2G", prefix: Sequence[str] = ()
) -> LoopbackPeer:
    """``peer``'s agent started on a loopback port, handing out ``budget``, added to ``here``'s peers as
    ``name`` (run by ``prefix``: :meth:`AgentProcess.start`). The test closes its ``agent``."""
    token = folder / f"{name}.token"
    token.write_text(uuid.uuid4().hex + "\n")
    token.chmod(0o600)
    port = free_port()
    flags = ("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", budget)
    found = LoopbackPeer(AgentProcess(peer, folder / f"{name}-agent.log"), flags, tuple(prefix))
    found.start()
    here.run("peers", "add", name, f"http://127.0.0.1:{port}", "--token-file", str(token))
    return found


def engine_of(torpor: Torpor, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """An engine in the test's process on ``torpor``'s state directory (its TORPOR_ variables set)."""
    for key, value in torpor.env.items():
        if key.startswith("TORPOR_"):
            monkeypatch.setenv(key, value)
    return Engine(Settings.from_environment())


def steps(log: str) -> list[int]:
    """The counts a counter job printed (tests/jobs/counter.py, memory_hog.py): ``step N`` lines."""
    return [int(n) for n in re.findall(r"^step (\d+)$", log, re.M)]


def counts_on(there: Torpor, name: str, before: list[int]) -> None:
    """Wait until job ``name`` of ``there`` counted a few steps past ``before`` (what it had counted
    before a move, a hibernation), then check its log holds every step once, in order, from 0:
    none lost, none twice."""
    there.wait_for(lambda: len(steps(there.log(name))) > len(before) + 3, 30, f"{name} to count on")
    counted = steps(there.log(name))
    assert counted == list(range(len(counted))) and counted[: len(before)] == before, counted


def ip(*args: str) -> None:
    """``ip ARGS...``, checked."""
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def node() -> Iterator[tuple[str, str, str]]:
    """A second node: a network namespace joined to this one by a veth pair of a /30 no route uses.
    Yields the namespace, this side's link and the node's address; everything is removed after."""
    routed = jobnet.routed_networks(jobnet.Bridge("torpor-unused"))
    while True:
        subnet = ipaddress.IPv4Network(f"10.{random.randint(200, 250)}.{random.randint(0, 255)}.0/30")
        if not overlapping(subnet, routed):
            break
    tag = uuid.uuid4().hex[:6]
    netns, here, there = f"tpeer-{tag}", f"tpa{tag}", f"tpb{tag}"  # not torpor-*: the jobs' own
    mine, its = (str(a) for a in subnet.hosts())
    ip("netns", "add", netns)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", netns)
        ip("addr", "add", f"{mine}/30", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", netns, "addr", "add", f"{its}/30", "dev", there)
        ip("-n", netns, "link", "set", there, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        yield netns, here, its
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)


@pytest.fixture
def agent(torpor: Torpor, tmp_path: Path) -> Iterator[AgentProcess]:
    """An agent on the test's state directory, not started yet: ``agent.start(flags…)``."""
    process = AgentProcess(torpor, tmp_path / "agent.log")
    yield process
    process.close()
    remove_job_cgroups(torpor.home)


def remove_job_cgroups(home: Path) -> None:
    """The memory cgroups the scheduler made for the jobs of ``home`` (empty once they are gone)."""
    found = cgroups.find_memory_controller()
    if found is None:
        return
    scoped = found.scoped(cgroups.scope_of(home))
    for name in scoped.job_names():
        group = scoped.job(name)
        for pid in group.pids():  # a job the test left behind: the torpor fixture's rm comes later
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.remove()
    with contextlib.suppress(FileNotFoundError):
        scoped.jobs.rmdir()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- a cloud provider's metadata service, on loopback -------------------------------------------------

TOKEN = "/latest/api/token"


@dataclass
class Metadata:
    """What the fake service serves, and what it was asked; the handler reads it under ``lock``."""

    routes: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    #: AWS: "optional" (IMDSv2 offered, v1 reads allowed), "required" (no read without a valid token),
    #: "off" (IMDSv1 only: the token PUT is refused)
    imdsv2: str = "optional"
    tokens: set[str] = field(default_factory=set)
    issued: int = 0
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    asked: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.asked = threading.Condition(self.lock)

    def wait_requests(self, count: int, timeout: float = 10.0) -> None:
        with self.asked:
            assert self.asked.wait_for(lambda: len(self.requests) >= count, timeout), "no poll came"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self) -> Metadata:
        meta = self.server.meta
        with meta.asked:
            meta.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            meta.asked.notify_all()
        return meta

    def do_PUT(self) -> None:
        meta = self._record()
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if self.path != TOKEN or meta.imdsv2 == "off":
            self._answer(403, b"Forbidden")
        elif ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            self._answer(400, b"Bad Request")  # as IMDS answers a PUT without a valid TTL
        else:
            with meta.lock:
                meta.issued += 1
                token = f"token-{meta.issued}"
                meta.tokens.add(token)
            self._answer(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

    def do_GET(self) -> None:
        meta = self._record()
        with meta.lock:
            route = meta.routes.get(self.path)
            valid = meta.tokens.copy()
        if self.path.startswith("/computeMetadata/") and self.headers.get("Metadata-Flavor") != "Google":
            # GCP's metadata server refuses a request without the header
            self._answer(403, b"Missing required header: Metadata-Flavor")
            return
        if self.path.startswith("/latest/"):
            token = self.headers.get("X-aws-ec2-metadata-token")
            if (token is not None and token not in valid) or (meta.imdsv2 == "required" and token is None):
                self._answer(401, b"Unauthorized")
                return
        if route is None:
            self._answer(404, b"Not Found")
            return
        status, body = route
        self._answer(
            status, body, {"Location": "http://127.0.0.1:1/elsewhere"} if status in (301, 302) else None
        )


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    meta: Metadata


@pytest.fixture
def service() -> Iterator[tuple[str, Metadata]]:
    """A metadata service on 127.0.0.1 (an ephemeral port) and what it serves."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.meta = Metadata()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.meta
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _serve(meta: Metadata, path: str, status: int, body: bytes) -> None:
    with meta.lock:
        meta.routes[path] = (status, body)
