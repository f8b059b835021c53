"""The sockets processes hold, as /proc shows them: unix sockets and who holds one, the TCP addresses a job
listens on and its established connections, whether it holds TCP sockets at all, who listens on a port.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Callable, Container, Iterator
from pathlib import Path
from typing import NamedTuple, TypeVar


def _socket_inodes(pid: int) -> list[int]:
    """Inodes of the sockets process ``pid`` has open (``/proc/PID/fd`` links ``socket:[N]``)."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.append(int(link[8:-1]))
    return found


def unix_socket_inodes(pids: list[int]) -> list[int]:
    """Inodes of the unix sockets ``pids`` hold (those ``/proc/PID/net/unix`` lists), sorted, once each."""
    held = {inode for pid in pids for inode in _socket_inodes(pid)}
    unix: set[int] = set()
    for pid in pids[:1]:
        try:
            with open(f"/proc/{pid}/net/unix") as table:
                next(table, None)  # the header
                unix = {int(line.split()[6]) for line in table if len(line.split()) > 6}
        except OSError:
            pass
    return sorted(held & unix)


def socket_holders(inode: int) -> list[tuple[int, str]]:
    """The processes that have socket ``inode`` open: (pid, command name), lowest pid first."""
    holders = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and inode in _socket_inodes(int(entry)):
            try:
                name = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            holders.append((int(entry), name))
    return sorted(holders)


class TcpAddress(NamedTuple):
    """A TCP address a socket is bound to; a tuple ``(host, port)``, so it is what ``socket.bind`` takes.

    ``host`` is as the kernel holds it: ``127.0.0.1``, ``0.0.0.0`` (every IPv4 address), ``::1``, ``::``.
    """

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Listener(NamedTuple):
    """A process listening on a TCP address: who holds a port."""

    pid: int
    name: str
    address: TcpAddress


_TCP_LISTEN = "0A"
_TCP_ESTABLISHED = "01"


def _tcp_rows(pid: int, state: str) -> Iterator[list[str]]:
    """The rows of ``pid``'s network namespace's TCP tables (v4 and v6) of sockets in ``state``
    (``0A`` LISTEN, ``01`` ESTABLISHED), each split into its fields."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                next(lines, None)  # the header
                rows = [line.split() for line in lines]
        except OSError:
            continue
        yield from (row for row in rows if len(row) >= 10 and row[3] == state)


def _hex_address(text: str) -> TcpAddress:
    """``0100007F:1F90`` as ``/proc/net/tcp{,6}`` prints an address: the kernel's 32-bit words in host byte
    order, then the port."""
    hex_host, hex_port = text.split(":")
    raw = b"".join(
        int(hex_host[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_host), 8)
    )
    return TcpAddress(str(ipaddress.ip_address(raw)), int(hex_port, 16))


def _tcp_listening(pid: int) -> dict[int, TcpAddress]:
    """The listening TCP sockets (v4 and v6) of ``pid``'s network namespace, by inode."""
    return {int(row[9]): _hex_address(row[1]) for row in _tcp_rows(pid, _TCP_LISTEN)}


def _tcp_established(pid: int) -> dict[int, str]:
    """The established TCP connections (v4 and v6) of ``pid``'s network namespace, by inode, each as
    ``LOCAL -> REMOTE``."""
    return {
        int(row[9]): f"{_hex_address(row[1])} -> {_hex_address(row[2])}"
        for row in _tcp_rows(pid, _TCP_ESTABLISHED)
    }


def established_connections(pids: list[int]) -> list[str]:
    """The established TCP connections ``pids`` hold, ``LOCAL -> REMOTE`` each, sorted, once each: what
    cannot follow a job to another machine's address. A process gone meanwhile is left out."""
    found: set[str] = set()
    for inodes, table in _with_tcp_table(pids, _tcp_established):
        found.update(table[inode] for inode in inodes if inode in table)
    return sorted(found)


def _net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def listening_sockets(pids: list[int]) -> list[TcpAddress]:
    """The TCP addresses (v4 and v6) on which ``pids`` listen, sorted, once each.

    Exactly as bound: a job that listens on 127.0.0.1:8000 is reported so, not as port 8000, so that
    whoever holds the port for it while it is away (adapters/wake.py) never listens wider than it did.
    A process gone meanwhile is left out.
    """
    found: set[TcpAddress] = set()
    for inodes, table in _with_tcp_table(pids, _tcp_listening):
        found.update(table[inode] for inode in inodes if inode in table)
    return sorted(found)


_Table = TypeVar("_Table", bound=Container[int])


def has_tcp_sockets(pids: list[int]) -> bool:
    """Whether any of ``pids`` holds a TCP socket (v4 or v6) that is bound, listening or connected: one
    the kernel lists in ``/proc/PID/net/tcp{,6}`` (a socket just created, never bound, is not there).

    A process gone meanwhile is left out.
    """
    return any(inode in table for inodes, table in _with_tcp_table(pids, _tcp_inodes) for inode in inodes)


def _with_tcp_table(pids: list[int], read: Callable[[int], _Table]) -> Iterator[tuple[list[int], _Table]]:
    """Each of ``pids``' socket inodes with its network namespace's TCP table as ``read(pid)`` gives it
    (read once per namespace); processes without sockets, or gone, are left out."""
    tables: dict[str | None, _Table] = {}
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        namespace = _net_namespace(pid)
        if namespace not in tables:
            tables[namespace] = read(pid)
        yield inodes, tables[namespace]


def _tcp_inodes(pid: int) -> set[int]:
    """The inodes of every TCP socket (any state) of ``pid``'s network namespace."""
    found: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                next(lines, None)  # the header
                found.update(int(row[9]) for row in (line.split() for line in lines) if len(row) >= 10)
        except (OSError, ValueError):
            continue
    found.discard(0)  # sockets in TIME_WAIT and the like, which no process holds
    return found


def is_listening(address: TcpAddress) -> bool:
    """Whether a socket of this network namespace listens on exactly ``address`` now (no connection made:
    a server that is asked whether it is up, by connecting, sees a connection that says nothing)."""
    return address in _tcp_listening(os.getpid()).values()


def port_listeners(port: int) -> list[Listener]:
    """Every process of this network namespace listening on TCP ``port``, on any address, lowest pid first.

    What a refusal names ("port 8000 is in use by process 123 (nginx)"). Processes torpor may not look
    into are missed: an empty list means no one found, not that a bind will succeed.
    """
    on_port = {
        inode: address for inode, address in _tcp_listening(os.getpid()).items() if address.port == port
    }
    if not on_port:
        return []
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        for inode in _socket_inodes(pid):
            if inode in on_port:
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                found.add(Listener(pid, name, on_port[inode]))
    return sorted(found)
