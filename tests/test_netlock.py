"""CRIU's network lock of a hibernation is released when no restore of that image will release it: the
hibernated job is removed, or restored from another checkpoint (adapters/netlock.py). Real CRIU, real
nftables tables, a job holding a TCP connection to a server in this test.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator

import pytest

from conftest import Torpor, python_job
from torpor.adapters import netlock

NFT_PATH = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(shutil.which("nft", path=NFT_PATH) is None, reason="no nft (Debian nftables) here"),
]


@pytest.fixture
def server() -> Iterator[socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    yield listener
    listener.close()


def hibernation_run(torpor: Torpor, name: str, checkpoint_id: str) -> str:
    run = netlock.run_id(torpor.home / "jobs" / name / "criu" / f"dump-{checkpoint_id}.log")
    assert run is not None
    return run


def connected_job(torpor: Torpor, name: str, server: socket.socket) -> socket.socket:
    port = server.getsockname()[1]
    torpor.run("run", "--name", name, *python_job("tcp_client.py", str(port)))
    peer, _ = server.accept()
    torpor.wait_log(name, "step 3\n")
    return peer


@pytest.mark.timeout(120)
def test_removing_a_hibernated_job_releases_its_network_lock(torpor: Torpor, server: socket.socket) -> None:
    with connected_job(torpor, "gone", server):
        hibernated = torpor.json("hibernate", "gone")["id"]
        run = hibernation_run(torpor, "gone", hibernated)
        assert netlock.lock_tables(run), "the hibernation left no lock table: nothing to test"
        torpor.run("rm", "gone")
        assert netlock.lock_tables(run) == []


@pytest.mark.timeout(120)
def test_a_rollback_of_a_hibernated_job_releases_the_hibernation_lock(
    torpor: Torpor, server: socket.socket
) -> None:
    with connected_job(torpor, "back", server):
        first = torpor.json("checkpoint", "back")["id"]
        hibernated = torpor.json("hibernate", "back")["id"]
        run = hibernation_run(torpor, "back", hibernated)
        assert netlock.lock_tables(run)
        result = torpor.run("restore", "--from", first, "back")
        assert netlock.lock_tables(run) == [], result.stderr
        assert f"released the network lock of hibernation {hibernated}" in result.stderr
