"""``torpor migrate``: a running job moved to a peer's agent (issue 30). Real CRIU, two state
directories each with its own store key, the peer a real agent reached over TCP on loopback, or over
TLS on a second node: a network namespace of the test's own, joined by a veth pair it cuts."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import TORPOR, Torpor, free_port, python_job
from torpor.apps.agent.abroad import PeerAgent
from torpor.core import migrate
from torpor.core.migrate import move
from torpor.core.peers import Peers
from torpor.errors import TorporError

from .conftest import AgentProcess, counts_on, engine_of, ip, loopback_peer, steps
from .test_peers import certificate, secret

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


def test_a_running_job_moves_to_the_peer_and_counts_on_there_with_all_its_output(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    peer = loopback_peer(torpor, other, "b", tmp_path).agent
    try:
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        torpor.wait_log("c", "step 5")
        moved = torpor.run("migrate", "c", "--to", "b")
        assert "moved job 'c' to peer b:" in moved.stdout, moved.stderr
        assert "copying its memory while it runs" in moved.stderr

        # the source keeps a record of where it went, and will not run it again
        assert torpor.job("c")["state"] == "hibernated" and "moved to b" in torpor.job("c")["message"]
        assert "moved to b" in torpor.run("ps").stdout
        assert [j["moved_to"] for j in torpor.json("ps")] == ["b"]
        again = torpor.run("resume", "c", check=False)
        assert again.returncode == 2 and "moved to peer b" in again.stderr
        left = steps(torpor.log("c"))

        assert other.job("c")["state"] == "running"
        counts_on(other, "c", left)  # all of its output, then on: no step lost, none twice
        assert [e["action"] for e in peer.events("c")][-2:] == ["arriving", "arrived"]
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


def test_a_move_the_peer_refuses_leaves_the_job_running_here_and_nothing_there(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    peer = loopback_peer(torpor, other, "b", tmp_path).agent
    try:
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        other.run("run", "--name", "c", "--", "sleep", "300")  # the peer's own job of that name
        torpor.wait_log("c", "step 2")
        refused = torpor.run("migrate", "c", "--to", "b", check=False)
        assert refused.returncode == 2 and "has a job named 'c' of its own" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert torpor.job("c")["state"] == "running" and torpor.json("ps")[0]["moved_to"] is None
        counts_on(torpor, "c", steps(torpor.log("c")))  # on here
        assert other.job("c")["command"] == ["sleep", "300"]  # theirs, untouched
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


def empty_there(folder: Path) -> list[str]:
    """A command prefix: what it runs sees ``folder`` empty (a tmpfs, in a mount namespace of its own)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(folder)]  # fmt: skip


@pytest.mark.root("to give the peer's agent a mount namespace of its own")
def test_the_files_a_job_writes_go_with_it_to_a_peer_that_has_not_them_and_it_writes_on_there(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    # the peer's agent sees a folder of its own at work/ (an empty tmpfs in a mount namespace of its
    # own): what the job wrote there on this machine is not on the peer until the move carries it
    work = tmp_path / "work"
    work.mkdir()
    served = loopback_peer(torpor, other, "b", tmp_path, prefix=empty_there(work))
    peer = served.agent
    assert peer.process is not None
    there = Path(f"/proc/{peer.process.pid}/root") / work.relative_to("/")  # work/ as the peer sees it
    try:
        assert list(there.iterdir()) == []
        torpor.run("run", "--name", "c", *python_job("writer.py", str(work / "metrics.txt")))
        torpor.wait_log("c", "step 5")
        check = torpor.json("migrate", "c", "--to", "b", "--check")
        assert check["may_move"] and check["written_files"] == [str(work / "metrics.txt")], check
        moved = torpor.run("migrate", "c", "--to", "b")
        assert "1 file(s) it writes carried" in moved.stdout, moved.stdout
        assert "sending 1 file it writes" in moved.stderr
        left = steps(torpor.log("c"))
        counts_on(other, "c", left)

        # the peer's copy holds every line once: the job wrote on into it from where it stopped here
        lines = (there / "metrics.txt").read_text().splitlines()
        assert lines == [f"line {n}" for n in range(len(lines))] and len(lines) > len(left), lines
        assert (work / "metrics.txt").read_text().splitlines() == [
            f"line {n}" for n in left
        ]  # here: as it stopped
        assert (there / "metrics.txt").stat().st_mode & 0o777 == (work / "metrics.txt").stat().st_mode & 0o777
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


@pytest.mark.root("to give the peer's agent a mount namespace of its own")
def test_a_file_the_job_writes_whose_folder_the_peer_lacks_refuses_the_move_before_the_freeze(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    peer = loopback_peer(torpor, other, "b", tmp_path, prefix=empty_there(work)).agent
    try:
        (work / "out").mkdir()  # here, not in the peer's empty work/
        torpor.run("run", "--name", "c", *python_job("writer.py", str(work / "out" / "m.txt")))
        torpor.wait_log("c", "step 2")
        refused = torpor.run("migrate", "c", "--to", "b", check=False)
        assert refused.returncode == 3, refused.stderr
        assert f"the folder of a file the job writes is not on peer b: {work}/out/m.txt" in refused.stderr
        assert torpor.job("c")["state"] == "running" and other.json("ps") == []
    finally:
        peer.close()
        torpor.run("rm", "--force", "c", check=False)


def handed_over(source: Torpor, there: Torpor, peer: str, before: list[int]) -> None:
    """Job c runs on ``there`` (the peer ``peer``) and counts on from ``before``; ``source`` says it moved."""
    assert there.job("c")["state"] == "running" and source.json("ps")[0]["moved_to"] == peer
    counts_on(there, "c", before)


class Before:
    """The real link to the peer's agent, but ``then`` is done just before its call ``step`` (the peer's
    agent killed, the cable cut)."""

    def __init__(self, link: PeerAgent, step: str, then: Callable[[], object]) -> None:
        self.link, self.step, self.then, self.name = link, step, then, link.name

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.link, name)
        if name != self.step:
            return call

        def first_then(*args: Any, **kwargs: Any) -> Any:
            self.then()
            return call(*args, **kwargs)

        return first_then


def test_a_peer_killed_at_each_step_leaves_one_copy_and_the_move_ends_once_it_is_back(
    torpor: Torpor, other: Torpor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_of(torpor, monkeypatch)
    monkeypatch.setattr(migrate, "BATCH_BYTES", 64)  # the log and the chunks in many pieces
    served = loopback_peer(torpor, other, "b", tmp_path)
    peer = served.agent
    try:
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        torpor.wait_log("c", "step 2")
        link = PeerAgent(Peers(engine.records).get("b"))

        # killed before the job's records reach it: the move is aborted, the job runs on here
        with pytest.raises(TorporError) as cut:
            move(engine, "c", Before(link, "arrive", peer.kill))  # type: ignore[arg-type]
        assert "job 'c' was not moved: it runs here as before" in cut.value.details
        assert torpor.job("c")["state"] == "running"
        served.start()
        assert other.json("ps") == []  # the records never arrived: no job there

        # killed after the commit, before it is told to go: the job is the peer's, hibernated here
        with pytest.raises(TorporError) as cut:
            move(engine, "c", Before(link, "go", peer.kill))  # type: ignore[arg-type]
        assert any("it stays hibernated here, its image kept" in line for line in cut.value.details)
        assert torpor.job("c")["state"] == "hibernated"
        refused = torpor.run("resume", "c", check=False)
        assert refused.returncode == 2 and "moved to peer b" in refused.stderr
        served.start()  # the peer, started again, holds it arrived but not its own: it waits
        assert other.job("c")["state"] == "hibernated"
        held = other.run("resume", "c", check=False)
        assert held.returncode == 2 and "is arriving from" in held.stderr
        left = steps(torpor.log("c"))

        finished = torpor.run("migrate", "c", "--to", "b")  # hands it over now
        assert "moved job 'c' to peer b" in finished.stdout
        handed_over(torpor, other, "b", left)
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


@contextlib.contextmanager
def node_agent(torpor: Torpor, other: Torpor, tmp_path: Path, node: tuple[str, str, str]) -> Iterator[None]:
    """``other``'s agent in the second node's network namespace, serving TLS on its address, added to
    ``torpor``'s peers as ``node2``; stopped after."""
    netns, _, address = node
    cert, key = certificate(tmp_path, address)
    token = secret(tmp_path / "token")
    port = free_port()
    command = [
        "ip", "netns", "exec", netns, TORPOR, "agent", "--round", "200ms", "--listen", f"{address}:{port}",
        "--token-file", str(token), "--tls-cert", str(cert), "--tls-key", str(key), "--memory-budget", "2G",
    ]  # fmt: skip
    add = [
        "peers",
        "add",
        "node2",
        f"https://{address}:{port}",
        "--token-file",
        str(token),
        "--ca-file",
        str(cert),
    ]
    with open(tmp_path / "node-agent.log", "wb") as log:
        agent = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=other.env
        )
    try:
        torpor.wait_for(
            lambda: torpor.run(*add, check=False).returncode == 0, 30, "the node's agent to answer"
        )
        yield
    finally:
        agent.terminate()
        agent.wait(30)


@pytest.mark.root("to make a network namespace and a veth pair")
def test_a_job_moves_to_another_node_over_tls_and_a_cut_cable_before_go_ends_with_one_copy_once_mended(
    torpor: Torpor, other: Torpor, tmp_path: Path, node: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cable = node[1]
    engine = engine_of(torpor, monkeypatch)
    try:
        with node_agent(torpor, other, tmp_path, node):
            torpor.run("run", "--name", "c", *python_job("counter.py"))
            torpor.wait_log("c", "step 2")
            link = PeerAgent(Peers(engine.records).get("node2"), timeout_s=10)  # a cut fails a call in 10 s
            with pytest.raises(TorporError) as cut:
                move(engine, "c", Before(link, "go", lambda: ip("link", "set", cable, "down")))  # type: ignore[arg-type]
            assert any("it stays hibernated here, its image kept" in line for line in cut.value.details)
            assert torpor.job("c")["state"] == "hibernated"
            left = steps(torpor.log("c"))
            ip("link", "set", cable, "up")  # mended: the next migrate hands it over
            finished = torpor.run("migrate", "c", "--to", "node2")
            assert "moved job 'c' to peer node2" in finished.stdout
            handed_over(torpor, other, "node2", left)
    finally:
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


def redis(address: str, port: int, *commands: list[str]) -> list[bytes]:
    """Each of ``commands`` sent to the redis server at ``address:port`` (RESP), its reply's first line."""
    replies = []
    with socket.create_connection((address, port), timeout=10) as connection:
        stream = connection.makefile("rwb")
        for command in commands:
            stream.write(f"*{len(command)}\r\n".encode())
            for word in command:
                stream.write(f"${len(word.encode())}\r\n{word}\r\n".encode())
            stream.flush()
            line = stream.readline().rstrip(b"\r\n")
            if line.startswith(b"$") and line != b"$-1":
                line = stream.readline().rstrip(b"\r\n")
            replies.append(line)
    return replies


@pytest.mark.root("to make a network namespace and a veth pair")
@pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (scripts/install-programs.sh)"
)
def test_a_redis_server_with_a_client_moves_with_drop_connections_and_answers_on_the_node_with_its_keys(
    torpor: Torpor, other: Torpor, tmp_path: Path, node: tuple[str, str, str]
) -> None:
    address = node[2]
    port = free_port()
    folder = tmp_path / "redis"
    folder.mkdir()
    server = ["redis-server", "--port", str(port), "--bind", "0.0.0.0", "--protected-mode", "no"]
    server += ["--save", "", "--appendonly", "no", "--dir", str(folder)]
    try:
        with node_agent(torpor, other, tmp_path, node):
            torpor.run("run", "--name", "r", "--", *server)
            torpor.wait_for(lambda: "Ready to accept connections" in torpor.log("r"), 30, "redis to start")
            keys = [["SET", f"key{n}", f"value {n}"] for n in range(100)]
            assert set(redis("127.0.0.1", port, *keys)) == {b"+OK"}
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:  # a connection it keeps
                refused = torpor.run("migrate", "r", "--to", "node2", check=False)
                assert refused.returncode == 3 and f"127.0.0.1:{port} -> 127.0.0.1:" in refused.stderr, (
                    refused.stderr
                )
                assert torpor.job("r")["state"] == "running"
                moved = torpor.run("migrate", "r", "--to", "node2", "--drop-connections")
                assert "moved job 'r' to peer node2" in moved.stdout, moved.stderr
                client.settimeout(30)
                with contextlib.suppress(ConnectionResetError, TimeoutError):
                    assert client.recv(1) == b""  # its connection is gone with it
            assert other.job("r")["state"] == "running" and torpor.job("r")["moved_to"] == "node2"
            # on the node's address, with every key
            assert redis(address, port, ["GET", "key42"], ["DBSIZE"]) == [b"value 42", b":100"]
    finally:
        other.run("rm", "--force", "r", check=False)
        torpor.run("rm", "--force", "r", check=False)


#: a 'torpor migrate' of job c to peer b that dies (SIGKILL's exit) just before the job's records reach b
DIES_BEFORE_ARRIVE = """
import os
from torpor.apps.agent.abroad import PeerAgent
from torpor.core.engine import Engine
from torpor.core.migrate import move, moving
from torpor.core.peers import Peers
from torpor.settings import Settings

engine = Engine(Settings.from_environment())
link = PeerAgent(Peers(engine.records).get("b"))
link.arrive = lambda *args: os._exit(137)
with moving(engine, "c"):
    move(engine, "c", link)
"""


def test_the_source_agent_finishes_a_cut_off_move_by_itself_undone_before_the_commit_handed_over_after(
    torpor: Torpor, other: Torpor, agent: AgentProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_of(torpor, monkeypatch)
    served = loopback_peer(torpor, other, "b", tmp_path)
    peer = served.agent
    try:
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        torpor.wait_log("c", "step 2")

        # the move's process dies with the job hibernated and recorded moving, before the peer has it
        died = subprocess.run([sys.executable, "-c", DIES_BEFORE_ARRIVE], env=torpor.env, capture_output=True)
        assert died.returncode == 137, died.stderr.decode()
        assert torpor.job("c")["state"] == "hibernated"
        agent.start()  # the source's agent undoes it: the job is resumed here, the peer told to drop it
        undone = agent.wait_event("stay", "c", timeout=60)
        assert "undone" in undone["reason"]
        assert torpor.job("c")["state"] == "running" and other.json("ps") == []

        # cut after the commit (the peer's agent killed before go): handed over once the peer is back
        link = PeerAgent(Peers(engine.records).get("b"))
        with pytest.raises(TorporError):
            move(engine, "c", Before(link, "go", peer.kill))  # type: ignore[arg-type]
        left = steps(torpor.log("c"))
        served.start()
        handed = agent.wait_event("moved", "c", timeout=60)
        assert "handed over to peer b" in handed["reason"]
        handed_over(torpor, other, "b", left)
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)
