"""Copies of a server with networks of their own (``torpor run --from-template T --own-network``), with
real CRIU, a real bridge and real network namespaces: each answers on its own address from the machine,
comes back into its network after a hibernation, and leaves nothing behind once removed.

The tests make their own bridge and subnet (TORPOR_BRIDGE, TORPOR_SUBNET) and send traffic only to the
namespaces they made.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path

import pytest

from conftest import Torpor, free_port
from test_jobnet import new_bridge
from torpor.adapters import jobnet

pytestmark = [
    pytest.mark.criu,
    pytest.mark.root("to make bridges and network namespaces"),
    pytest.mark.xdist_group("jobnet"),
    pytest.mark.timeout(180),
]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "reseeding_server.py"


@pytest.fixture
def networked(torpor: Torpor) -> Iterator[tuple[Torpor, jobnet.Bridge]]:
    """``torpor`` on a bridge and subnet of the test's own, removed after it with what is left on it."""
    bridge = new_bridge()
    torpor.env["TORPOR_BRIDGE"] = bridge.name
    torpor.env["TORPOR_SUBNET"] = str(bridge.subnet)
    try:
        yield torpor, bridge
    finally:
        for job in json.loads(torpor.run("ps", "--json", check=False).stdout or "[]"):
            torpor.run("rm", "--force", job["name"], check=False)
        everyone = jobnet.Bridge(bridge.name, bridge.subnet, prefix="torpor-")
        for network in jobnet.job_networks(everyone):
            if network.address is not None and network.address in bridge.subnet:
                jobnet.remove(network.netns)
        jobnet.remove_bridge(bridge)


def get(host: str, port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://{host}:{port}/", timeout=10) as answer:
        return dict(json.loads(answer.read()))


def test_copies_with_their_own_network_answer_on_their_own_addresses(
    networked: tuple[Torpor, jobnet.Bridge],
) -> None:
    torpor, bridge = networked
    port = free_port()
    torpor.run("run", "--name", "web", "--", sys.executable, "-u", str(EXAMPLE), str(port), "0.0.0.0")
    torpor.wait_log("web", f"ready on {port}")
    torpor.run("template", "save", "ready", "web")
    for name in ("a", "b"):
        torpor.run("run", "--from-template", "ready", "--name", name, "--own-network")
    jobs = {job["name"]: job for job in torpor.json("ps")}
    addresses = {name: jobs[name]["address"] for name in ("a", "b")}
    assert jobs["web"]["address"] is None
    assert len(set(addresses.values())) == 2
    assert all(ip_address(address) in bridge.subnet for address in addresses.values())
    assert "ADDRESS" in torpor.run("ps").stdout
    for name, address in addresses.items():
        torpor.wait_log(name, f"restored as job {name}")
        assert get(address, port)["job"] == name  # each on its own address, from the machine
    assert get("127.0.0.1", port)["job"] == "web"  # the source, undisturbed, on the machine's own

    # a hibernated copy comes back into its network, at its address
    torpor.run("hibernate", "b")
    torpor.run("resume", "b")
    torpor.wait_for(lambda: torpor.log("b").count("restored as job b") == 2, what="b's second restore")
    assert get(addresses["b"], port)["restores"] == 2

    # removing a copy removes its network, and only its own
    everyone = jobnet.Bridge(bridge.name, bridge.subnet, prefix="torpor-")
    before = {str(n.address): n.netns for n in jobnet.job_networks(everyone)}
    assert set(before) == set(addresses.values())
    torpor.run("rm", "--force", "a")
    after = {str(n.address): n.netns for n in jobnet.job_networks(everyone)}
    assert set(after) == {addresses["b"]}
    assert not os.path.exists(f"/run/netns/{before[addresses['a']]}")
