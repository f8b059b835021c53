"""Holding a hibernated job's TCP ports, and handing the connections taken meanwhile to the job once back.

While a job is hibernated nothing listens on its ports, and a client would be refused. The agent holds them
instead, as Knative's activator does for a service scaled to zero: a :class:`PortHolder` listens on the
job's exact addresses (never wider: 127.0.0.1:8000 stays 127.0.0.1:8000), tells the agent of the first
connection (which resumes the job), keeps accepting and holding connections meanwhile (what their clients
send waits in them), and once the job listens again relays each held connection to it, both ways, until
either side ends. A client sees a slower first answer, not an error. ::

    holder = PortHolder(addresses, on_first_connection=wake)   # wake runs in a thread of its own:
    holder.start()                                             #   holder.release()
    ...                                                        #   criu restore …
    holder.close()                                             #   holder.relay(timeout_s=30)

**Binding the port again.** The connections the holder accepted keep the job's local port, so the job's
listener can bind it only if both sides allow it (Linux: ``SO_REUSEADDR`` on the new socket and on every
socket already there, none of them listening). The holder sets it on its listeners, whose accepted
connections inherit it; CRIU sets it on every inet socket it restores, before binding it, and puts the
job's own value back after (``criu/sk-inet.c``, ``open_inet_sk``), so a restored job binds whatever its own
setting. A job started afresh instead must set it itself, as most servers do (Python's socketserver,
uvicorn, nginx); one that does not gets EADDRINUSE until the held connections are closed.

**The gap.** Between :meth:`PortHolder.release` (the holder stops listening, so that the job can) and the
job listening again, a new connection would be refused (RST). With ``gate=True`` the holder drops the new
connections' SYNs instead during that gap, with an nftables table of its own (``inet torpor-wake-PID-N``,
Debian's ``nft``), so the client's own SYN retransmission (after 1 s, then 2 s more…) reaches the job: a
slower first answer again, not an error. The holder's own connections to the job carry a firewall mark
that the gate lets through, so the held clients are relayed first and the table removed after, off their
path (an ``nft`` run costs 10-150 ms here, more the more tables the machine has). The table is removed as soon as the job listens, when the relay gives up, and at :meth:`close`;
one left by an agent killed meanwhile is removed by :func:`remove_stale_gates` (its PID is gone). Without
``nft``, or if it fails, the gap stays (logged), and nothing else changes.

The job sees a relayed connection come from the address its client reached (the agent connects from it),
not from the client's own address: a remote client of a job listening on 0.0.0.0 never looks local, but
the job's logs and address-based rules see the machine's address for the connections held while it slept.

What it leaves to others: when to hold a port and resuming the job (the agent, through the callback), and
finding the addresses a job listened on (:func:`torpor.adapters.system.sockets.listening_sockets`); whether a
wake-on port is free when the policy is set is :func:`check_port`'s.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import os
import re
import selectors
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torpor.adapters.system.sockets import Listener, TcpAddress, is_listening, port_listeners
from torpor.errors import UsageError

log = logging.getLogger(__name__)

#: the firewall mark of the holder's own connections to the job, which its gate lets through ("twak")
RELAY_MARK = 0x7477616B
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
_GATE_TABLE = re.compile(r"^table inet (torpor-wake-(\d+)-\d+)$", re.MULTILINE)
_gate_numbers = itertools.count(1)
_CHUNK = 65536
_POLL_S = 0.02


@dataclass(frozen=True)
class RelayReport:
    """What :meth:`PortHolder.relay` did with the connections held for the job."""

    #: held connections now relayed to the job
    relayed: int
    #: held connections closed instead: the job did not listen (or accept) on their address in time
    dropped: int
    #: seconds from the call to the job listening on every held address (or to the timeout)
    waited_s: float
    #: the addresses on which the job did not listen within the timeout
    not_listening: tuple[TcpAddress, ...]


class PortHolder:
    """Listens on a hibernated job's addresses, holds the connections that come, relays them to the job.

    ``on_first_connection`` runs once, in a thread of its own, while the holder goes on accepting; it is
    expected to call :meth:`release`, restore the job, then :meth:`relay`. If it raises, that is logged
    and the held clients wait: the caller should then :meth:`close` (they see a closed connection).
    Each relayed connection costs two threads until it ends; past ``max_held`` connections waiting at
    once, a new one is closed at once.

    Thread-safe: the agent's threads may call any method at any time; :meth:`start`, :meth:`release` and
    :meth:`close` are done once (a second call does nothing), :meth:`close` at any point stops everything.
    """

    def __init__(
        self,
        addresses: Iterable[tuple[str, int]],
        on_first_connection: Callable[[], None],
        *,
        gate: bool = False,
        max_held: int = 1024,
    ) -> None:
        self.addresses: tuple[TcpAddress, ...] = tuple(dict.fromkeys(_address(a) for a in addresses))
        if not self.addresses:
            raise UsageError("no address to hold: a wake-on policy needs at least one TCP port")
        self._on_first_connection = on_first_connection
        self._gate_wanted = gate
        #: past it, a new connection is closed at once: the agent keeps its file descriptors
        self._max_held = max_held
        self._lock = threading.Lock()
        self._listeners: list[socket.socket] = []
        self._held: list[socket.socket] = []
        self._relayed: set[socket.socket] = set()
        self._woken = False
        self._released = False
        self._closed = False
        self._gate: _Gate | None = None
        self._wakeup_r, self._wakeup_w = socket.socketpair()
        self._acceptor: threading.Thread | None = None

    # -- holding ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on every address; raises UsageError (naming the address) if one cannot be bound."""
        with self._lock:
            if self._listeners or self._released:
                return
        listeners = []
        try:
            for address in self.addresses:
                listeners.append(_listen(address))
        except BaseException:
            for listener in listeners:
                listener.close()
            raise
        with self._lock:
            if self._listeners or self._released:
                for listener in listeners:
                    listener.close()
                return
            self._listeners = listeners
            self._acceptor = threading.Thread(target=self._accept, name="torpor-wake-accept", daemon=True)
            self._acceptor.start()

    @property
    def held(self) -> int:
        """How many connections wait for the job now."""
        with self._lock:
            return len(self._held)

    def _accept(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._wakeup_r, selectors.EVENT_READ)
            for listener in self._listeners:
                selector.register(listener, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is self._wakeup_r:
                        return
                    assert isinstance(key.fileobj, socket.socket)
                    self._take(key.fileobj)

    def _take(self, listener: socket.socket) -> bool:
        """Accept one connection from ``listener`` and hold it; False if none was waiting."""
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:  # e.g. EMFILE, or the client gave up in the backlog
            log.warning("wake: accepting on %s failed: %s", _local(listener), exc)
            return False
        connection.setblocking(True)
        first = False
        with self._lock:
            if self._closed or len(self._held) >= self._max_held:
                connection.close()
                return True
            self._held.append(connection)
            first, self._woken = not self._woken, True
        if first:
            threading.Thread(target=self._wake, name="torpor-wake-callback", daemon=True).start()
        return True

    @property
    def relaying(self) -> int:
        """How many relayed connections are still open (each pair counted once)."""
        with self._lock:
            return len(self._relayed) // 2

    def _wake(self) -> None:
        try:
            self._on_first_connection()
        except Exception:  # the agent's callback: its failure is logged, not lost with this thread
            log.exception("wake: the first connection's callback failed")

    def release(self) -> None:
        """Stop listening, so that the job can; the held connections stay open for :meth:`relay`.

        Connections that completed their handshake but were not yet accepted are taken first (closing the
        listener would reset them). With ``gate``, new SYNs are dropped from now until the job listens.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
            listeners, self._listeners = self._listeners, []
        self._stop_acceptor()
        gate = _Gate.install(self.addresses) if self._gate_wanted else None
        with self._lock:
            if not self._closed:
                self._gate, gate = gate, None
        if gate is not None:  # closed meanwhile: close() found no gate to lift
            gate.remove()
        for listener in listeners:
            while self._take(listener):
                pass
            listener.close()

    def _stop_acceptor(self) -> None:
        with contextlib.suppress(OSError):
            self._wakeup_w.send(b"x")
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=5)

    # -- relaying --------------------------------------------------------------------------------------

    def relay(self, timeout_s: float) -> RelayReport:
        """Hand every held connection to the job once it listens again (at most ``timeout_s`` from now).

        Each one is connected to the address its client reached, and bytes are pumped both ways (what the
        client sent meanwhile first) until both sides end; an end of one side is passed on as a half-close.
        Those whose address the job does not listen on in time are closed: their clients see a closed
        connection, not a hang. It waits for every held address, the clients' and the job's own (the gate
        stays until then), so a job whose restore failed is better told with ``relay(0)``, or
        :meth:`close`. Releases first if :meth:`release` was not called.
        """
        self.release()
        started = time.monotonic()
        deadline = started + timeout_s
        with self._lock:
            held, self._held = self._held, []
        waiting = {_local(connection) for connection in held} | set(self.addresses)
        ready: set[TcpAddress] = set()
        while waiting - ready and time.monotonic() < deadline and not self._closed:
            ready |= {address for address in waiting - ready if _listening_for(address)}
            if waiting - ready:
                time.sleep(_POLL_S)
        waited = time.monotonic() - started
        relayed = dropped = 0
        for connection in held:
            target = _local(connection)
            upstream = _connect(target, deadline) if target in ready and not self._closed else None
            if upstream is not None and self._pump(connection, upstream):
                relayed += 1
            else:
                connection.close()
                dropped += 1
        self._lift_gate()  # after: the held clients' connections to the job pass it, marked
        missing = tuple(sorted(waiting - ready))
        if dropped:
            log.warning(
                "wake: closed %d held connection(s): the job did not listen on %s within %.1f s",
                dropped,
                ", ".join(map(str, missing)) or "its address",
                timeout_s,
            )
        return RelayReport(relayed=relayed, dropped=dropped, waited_s=waited, not_listening=missing)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> bool:
        """Relay ``client`` to ``upstream`` until both end; False if closed meanwhile (nothing started).

        Two threads, one each way: neither waits on a side the other should be reading.
        """
        with self._lock:
            if self._closed:
                upstream.close()
                return False
            self._relayed.update((client, upstream))
        ends = [2]

        def one_way(source: socket.socket, sink: socket.socket) -> None:
            try:
                while data := source.recv(_CHUNK):
                    sink.sendall(data)
                sink.shutdown(socket.SHUT_WR)  # the source ended: the sink reads an end, may still answer
            except OSError:  # reset, or closed by close(): end both ways
                for side in (source, sink):
                    with contextlib.suppress(OSError):
                        side.shutdown(socket.SHUT_RDWR)
            with self._lock:
                ends[0] -= 1
                last = ends[0] == 0
                if last:
                    self._relayed.difference_update((client, upstream))
            if last:
                client.close()
                upstream.close()

        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(
                target=one_way, args=(source, sink), name="torpor-wake-relay", daemon=True
            ).start()
        return True

    # -- stopping --------------------------------------------------------------------------------------

    def _lift_gate(self) -> None:
        with self._lock:
            gate, self._gate = self._gate, None
        if gate is not None and not gate.remove():
            log.error(
                "wake: could not remove nftables table inet %s: SYNs to the job's port are still dropped "
                "(nft delete table inet %s)",
                gate.table,
                gate.table,
            )

    def close(self) -> None:
        """Stop everything: listeners, held and relayed connections, the gate (the agent stops)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._released = True
            sockets = [*self._listeners, *self._held]
            self._listeners, self._held = [], []
            relayed = list(self._relayed)
        self._stop_acceptor()
        for connection in sockets:
            connection.close()
        for connection in relayed:  # their pump threads end and close them
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._lift_gate()
        self._wakeup_r.close()
        self._wakeup_w.close()

    def __enter__(self) -> PortHolder:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def check_port(port: int, job_pids: Iterable[int], host: str | None = None) -> None:
    """Refuse a wake-on ``port`` that another process than the job listens on (UsageError, naming it).

    For when the policy is set, not when the job is hibernated: the job itself may listen on it (then its
    pids are ``job_pids``). With ``host`` (the job's address, if known), a listener on another specific
    address of that port does not conflict (it would not stop the holder from binding ``host``).
    """
    own = set(job_pids)
    for listener in port_listeners(port):
        if listener.pid not in own and (host is None or _overlap(listener, host)):
            raise UsageError(
                f"port {port} is in use by process {listener.pid} ({listener.name}, on {listener.address}): "
                "a job cannot be woken on it"
            )


def _overlap(listener: Listener, host: str) -> bool:
    """Whether binding ``host`` on the listener's port would collide with it."""
    theirs, ours = ipaddress.ip_address(listener.address.host), ipaddress.ip_address(host)
    if theirs == ours or (theirs.is_unspecified and ours.is_unspecified):
        return True
    wildcard, specific = (theirs, ours) if theirs.is_unspecified else (ours, theirs)
    # :: (dual-stack) takes every address; 0.0.0.0 every IPv4 one
    return wildcard.is_unspecified and (wildcard.version == 6 or specific.version == 4)


def _address(given: tuple[str, int]) -> TcpAddress:
    host, port = given
    try:
        return TcpAddress(str(ipaddress.ip_address(host)), int(port))
    except ValueError as exc:
        raise UsageError(f"cannot hold {host}:{port}: not an IP address and port ({exc})") from exc


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _listen(address: TcpAddress) -> socket.socket:
    listener = socket.socket(_family(address.host), socket.SOCK_STREAM)
    try:
        # inherited by each accepted connection: what lets the job bind the port while they are held
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address.host == "::":
            # as the job had it when it listened on ::, the default: IPv4 too
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        # a client gone between select() and accept() must not block the holder's thread in accept()
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        raise UsageError(
            f"cannot hold {address} for the hibernated job: {exc.strerror or exc}"
            + (" (another process listens on it)" if exc.errno == 98 else "")
        ) from exc
    return listener


def _local(connection: socket.socket) -> TcpAddress:
    """The address a client connected to (for a listener on 0.0.0.0: the one it reached)."""
    host, port = connection.getsockname()[:2]
    return TcpAddress(host, port)


def _listening_for(address: TcpAddress) -> bool:
    """Whether the job listens where a client reached ``address`` (itself, or the wildcard over it)."""
    host = ipaddress.ip_address(address.host)
    mapped = host.ipv4_mapped if isinstance(host, ipaddress.IPv6Address) else None
    candidates = [address, TcpAddress("::", address.port)]
    if host.version == 4 or mapped is not None:
        candidates += [TcpAddress(str(mapped or host), address.port), TcpAddress("0.0.0.0", address.port)]
    return any(is_listening(candidate) for candidate in candidates)


def _connect(target: TcpAddress, deadline: float) -> socket.socket | None:
    """A connection to the job at ``target``, tried until ``deadline``; None if it never accepted."""
    while True:
        upstream = socket.socket(_family(target.host), socket.SOCK_STREAM)
        try:
            with contextlib.suppress(OSError):  # not root: no mark, but no gate to pass either
                upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, RELAY_MARK)
            # from the address the client reached, not 127.0.0.1: a remote client relayed by the agent must
            # not look like a local one to the job (the job sees this address, not the client's)
            upstream.bind((target.host, 0))
            upstream.settimeout(max(0.05, deadline - time.monotonic()))
            upstream.connect(target)
            upstream.settimeout(None)
            return upstream
        except OSError:
            upstream.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)


# -- the gate: SYNs dropped while nothing listens ----------------------------------------------------------


def _nft() -> str | None:
    return shutil.which("nft") or shutil.which("nft", path=_SBIN)


def _run_nft(nft: str, *args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([nft, *args], input=script, capture_output=True, text=True, timeout=30, check=False)


class _Gate:
    """An nftables table that drops new connections' SYNs to the held addresses (not the holder's own)."""

    def __init__(self, nft: str, table: str) -> None:
        self._nft = nft
        self.table = table

    @classmethod
    def install(cls, addresses: tuple[TcpAddress, ...]) -> _Gate | None:
        nft = _nft()
        if nft is None:
            log.warning("wake: no nft here: connections in the gap before the job listens are refused")
            return None
        table = f"torpor-wake-{os.getpid()}-{next(_gate_numbers)}"
        rules = "\n".join(
            f"    meta mark != {RELAY_MARK:#x} {_match(address)} tcp flags & (syn | ack) == syn drop"
            for address in addresses
        )
        script = (
            f"table inet {table} {{\n  chain input {{\n    type filter hook input priority -10; policy accept;\n"
            f"{rules}\n  }}\n}}\n"
        )
        result = _run_nft(nft, "-f", "-", script=script)
        if result.returncode != 0:
            log.warning("wake: nft refused the gate (%s): the gap stays", result.stderr.strip())
            return None
        return cls(nft, table)

    def remove(self) -> bool:
        return _run_nft(self._nft, "delete", "table", "inet", self.table).returncode == 0


def _match(address: TcpAddress) -> str:
    host = ipaddress.ip_address(address.host)
    if host.is_unspecified:  # :: takes IPv4 too (the holder listens dual-stack there)
        where = "meta nfproto ipv4" if host.version == 4 else ""
    else:
        where = f"{'ip' if host.version == 4 else 'ip6'} daddr {host}"
    return f"{where} tcp dport {address.port}".strip()


def gate_tables() -> list[str]:
    """The nftables tables of holders' gates still there (any process's)."""
    nft = _nft()
    if nft is None:
        return []
    listed = _run_nft(nft, "list", "tables")
    return [] if listed.returncode != 0 else [name for name, _ in _GATE_TABLE.findall(listed.stdout)]


def remove_stale_gates() -> list[str]:
    """Remove the gates of holders whose process is gone (an agent killed mid-wake); returns their names.

    For the agent to call when it starts: such a table would drop the SYNs to a job's port for good.
    """
    nft = _nft()
    if nft is None:
        return []
    removed = []
    for name, pid in _GATE_TABLE.findall(_run_nft(nft, "list", "tables").stdout):
        if (
            not os.path.exists(f"/proc/{pid}")
            and _run_nft(nft, "delete", "table", "inet", name).returncode == 0
        ):
            removed.append(name)
    return removed
