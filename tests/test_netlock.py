"""CRIU's network lock of a hibernation is released when no restore of that image will release it: the
hibernated job is removed, or restored from another checkpoint (adapters/netlock.py). Real CRIU, real
nftables tables, a job holding a TCP connection to a server in this test.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Torpor, python_job
from torpor.adapters import netlock
from torpor.adapters.system import procfs, sockets
from torpor.core import checkpoint

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


@pytest.mark.timeout(120)
def test_a_job_without_a_tcp_socket_is_hibernated_without_a_network_lock(torpor: Torpor) -> None:
    # the lock costs ~0.4 s of every freeze; a tree with no TCP socket has nothing for it to hold
    torpor.run("run", "--name", "plain", *python_job("counter.py"))
    torpor.wait_log("plain", "step 3\n")
    hibernated = torpor.json("hibernate", "plain")["id"]
    run = hibernation_run(torpor, "plain", hibernated)
    assert netlock.lock_tables(run) == []
    torpor.run("resume", "plain")
    torpor.wait_log("plain", "step 6\n")


@pytest.mark.timeout(120)
def test_a_connection_the_look_missed_fails_the_first_dump_and_the_second_takes_it_behind_the_lock(
    torpor: Torpor, server: socket.socket, tmp_path: Path
) -> None:
    """Between torpor's look at the tree's sockets and CRIU's freeze, the job may connect: CRIU then
    refuses the dump made without ``--tcp-established``, and it is made again with it."""
    with connected_job(torpor, "racer", server) as peer:
        engine = torpor.engine()
        pid = torpor.job("racer")["pid"]
        assert sockets.has_tcp_sockets(procfs.namespace_members(pid))
        tried: list[bool] = []
        criu = engine.ctx.criu

        class Spy(type(criu)):  # type: ignore[misc]
            def dump(self, *args: Any, tcp: bool = True, **options: Any) -> Any:
                tried.append(tcp)
                return super().dump(*args, tcp=tcp, **options)

        spy = Spy.__new__(Spy)
        spy.__dict__.update(criu.__dict__)
        images = tmp_path / "images"
        images.mkdir()
        # as if the look had found no TCP socket: the connection appeared right after it
        stats = checkpoint.dump(spy, pid, images, tmp_path / "dump.log", leave_running=True, tcp=False)
        assert tried == [False, True]
        assert stats is not None and list(images.glob("tcp-stream-*.img")), sorted(
            p.name for p in images.iterdir()
        )
        peer.sendall(b"still there")  # the connection outlived both dumps: the job left running
        torpor.wait_log("racer", "step 12\n")
