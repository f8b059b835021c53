"""Wake on connect, the socket part (adapters/wake.py, sockets.listening_sockets): real sockets on 127.0.0.1.

- ``listening_sockets`` reports the exact addresses a process listens on (127.0.0.1, 0.0.0.0, ::1; the one
  test that listens on 0.0.0.0, for a moment, so that it can be told from 127.0.0.1), not
  its connections; ``port_listeners`` names who holds a port; a holder refuses a port in use at start.
- A stopped ``python -m http.server`` whose port is held: ``curl`` (the real binary) gets a 200 and the
  right body from the server started again on the first connection; three clients held meanwhile all get
  theirs (one a 1 MiB body), and a client that sent its request (and half-closed) before the server was
  back gets its answer.
- The server binds its port again while held connections are open because both sides set SO_REUSEADDR; a
  server that does not set it cannot (why the holder sets it, and why CRIU's restore, which sets it, can).
- A job that never comes back: the held clients are closed within the relay's timeout, not left hanging.
- ``check_port`` refuses a wake-on port another process listens on, naming it, and not the job's own.
- Bytes both ways, more than a socket buffer each, and a half-close passed on, on 127.0.0.1 and ::1.
- The gap between release and the job listening: a new client is refused, or, with the nftables gate,
  its SYN is dropped and its retransmission reaches the job; the gate is removed after, and a stale one
  (its holder's process gone) by ``remove_stale_gates``.
- Real CRIU: a hibernated http.server job woken by curl through the holder, restored by ``torpor resume``
  (with and without the gate); a job whose listener has no SO_REUSEADDR is restored, and binds its port,
  while a connection is held on it (CRIU sets the option for the bind), and answers what was sent meanwhile.

First-byte latencies are printed (``-s``) beside the server's start (or restore) time, to report; never
asserted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import Torpor, free_port
from torpor.adapters import wake
from torpor.adapters.system import procfs, sockets
from torpor.adapters.system.sockets import TcpAddress
from torpor.adapters.wake import PortHolder, RelayReport
from torpor.errors import UsageError

pytestmark = pytest.mark.timeout(120)

CURL = shutil.which("curl")
NFT_PATH = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
needs_curl = pytest.mark.skipif(CURL is None, reason="no curl here (Debian's curl package)")
BIG = os.urandom(1 << 20)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def site(tmp_path: Path) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "index.html").write_text("hello from the job\n")
    (folder / "big.bin").write_bytes(BIG)
    return folder


class HttpServer:
    """``python -m http.server`` on 127.0.0.1:port serving ``site``; started, stopped and cleaned up here."""

    def __init__(self, site: Path, port: int) -> None:
        self.site, self.port = site, port
        self.process: subprocess.Popen[bytes] | None = None
        #: seconds from its start to its listening (what a restore would take, for the printed numbers)
        self.start_s = 0.0

    def start(self) -> None:
        started = time.monotonic()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "http.server",
                "--bind",
                "127.0.0.1",
                "-d",
                str(self.site),
                str(self.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = started + 30
        while not sockets.is_listening(TcpAddress("127.0.0.1", self.port)):
            assert self.process.poll() is None, "http.server exited"
            assert time.monotonic() < deadline, "http.server never listened"
            time.sleep(0.01)
        self.start_s = time.monotonic() - started

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None


@pytest.fixture
def server(site: Path) -> Iterator[HttpServer]:
    instance = HttpServer(site, free_port())
    yield instance
    instance.stop()


class Curl:
    """``curl`` run in a thread of its own: what it printed (status, time to first byte) and its body."""

    def __init__(self, url: str, body: Path) -> None:
        self.body = body
        assert CURL is not None
        command = [CURL, "-sS", "-m", "30", "-o", str(body), "-w", "%{http_code} %{time_starttransfer}", url]
        self.result: subprocess.CompletedProcess[str] | None = None
        self._thread = threading.Thread(target=self._run, args=(command,), daemon=True)
        self._thread.start()

    def _run(self, command: list[str]) -> None:
        self.result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    def wait(self) -> subprocess.CompletedProcess[str]:
        self._thread.join(timeout=70)
        assert self.result is not None, "curl did not end"
        return self.result

    def answer(self) -> tuple[int, bytes, float]:
        result = self.wait()
        assert result.returncode == 0, (result.returncode, result.stderr)
        status, first_byte = result.stdout.split()
        return int(status), self.body.read_bytes(), float(first_byte)


class Waker:
    """The agent's callback, as the agent does it: wait for the clients expected, release, start the job,
    relay. Records what happened, since a callback's failure is only logged by the holder."""

    def __init__(self, start_job: Callable[[], None], *, held: int = 1, timeout_s: float = 30) -> None:
        self.start_job, self.expected, self.timeout_s = start_job, held, timeout_s
        self.holder: PortHolder | None = None
        self.calls = 0
        self.report: RelayReport | None = None
        self.failure: BaseException | None = None
        self.done = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        try:
            assert self.holder is not None
            deadline = time.monotonic() + 30
            while self.holder.held < self.expected and time.monotonic() < deadline:
                time.sleep(0.01)
            self.holder.release()
            self.start_job()
            self.report = self.holder.relay(self.timeout_s)
        except BaseException as exc:
            self.failure = exc
        finally:
            self.done.set()

    def wait(self) -> RelayReport:
        assert self.done.wait(60), "the callback never ended"
        assert self.failure is None, repr(self.failure)
        assert self.report is not None
        return self.report


def holding(addresses: list[tuple[str, int]], waker: Waker, *, gate: bool = False) -> PortHolder:
    holder = PortHolder(addresses, waker, gate=gate)
    waker.holder = holder
    holder.start()
    return holder


def held_by(holder: PortHolder, count: int) -> None:
    deadline = time.monotonic() + 30
    while holder.held < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holder.held == count


# -- which addresses ------------------------------------------------------------------------------------

LISTENER = """
import socket, sys, time
made = []
for host, port in [("127.0.0.1", 0), ("0.0.0.0", 0)] + ([("::1", 0)] if sys.argv[1] == "6" else []):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.bind((host, port)); s.listen(); made.append(s)
# a connection of its own, to the first: its sockets that do not listen are not reported
client = socket.create_connection(made[0].getsockname()[:2])
peer, _ = made[0].accept()
print(" ".join(f"{s.getsockname()[0]},{s.getsockname()[1]}" for s in made), flush=True)
time.sleep(60)
"""


def test_listening_sockets_are_the_exact_addresses_listened_on() -> None:
    v6 = ipv6_loopback()
    with subprocess.Popen(
        [sys.executable, "-c", LISTENER, "6" if v6 else "4"], stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().split()
            expected = sorted(
                TcpAddress(host, int(port)) for host, port in (item.split(",") for item in line)
            )
            assert [a.host for a in expected] == sorted(["127.0.0.1", "0.0.0.0", *(["::1"] if v6 else [])])
            assert sockets.listening_sockets([process.pid]) == expected
            assert sockets.listening_sockets([os.getpid()]) == []  # this test listens on nothing
            loopback = next(a for a in expected if a.host == "127.0.0.1")
            assert [(pid, address) for pid, _, address in sockets.port_listeners(loopback.port)] == [
                (process.pid, loopback)
            ]
            assert str(loopback) == f"127.0.0.1:{loopback.port}"
            if v6:
                assert str(next(a for a in expected if a.host == "::1")).startswith("[::1]:")
        finally:
            process.kill()


def test_a_port_in_use_is_refused_at_start() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for host in ("127.0.0.1", "0.0.0.0"):
            holder = PortHolder([(host, port), ("127.0.0.1", free_port())], lambda: None)
            with pytest.raises(
                UsageError, match=rf"cannot hold {host}:{port} .*another process listens on it"
            ):
                holder.start()
            holder.close()
        assert [(pid, address) for pid, _, address in sockets.port_listeners(port)] == [
            (os.getpid(), TcpAddress("127.0.0.1", port))
        ]
    with pytest.raises(UsageError, match="not an IP address"):
        PortHolder([("localhost", port)], lambda: None)


# -- holding and relaying -------------------------------------------------------------------------------


@needs_curl
def test_curl_is_answered_by_the_server_started_on_its_connection(server: HttpServer, tmp_path: Path) -> None:
    server.start()
    server.stop()  # "hibernated": nothing listens on its port now
    waker = Waker(server.start)
    with holding([("127.0.0.1", server.port)], waker) as holder:
        url = f"http://127.0.0.1:{server.port}/index.html"
        status, body, first_byte = Curl(url, tmp_path / "body").answer()
        report = waker.wait()
        assert (status, body) == (200, b"hello from the job\n")
        assert (report.relayed, report.dropped, report.not_listening) == (1, 0, ())
        assert waker.calls == 1 and holder.held == 0
    print(
        f"\nwake: curl's first byte after {first_byte:.3f} s; the server took {server.start_s:.3f} s to listen"
    )


@needs_curl
def test_every_client_held_meanwhile_is_answered(server: HttpServer, tmp_path: Path) -> None:
    request = f"GET /index.html HTTP/1.0\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode()
    sent = threading.Event()

    def start_after_the_early_request() -> None:
        assert sent.wait(30)
        server.start()

    waker = Waker(start_after_the_early_request, held=4)
    with holding([("127.0.0.1", server.port)], waker):
        base = f"http://127.0.0.1:{server.port}"
        clients = [Curl(f"{base}/index.html", tmp_path / f"body{n}") for n in range(2)]
        clients.append(Curl(f"{base}/big.bin", tmp_path / "big"))
        # a client that sends its whole request, and ends its side, before the server is back
        early = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        early.sendall(request)
        early.shutdown(socket.SHUT_WR)
        sent.set()
        answer = b""
        while chunk := early.recv(65536):
            answer += chunk
        early.close()
        report = waker.wait()
        answers = [client.answer() for client in clients]
    assert answer.startswith(b"HTTP/1.0 200 ") and answer.endswith(b"\r\n\r\nhello from the job\n")
    assert [(status, body) for status, body, _ in answers] == [
        (200, b"hello from the job\n"),
        (200, b"hello from the job\n"),
        (200, BIG),
    ]
    assert (report.relayed, report.dropped) == (4, 0)
    print(
        "\nwake: first bytes after "
        + ", ".join(f"{first:.3f}" for _, _, first in answers)
        + f" s; the server took {server.start_s:.3f} s to listen"
    )


def test_without_so_reuseaddr_a_server_cannot_bind_while_connections_are_held() -> None:
    port = free_port()
    with PortHolder([("127.0.0.1", port)], lambda: None) as holder:
        holder.start()
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        held_by(holder, 1)
        holder.release()
        for reuse, fails in ((0, True), (1, False)):
            with socket.socket() as job:
                job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                if fails:
                    with pytest.raises(OSError, match="Address already in use"):
                        job.bind(("127.0.0.1", port))
                else:
                    job.bind(("127.0.0.1", port))
                    job.listen()
        client.close()


@needs_curl
def test_held_clients_are_closed_when_the_job_never_comes_back(tmp_path: Path) -> None:
    port = free_port()
    waker = Waker(lambda: None, timeout_s=1.0)
    with holding([("127.0.0.1", port)], waker):
        result = Curl(f"http://127.0.0.1:{port}/", tmp_path / "body").wait()
        report = waker.wait()
    # 52: an empty reply, 56: a reset; a hang would be curl's own timeout (28)
    assert result.returncode in (52, 56), (result.returncode, result.stderr)
    assert (report.relayed, report.dropped) == (0, 1)
    assert report.not_listening == (TcpAddress("127.0.0.1", port),)


def test_close_stops_holding() -> None:
    port = free_port()
    calls: list[int] = []
    holder = PortHolder([("127.0.0.1", port)], lambda: calls.append(1))
    holder.start()
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.settimeout(30)
    held_by(holder, 1)
    holder.close()
    assert client.recv(10) == b""  # the held connection is closed, not left hanging
    client.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=30)
    holder.close()  # twice: nothing more


# -- the gap between release and the job listening ------------------------------------------------------


@needs_curl
@pytest.mark.root("nftables")
@pytest.mark.skipif(shutil.which("nft", path=NFT_PATH) is None, reason="no nft (Debian nftables) here")
@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "gate"])
def test_a_client_in_the_gap_is_refused_or_waits_at_the_gate(
    server: HttpServer, tmp_path: Path, gate: bool
) -> None:
    late: list[Curl] = []
    tables: list[list[str]] = []

    def start_with_a_client_in_the_gap() -> None:
        tables.append(wake.gate_tables())
        late.append(Curl(f"http://127.0.0.1:{server.port}/index.html", tmp_path / "late"))
        if not gate:
            late[0].wait()  # refused at once: nothing listens
        time.sleep(0.3)  # its SYN was sent, and dropped, before the server started (ordering only)
        server.start()

    waker = Waker(start_with_a_client_in_the_gap)
    with holding([("127.0.0.1", server.port)], waker, gate=gate):
        first = Curl(f"http://127.0.0.1:{server.port}/index.html", tmp_path / "first")
        assert first.answer()[:2] == (200, b"hello from the job\n")
        assert waker.wait().relayed == 1
        result = late[0].wait()
    mine = [name for name in tables[0] if name.startswith(f"torpor-wake-{os.getpid()}-")]
    if gate:
        assert len(mine) == 1
        assert result.returncode == 0 and result.stdout.split()[0] == "200", result
        assert mine[0] not in wake.gate_tables()
        print(f"\nwake: a client in the gap got its first byte after {result.stdout.split()[1]} s")
    else:
        assert mine == []
        assert result.returncode == 7, result  # connection refused


@pytest.mark.root("nftables")
@pytest.mark.skipif(shutil.which("nft", path=NFT_PATH) is None, reason="no nft (Debian nftables) here")
def test_a_stale_gate_is_removed() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=30)
    nft = shutil.which("nft", path=NFT_PATH)
    assert nft is not None
    stale, live = f"torpor-wake-{gone.pid}-1", f"torpor-wake-{os.getpid()}-999999"
    try:
        for table in (stale, live):
            subprocess.run([nft, "add", "table", "inet", table], check=True, timeout=30)
        removed = wake.remove_stale_gates()
        # an agent another test starts meanwhile removes stale gates too (the same function, machine-wide:
        # the clean-clone CI saw it take this one first), so what counts is what is left
        assert live not in removed
        assert live in wake.gate_tables() and stale not in wake.gate_tables()
    finally:
        for table in (stale, live):
            subprocess.run(
                [nft, "delete", "table", "inet", table], capture_output=True, timeout=30, check=False
            )


# -- a real hibernated job ------------------------------------------------------------------------------


@needs_curl
@pytest.mark.criu
@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "gate"])
def test_a_hibernated_http_server_is_woken_by_curl(
    torpor: Torpor, site: Path, tmp_path: Path, gate: bool
) -> None:
    if gate and shutil.which("nft", path=NFT_PATH) is None:
        pytest.skip("no nft (Debian nftables) here")
    port = free_port()
    command = [sys.executable, "-m", "http.server", "-b", "127.0.0.1", "-d", str(site), str(port)]
    torpor.run("run", "--name", "web", "--", *command)
    torpor.wait_log("web", "Serving HTTP")
    members = procfs.namespace_members(int(torpor.job("web")["pid"]))
    addresses = sockets.listening_sockets(members)
    assert addresses == [TcpAddress("127.0.0.1", port)]
    torpor.run("hibernate", "web")
    assert not sockets.is_listening(addresses[0])

    restore: list[float] = []

    def resume() -> None:
        started = time.monotonic()
        restore.append(torpor.json("resume", "web")["restore_s"])
        restore.append(time.monotonic() - started)

    waker = Waker(resume)
    with holding(addresses, waker, gate=gate):
        status, body, first_byte = Curl(f"http://127.0.0.1:{port}/index.html", tmp_path / "body").answer()
        report = waker.wait()
    assert (status, body) == (200, b"hello from the job\n")
    assert report.relayed == 1
    assert torpor.log("web").count('"GET /index.html HTTP/1.1" 200') == 1
    print(
        f"\nwake ({'gate' if gate else 'no gate'}): curl's first byte after {first_byte:.3f} s; the restore "
        f"took {restore[0]:.3f} s of the {restore[1]:.3f} s that `torpor resume` ran"
    )


def test_a_wake_on_port_held_by_another_process_is_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        name = Path("/proc/self/comm").read_text().strip()
        refusal = rf"port {port} is in use by process {os.getpid()} \({name}, on 127.0.0.1:{port}\)"
        for host in (None, "127.0.0.1", "0.0.0.0"):
            with pytest.raises(UsageError, match=refusal):
                wake.check_port(port, [os.getpid() + 1], host)
        wake.check_port(port, [os.getpid()])  # the job's own listener
        wake.check_port(port, [], "127.0.0.2")  # another address of that port
        wake.check_port(free_port(), [])


# -- every kind of address, bytes both ways ---------------------------------------------------------------


class EchoJob:
    """A job that listens as a real server does (SO_REUSEADDR) and answers each connection with what it
    read, upper-cased, once its client ends its side; in a thread of this test."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.listener: socket.socket | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET
        self.listener = socket.create_server(
            self.address, family=family, reuse_port=False, dualstack_ipv6=False
        )
        self.thread = threading.Thread(target=self._serve, args=(self.listener,), daemon=True)
        self.thread.start()

    @staticmethod
    def _serve(listener: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed by stop()
            while True:
                connection, _ = listener.accept()
                with connection:
                    data = b""
                    while chunk := connection.recv(65536):
                        data += chunk
                    connection.sendall(data.upper())

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
        if self.thread is not None:
            self.thread.join(timeout=30)


# loopback only: a holder on 0.0.0.0 would listen on every interface of this machine for the test
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_bytes_are_relayed_both_ways_on_every_kind_of_address(host: str) -> None:
    if ":" in host and not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    job = EchoJob((host, port))
    waker = Waker(job.start)
    payload = os.urandom(300_000).hex().encode()  # more than one socket buffer each way
    try:
        with holding([(host, port)], waker):
            client = socket.create_connection(("::1" if ":" in host else "127.0.0.1", port), timeout=30)
            with client:
                client.sendall(payload)
                client.shutdown(socket.SHUT_WR)  # passed on: the job answers once it reads the end
                answer = b""
                while chunk := client.recv(65536):
                    answer += chunk
            assert waker.wait().relayed == 1
        assert answer == payload.upper()
    finally:
        job.stop()


NO_REUSE_JOB = """
import socket, sys
listener = socket.socket()  # no SO_REUSEADDR: a fresh bind would fail while the agent holds connections
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
print("listening", flush=True)
while True:
    connection, _ = listener.accept()
    data = b""
    while not data.endswith(b"\\n") and (chunk := connection.recv(100)):
        data += chunk
    connection.sendall(b"echo " + data)
    connection.close()
"""


@pytest.mark.criu
def test_a_restored_job_binds_its_port_while_connections_are_held_without_so_reuseaddr(
    torpor: Torpor,
) -> None:
    port = free_port()
    torpor.run("run", "--name", "plain", "--", sys.executable, "-u", "-c", NO_REUSE_JOB, str(port))
    torpor.wait_log("plain", "listening")
    members = procfs.namespace_members(int(torpor.job("plain")["pid"]))
    addresses = sockets.listening_sockets(members)
    assert addresses == [TcpAddress("127.0.0.1", port)]
    torpor.run("hibernate", "plain")

    def resume() -> None:
        torpor.run("resume", "plain")

    waker = Waker(resume)
    with holding(addresses, waker):
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        with client:
            client.sendall(b"ping\n")  # before the job is back: it waits in the held connection
            answer = b""
            while chunk := client.recv(100):
                answer += chunk
        report = waker.wait()
    # CRIU sets SO_REUSEADDR on the socket it restores before binding it (and puts the job's 0 back after)
    assert answer == b"echo ping\n"
    assert report.relayed == 1
