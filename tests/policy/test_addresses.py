"""Which address a job with a network of its own gets, and which subnets may hold such jobs
(torpor.policy.addresses): the bridge's address, the lowest free one, a full subnet, overlapping routes."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface, IPv4Network

from torpor.policy.addresses import (
    bridge_address,
    full_reason,
    job_addresses,
    overlapping,
    pick_address,
    subnet_problem,
)

SUBNET = IPv4Network("10.213.0.0/24")


def addresses(*last: int) -> list[IPv4Address]:
    return [IPv4Address(f"10.213.0.{n}") for n in last]


def test_the_bridge_has_the_first_host_address_with_the_subnet_prefix() -> None:
    assert bridge_address(SUBNET) == IPv4Interface("10.213.0.1/24")
    assert bridge_address(IPv4Network("10.213.4.0/22")) == IPv4Interface("10.213.4.1/22")


def test_the_first_job_gets_the_address_after_the_bridge() -> None:
    assert pick_address(SUBNET, []) == IPv4Address("10.213.0.2")


def test_a_job_gets_the_lowest_free_address_so_a_removed_jobs_address_is_used_again() -> None:
    assert pick_address(SUBNET, addresses(2, 3, 4)) == IPv4Address("10.213.0.5")
    assert pick_address(SUBNET, addresses(2, 4, 5)) == IPv4Address("10.213.0.3")


def test_the_bridge_network_and_broadcast_addresses_are_never_picked() -> None:
    picked = set()
    taken: list[IPv4Address] = []
    while (address := pick_address(SUBNET, taken)) is not None:
        picked.add(address)
        taken.append(address)
    assert len(picked) == 253 == len(job_addresses(SUBNET))
    assert not picked & {SUBNET.network_address, SUBNET.network_address + 1, SUBNET.broadcast_address}


def test_a_full_subnet_gives_none_and_a_reason_that_says_what_to_do() -> None:
    small = IPv4Network("10.213.0.0/30")  # .1 the bridge, .2 the only job
    assert pick_address(small, []) == IPv4Address("10.213.0.2")
    assert pick_address(small, addresses(2)) is None
    reason = full_reason(small)
    assert "10.213.0.0/30" in reason and "1 job has one" in reason and "larger subnet" in reason
    assert "\n" not in reason


def test_taken_addresses_outside_the_subnet_do_not_count() -> None:
    assert pick_address(SUBNET, [IPv4Address("10.213.1.2"), IPv4Address("192.0.2.2")]) == IPv4Address(
        "10.213.0.2"
    )


def test_a_subnet_too_small_for_a_bridge_and_a_job_is_refused() -> None:
    for tiny in ("10.213.0.0/31", "10.213.0.7/32"):
        subnet = IPv4Network(tiny)
        assert pick_address(subnet, []) is None
        problem = subnet_problem(subnet, [])
        assert problem is not None and "too small" in problem


def test_a_subnet_that_overlaps_a_routed_network_is_refused_naming_it() -> None:
    routed = [IPv4Network("192.0.2.0/24"), IPv4Network("10.0.0.0/8"), IPv4Network("10.213.0.128/25")]
    assert overlapping(SUBNET, routed) == [IPv4Network("10.0.0.0/8"), IPv4Network("10.213.0.128/25")]
    problem = subnet_problem(SUBNET, routed)
    assert problem is not None
    assert "10.0.0.0/8, 10.213.0.128/25" in problem and "another subnet" in problem
    assert "192.0.2.0/24" not in problem


def test_routes_beside_the_subnet_and_the_default_route_do_not_overlap() -> None:
    routed = [
        IPv4Network("0.0.0.0/0"),
        IPv4Network("10.212.255.0/24"),
        IPv4Network("10.213.1.0/24"),
        IPv4Network("127.0.0.0/8"),
    ]
    assert overlapping(SUBNET, routed) == []
    assert subnet_problem(SUBNET, routed) is None


def test_a_network_routed_twice_is_named_once() -> None:
    twice = [IPv4Network("10.213.0.0/24"), IPv4Network("10.213.0.0/24")]  # e.g. in two routing tables
    assert overlapping(SUBNET, twice) == [SUBNET]
