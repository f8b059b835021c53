"""Job networks: a network namespace of a job's own, joined to a bridge on the machine, made with ``ip``.

A job started with ``--own-network`` (a clone of a saved server, say) lives in a named network namespace
(``ip netns``, ``/run/netns/<name>``) so that two clones listening on one port do not collide. Each
namespace has ``lo`` and ``eth0``, the inside end of a veth pair whose other end is a port of a bridge
torpor manages (``torpor0``): ``eth0`` has the job's address, the bridge the subnet's first one, and the
job's default route goes through it. The machine reaches every job at its address; nothing is forwarded
beyond the machine (no NAT, and the bridge's own ``forwarding`` is switched off, so that even a machine
that forwards for others does not pass on the jobs' packets).

This module is the only code that runs ``ip``; a failure becomes :class:`~torpor.errors.EnvironmentProblem`
with the line ``ip`` printed, the :class:`subprocess.CalledProcessError` kept as its cause. Which address a
job gets is a decision (torpor.policy.addresses, which the caller asks: adapters do not); this module only
refuses a bridge whose subnet overlaps a network routed elsewhere, the one rule that keeps the machine's
own traffic safe whoever calls it. Starting the job or CRIU in the namespace is the caller's:
``netns_inode`` and ``open_netns`` give what CRIU needs to treat the namespace as external to an image
(``criu dump --external net[INODE]:KEY``, ``criu restore --inherit-fd fd[N]:KEY``), ``JobNetwork.path``
what ``criu restore --join-ns net:PATH`` needs for an image saved in the machine's own network.

Two callers picking an address at the same moment could pick the same one: the caller serialises the
pick and :func:`create`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from ipaddress import AddressValueError, IPv4Address, IPv4Interface, IPv4Network, NetmaskValueError
from pathlib import Path
from typing import Any

from torpor.errors import EnvironmentProblem, UsageError

DEFAULT_BRIDGE = "torpor0"
DEFAULT_SUBNET = IPv4Network("10.213.0.0/24")
DEFAULT_PREFIX = "torpor-"
#: where ``ip netns`` keeps a named namespace: a bind mount of its nsfs file
NETNS_DIR = Path("/run/netns")
#: the name of the job's end of the veth pair, inside its namespace
INSIDE_LINK = "eth0"

_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"
_TIMEOUT_S = 30.0
#: the kernel's IFNAMSIZ less the terminating zero
_LINK_NAME_MAX = 15
#: room for the bridge's address and one job's
_SMALLEST_PREFIX = 30
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _valid_name(name: str, longest: int) -> bool:
    return 0 < len(name) <= longest and set(name) <= _NAME_CHARS and name not in (".", "..")


@dataclass(frozen=True)
class Bridge:
    """The bridge that job networks hang on, its subnet, and how their namespaces are named.

    ``subnet`` may be given as text (``"10.213.0.0/24"``); a bad name or subnet (one smaller than /30 has
    no room for a job) is a UsageError.
    """

    #: the bridge's link name (15 characters at most)
    name: str = DEFAULT_BRIDGE
    #: the bridge has its first host address, the jobs the next ones
    subnet: IPv4Network = DEFAULT_SUBNET
    #: the namespaces of this bridge's jobs are named ``<prefix><job name>``: listing them finds only these
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _valid_name(self.name, _LINK_NAME_MAX):
            raise UsageError(
                f"bad bridge name {self.name!r}: use up to {_LINK_NAME_MAX} letters, digits, '.', '_' or '-'"
            )
        if not _valid_name(self.prefix, 64):
            raise UsageError(
                f"bad prefix {self.prefix!r} for job network names: use letters, digits, '.', '_', '-'"
            )
        if not isinstance(self.subnet, IPv4Network):
            try:
                subnet = IPv4Network(str(self.subnet))
            except (AddressValueError, NetmaskValueError, ValueError) as exc:
                raise UsageError(f"bad subnet {self.subnet!r} for job networks: {exc}") from None
            object.__setattr__(self, "subnet", subnet)
        if self.subnet.prefixlen > _SMALLEST_PREFIX:
            raise UsageError(
                f"subnet {self.subnet} is too small for job networks: it needs room for the bridge and a job "
                f"(/{_SMALLEST_PREFIX} or larger)"
            )

    @property
    def address(self) -> IPv4Interface:
        """The bridge's own address, with the subnet's prefix (``10.213.0.1/24``)."""
        return IPv4Interface((self.subnet.network_address + 1, self.subnet.prefixlen))

    def holds_job_address(self, address: IPv4Address) -> bool:
        """Whether a job may have ``address``: a host address of the subnet other than the bridge's."""
        return self.subnet.network_address + 1 < address < self.subnet.broadcast_address


@dataclass(frozen=True)
class JobNetwork:
    """A job network that exists on the machine (or was just made)."""

    #: the namespace's name, under /run/netns
    netns: str
    #: the host end of its veth pair, a port of the bridge
    host_link: str
    #: the address of ``eth0`` inside; None if it has none (a network half made, or made by someone else)
    address: IPv4Address | None

    @property
    def path(self) -> Path:
        """``/run/netns/<netns>``: what ``criu restore --join-ns net:PATH`` and ``nsenter --net=PATH`` take."""
        return netns_path(self.netns)


def netns_name(bridge: Bridge, job: str) -> str:
    """The namespace name of ``job``'s network: ``<prefix><job>`` (job names are 1-64 letters, digits,
    '.', '_' or '-', so that is a safe file name in /run/netns)."""
    if not _valid_name(job, 64):
        raise ValueError(f"not a job name: {job!r}")
    return bridge.prefix + job


def host_link_name(netns: str) -> str:
    """The host end of ``netns``'s veth pair: ``tpj-`` and 11 hex digits of a hash of the name, since a
    link name has 15 characters at most and a job name up to 64. The same name always gives the same link,
    so that removing a network finds it."""
    return "tpj-" + hashlib.sha256(netns.encode()).hexdigest()[: _LINK_NAME_MAX - 4]


def netns_path(netns: str) -> Path:
    return NETNS_DIR / netns


def _ip_command() -> str:
    found = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), _SBIN]))
    if found is None:
        raise EnvironmentProblem("ip not found: install iproute2 for job networks")
    return found


def _ip(*args: str) -> str:
    """Run ``ip ARGS``; its stdout, or EnvironmentProblem with the line it printed last."""
    argv = [_ip_command(), *args]
    shown = " ".join(["ip", *args])
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_TIMEOUT_S, check=True
        )
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or exc.stdout or "").strip().splitlines()
        raise EnvironmentProblem(
            f"'{shown}' failed: {said[-1] if said else f'exit {exc.returncode}'}", details=said[:-1][-5:]
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise EnvironmentProblem(f"'{shown}' did not finish within {_TIMEOUT_S:.0f} s") from exc
    except OSError as exc:
        raise EnvironmentProblem(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
    return done.stdout


def _ip_json(*args: str) -> list[dict[str, Any]]:
    text = _ip("-j", *args).strip()
    found = json.loads(text) if text else []
    return [entry for entry in found if isinstance(entry, dict)]


def _link_exists(name: str) -> bool:
    return os.path.lexists(f"/sys/class/net/{name}")


def _ipv4_addresses(*args: str) -> list[IPv4Interface]:
    """The IPv4 addresses ``ip -j -4 ARGS addr show …`` lists."""
    return [
        IPv4Interface((info["local"], info["prefixlen"]))
        for link in _ip_json("-4", *args)
        for info in link.get("addr_info", [])
        if info.get("family") == "inet"
    ]


def routed_networks(bridge: Bridge) -> list[IPv4Network]:
    """The IPv4 networks the machine routes (every table), but those through ``bridge`` and the default
    route."""
    routed = []
    for route in _ip_json("-4", "route", "show", "table", "all"):
        destination = route.get("dst")
        if not isinstance(destination, str) or destination == "default" or route.get("dev") == bridge.name:
            continue
        routed.append(IPv4Network(destination, strict=False))
    return routed


def ensure_bridge(bridge: Bridge) -> None:
    """Make ``bridge`` exist, up, with its address (nothing changes if it is so already).

    Refuses (EnvironmentProblem) if its subnet overlaps a network the machine routes elsewhere, if a
    link of that name is not a bridge, or if the bridge has another IPv4 address (made for another
    subnet).
    """
    # the default route overlaps everything and claims nothing (torpor.policy.addresses.overlapping)
    clash = [str(n) for n in routed_networks(bridge) if n.prefixlen > 0 and n.overlaps(bridge.subnet)]
    if clash:
        raise EnvironmentProblem(
            f"subnet {bridge.subnet} for job networks overlaps {', '.join(dict.fromkeys(clash))}, already "
            f"routed on this machine: choose another subnet (bridge {bridge.name} not made)"
        )
    if not _link_exists(bridge.name):
        try:
            _ip("link", "add", bridge.name, "type", "bridge")
        except EnvironmentProblem:
            if not _link_exists(bridge.name):  # else another torpor made it meanwhile
                raise
    if not os.path.isdir(f"/sys/class/net/{bridge.name}/bridge"):
        raise EnvironmentProblem(
            f"{bridge.name} is a network link but not a bridge: choose another bridge name for job networks"
        )
    addresses = _ipv4_addresses("addr", "show", "dev", bridge.name)
    if bridge.address not in addresses:
        if addresses:
            having = ", ".join(str(address) for address in addresses)
            raise EnvironmentProblem(
                f"bridge {bridge.name} has {having}, not {bridge.address}: it was made for another subnet; "
                f"remove it ('ip link del {bridge.name}') once no job uses it, or use its subnet"
            )
        try:
            _ip("addr", "add", str(bridge.address), "dev", bridge.name)
        except EnvironmentProblem:
            if bridge.address not in _ipv4_addresses("addr", "show", "dev", bridge.name):
                raise
    _no_forwarding(bridge.name)
    _ip("link", "set", bridge.name, "up")


def _no_forwarding(link: str) -> None:
    # per-interface IPv4 forwarding decides whether a packet received on ``link`` may be routed on: off,
    # the jobs reach the machine only, whatever the machine's own ip_forward
    try:
        Path(f"/proc/sys/net/ipv4/conf/{link}/forwarding").write_text("0\n")
    except OSError as exc:
        raise EnvironmentProblem(f"cannot switch off forwarding on {link}: {exc.strerror or exc}") from exc


def remove_bridge(bridge: Bridge) -> None:
    """Delete ``bridge`` if it exists (job networks still on it lose their way to the machine)."""
    if _link_exists(bridge.name):
        try:
            _ip("link", "del", bridge.name)
        except EnvironmentProblem:
            if _link_exists(bridge.name):
                raise


def create(bridge: Bridge, job: str, address: IPv4Address) -> JobNetwork:
    """Make ``job``'s network on ``bridge`` (which :func:`ensure_bridge` made) with ``address``.

    Refuses (EnvironmentProblem) if the job has a network already: remove it first. If a step fails, what
    this call made is removed again before the error is raised.
    """
    if not bridge.holds_job_address(address):
        raise ValueError(f"{address} is not a job address in {bridge.subnet}")
    netns = netns_name(bridge, job)
    link = host_link_name(netns)
    if os.path.lexists(netns_path(netns)):
        raise EnvironmentProblem(
            f"job {job} has a network already ({netns_path(netns)}): remove it before making a new one"
        )
    _ip("netns", "add", netns)
    made_link = False
    try:
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("link", "add", link, "type", "veth", "peer", "name", INSIDE_LINK, "netns", netns)
        made_link = True
        _ip("link", "set", link, "master", bridge.name, "up")
        inside = IPv4Interface((address, bridge.subnet.prefixlen))
        _ip("-n", netns, "addr", "add", str(inside), "dev", INSIDE_LINK)
        _ip("-n", netns, "link", "set", INSIDE_LINK, "up")
        _ip("-n", netns, "route", "add", "default", "via", str(bridge.address.ip))
    except BaseException:
        _remove(netns, link if made_link else None)
        raise
    return JobNetwork(netns, link, address)


def remove(netns: str) -> None:
    """Delete the job network ``netns`` (its veth pair, then the namespace's name); nothing happens for
    what is gone already. A process still in the namespace keeps it, cut off from the bridge, until it
    ends."""
    _remove(netns, host_link_name(netns))


def _remove(netns: str, link: str | None) -> None:
    if link is not None and _link_exists(link):
        try:
            _ip("link", "del", link)
        except EnvironmentProblem:
            if _link_exists(link):
                raise
    if os.path.lexists(netns_path(netns)):
        try:
            _ip("netns", "del", netns)
        except EnvironmentProblem:
            if os.path.lexists(netns_path(netns)):
                raise


def job_networks(bridge: Bridge) -> list[JobNetwork]:
    """The job networks of ``bridge`` (namespaces named with its prefix) that exist now, by name: those of
    running jobs, and leftovers to remove."""
    try:
        names = sorted(entry for entry in os.listdir(NETNS_DIR) if entry.startswith(bridge.prefix))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise EnvironmentProblem(f"cannot list {NETNS_DIR}: {exc.strerror or exc}") from exc
    found = []
    for netns in names:
        try:
            inside = _ipv4_addresses("-n", netns, "addr", "show", "dev", INSIDE_LINK)
        except EnvironmentProblem:
            if not os.path.lexists(netns_path(netns)):
                continue  # removed meanwhile
            inside = []  # no eth0: half made
        found.append(JobNetwork(netns, host_link_name(netns), inside[0].ip if inside else None))
    return found


def _nsfs_device() -> int:
    return os.stat("/proc/self/ns/net").st_dev


def netns_inode(netns: str) -> int:
    """The inode of ``netns``: what ``/proc/PID/ns/net`` of a process in it shows (``net:[INODE]``), and
    what ``criu dump --external net[INODE]:KEY`` names."""
    path = netns_path(netns)
    try:
        seen = os.stat(path)
    except OSError as exc:
        raise EnvironmentProblem(f"job network {netns} is gone ({path}: {exc.strerror or exc})") from exc
    if seen.st_dev != _nsfs_device():
        raise EnvironmentProblem(f"{path} is not a network namespace: remove it ('ip netns del {netns}')")
    return seen.st_ino


def open_netns(netns: str) -> int:
    """A new file descriptor of ``netns`` (close-on-exec: pass it with ``subprocess``'s ``pass_fds``, e.g.
    for ``criu restore --inherit-fd fd[N]:KEY``); the caller closes it."""
    path = netns_path(netns)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise EnvironmentProblem(f"job network {netns} is gone ({path}: {exc.strerror or exc})") from exc
    if os.fstat(fd).st_dev != _nsfs_device():
        os.close(fd)
        raise EnvironmentProblem(f"{path} is not a network namespace: remove it ('ip netns del {netns}')")
    return fd
