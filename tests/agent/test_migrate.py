"""``torpor migrate``: a running job moved to a peer's agent (issue 30). Real CRIU, two state
directories each with its own store key, the peer a real agent reached over TCP on loopback, or over
TLS on a second node: a network namespace of the test's own, joined by a veth pair it cuts."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TORPOR, Torpor, free_port, python_job
from torpor.apps.agent.abroad import PeerAgent
from torpor.core import migrate
from torpor.core.engine import Engine
from torpor.core.migrate import move
from torpor.core.peers import Peers
from torpor.errors import TorporError
from torpor.settings import Settings

from .conftest import AgentProcess, ip
from .test_peers import certificate, secret

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


def steps(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"^step (\d+)$", log, re.M)]


def test_a_running_job_moves_to_the_peer_and_counts_on_there_with_all_its_output(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    token = secret(tmp_path / "token")
    port = free_port()
    peer = AgentProcess(other, tmp_path / "peer-agent.log")
    try:
        peer.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", "2G")
        torpor.run("peers", "add", "b", f"http://127.0.0.1:{port}", "--token-file", str(token))
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
        other.wait_for(lambda: len(steps(other.log("c"))) > len(left) + 5, 30, "the count to go on there")
        there = steps(other.log("c"))
        assert there == list(range(len(there)))  # all of its output, then on: no step lost, none twice
        assert there[: len(left)] == left
        assert [e["action"] for e in peer.events("c")][-2:] == ["arriving", "arrived"]
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


def test_a_move_the_peer_refuses_leaves_the_job_running_here_and_nothing_there(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    token = secret(tmp_path / "token")
    port = free_port()
    peer = AgentProcess(other, tmp_path / "peer-agent.log")
    try:
        peer.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", "2G")
        torpor.run("peers", "add", "b", f"http://127.0.0.1:{port}", "--token-file", str(token))
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        other.run("run", "--name", "c", "--", "sleep", "300")  # the peer's own job of that name
        torpor.wait_log("c", "step 2")
        refused = torpor.run("migrate", "c", "--to", "b", check=False)
        assert refused.returncode == 2 and "has a job named 'c' of its own" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert torpor.job("c")["state"] == "running" and torpor.json("ps")[0]["moved_to"] is None
        at = len(steps(torpor.log("c")))
        torpor.wait_for(lambda: len(steps(torpor.log("c"))) > at + 3, 30, "the count to go on here")
        assert other.job("c")["command"] == ["sleep", "300"]  # theirs, untouched
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


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
    token = secret(tmp_path / "token")
    port = free_port()
    flags = ("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", "2G")
    peer = AgentProcess(other, tmp_path / "peer-agent.log")
    for key, value in torpor.env.items():
        if key.startswith("TORPOR_"):
            monkeypatch.setenv(key, value)
    engine = Engine(Settings.from_environment())
    monkeypatch.setattr(migrate, "BATCH_BYTES", 64)  # the log and the chunks in many pieces
    try:
        peer.start(*flags)
        torpor.run("peers", "add", "b", f"http://127.0.0.1:{port}", "--token-file", str(token))
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        torpor.wait_log("c", "step 2")
        link = PeerAgent(Peers(engine.records).get("b"))

        # killed before the job's records reach it: the move is aborted, the job runs on here
        with pytest.raises(TorporError) as cut:
            move(engine, "c", Before(link, "arrive", peer.kill))  # type: ignore[arg-type]
        assert "job 'c' was not moved: it runs here as before" in cut.value.details
        assert torpor.job("c")["state"] == "running"
        peer.start(*flags)
        assert other.json("ps") == []  # the records never arrived: no job there

        # killed after the commit, before it is told to go: the job is the peer's, hibernated here
        with pytest.raises(TorporError) as cut:
            move(engine, "c", Before(link, "go", peer.kill))  # type: ignore[arg-type]
        assert any("it stays hibernated here, its image kept" in line for line in cut.value.details)
        assert torpor.job("c")["state"] == "hibernated"
        refused = torpor.run("resume", "c", check=False)
        assert refused.returncode == 2 and "moved to peer b" in refused.stderr
        peer.start(*flags)  # the peer, started again, holds it arrived but not its own: it waits
        assert other.job("c")["state"] == "hibernated"
        held = other.run("resume", "c", check=False)
        assert held.returncode == 2 and "is arriving from" in held.stderr
        left = steps(torpor.log("c"))

        finished = torpor.run("migrate", "c", "--to", "b")  # hands it over now
        assert "moved job 'c' to peer b" in finished.stdout
        assert other.job("c")["state"] == "running" and torpor.json("ps")[0]["moved_to"] == "b"
        other.wait_for(lambda: len(steps(other.log("c"))) > len(left) + 3, 30, "the count to go on there")
        there = steps(other.log("c"))
        assert there == list(range(len(there))) and there[: len(left)] == left  # none lost, none twice
    finally:
        peer.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)


@pytest.mark.root("to make a network namespace and a veth pair")
def test_a_job_moves_to_another_node_over_tls_and_a_cut_cable_before_go_ends_with_one_copy_once_mended(
    torpor: Torpor, other: Torpor, tmp_path: Path, node: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    netns, cable, address = node
    cert, key = certificate(tmp_path, address)
    token = secret(tmp_path / "token")
    port = free_port()
    command = [
        "ip", "netns", "exec", netns, TORPOR, "agent", "--round", "200ms", "--listen", f"{address}:{port}",
        "--token-file", str(token), "--tls-cert", str(cert), "--tls-key", str(key), "--memory-budget", "2G",
    ]  # fmt: skip
    with open(tmp_path / "node-agent.log", "wb") as log:
        agent = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=other.env
        )
    for key_, value in torpor.env.items():
        if key_.startswith("TORPOR_"):
            monkeypatch.setenv(key_, value)
    engine = Engine(Settings.from_environment())
    try:
        url = f"https://{address}:{port}"
        torpor.wait_for(
            lambda: (
                torpor.run(
                    "peers",
                    "add",
                    "node2",
                    url,
                    "--token-file",
                    str(token),
                    "--ca-file",
                    str(cert),
                    check=False,
                ).returncode
                == 0
            ),
            30,
            "the node's agent to answer",
        )
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
        assert other.job("c")["state"] == "running" and torpor.json("ps")[0]["moved_to"] == "node2"
        other.wait_for(lambda: len(steps(other.log("c"))) > len(left) + 3, 30, "the count to go on there")
        there = steps(other.log("c"))
        assert there == list(range(len(there))) and there[: len(left)] == left  # none lost, none twice
    finally:
        agent.terminate()
        agent.wait(30)
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)
