"""Which IPv4 address a job with a network of its own gets, and whether a subnet may be used for them.

A job started with ``--own-network`` lives in a network namespace joined to a bridge that torpor manages
(torpor.adapters.jobnet). The bridge holds the subnet's first host address and is the jobs' way to the
machine; each job gets one of the next host addresses, the lowest one free, so that a clone of a server
listening on a port gets an address of its own and never collides with the other clones.

A subnet is only usable if it does not overlap a network the machine already routes somewhere else: the
new route through the bridge would then capture (or lose) traffic meant for that network.

Pure: what is taken and what is routed are read by the caller (the adapter asks ``ip``), who also raises.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from ipaddress import IPv4Address, IPv4Interface, IPv4Network

#: a bridge address and one job at least: /30 is the smallest subnet with two host addresses
SMALLEST_PREFIX = 30


def bridge_address(subnet: IPv4Network) -> IPv4Interface:
    """The bridge's address in ``subnet``: its first host address (``10.213.0.0/24`` → ``10.213.0.1/24``)."""
    return IPv4Interface((subnet.network_address + 1, subnet.prefixlen))


def job_addresses(subnet: IPv4Network) -> range:
    """The integer values of the addresses jobs may have in ``subnet``: every host address but the bridge's."""
    if subnet.prefixlen > SMALLEST_PREFIX:
        return range(0)
    return range(int(subnet.network_address) + 2, int(subnet.broadcast_address))


def pick_address(subnet: IPv4Network, taken: Collection[IPv4Address]) -> IPv4Address | None:
    """The lowest address of ``subnet`` after the bridge's that no job has in ``taken``; None when none is
    left (addresses in ``taken`` outside ``subnet`` are ignored)."""
    used = {int(address) for address in taken}
    for value in job_addresses(subnet):
        if value not in used:
            return IPv4Address(value)
    return None


def overlapping(subnet: IPv4Network, routed: Iterable[IPv4Network]) -> list[IPv4Network]:
    """The networks in ``routed`` that share an address with ``subnet``, in the order given, each once.

    A default route (``0.0.0.0/0``) overlaps everything but is no claim on any subnet: it is left out.
    """
    found: list[IPv4Network] = []
    for network in routed:
        if network.prefixlen > 0 and subnet.overlaps(network) and network not in found:
            found.append(network)
    return found


def subnet_problem(subnet: IPv4Network, routed: Iterable[IPv4Network]) -> str | None:
    """Why jobs cannot get their addresses in ``subnet`` (too small, or it overlaps a network in ``routed``,
    the machine's routes less the bridge's own), as a sentence that says what to do; None if they can."""
    if subnet.prefixlen > SMALLEST_PREFIX:
        return (
            f"subnet {subnet} is too small for job networks: it needs room for the bridge and a job "
            f"(/{SMALLEST_PREFIX} or larger)"
        )
    clash = overlapping(subnet, routed)
    if clash:
        networks = ", ".join(str(network) for network in clash)
        return (
            f"subnet {subnet} for job networks overlaps {networks}, already routed on this machine: "
            "choose another subnet"
        )
    return None


def full_reason(subnet: IPv4Network) -> str:
    """What to say when :func:`pick_address` found no address left in ``subnet``."""
    jobs = len(job_addresses(subnet))
    return (
        f"no address left for a job network in {subnet} ({jobs} job{'s have' if jobs != 1 else ' has'} one): "
        "remove a job with a network of its own, or use a larger subnet"
    )
