"""``torpor drain --to-peers`` (issue 30, part 5): the jobs of a node move to the peers that have room,
most valuable first, and the one no peer takes is hibernated here; ``torpor agent --evacuate-to-peers``
does the same at a spot notice. Real CRIU, real agents (this node's and its peers', each its own state
directory and store key) on loopback."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import Torpor, free_port, python_job

from .conftest import AgentProcess, Metadata, _serve, counts_on, loopback_peer, steps
from .test_peers import secret

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]


def test_a_drain_to_two_peers_moves_the_two_jobs_that_fit_and_hibernates_the_third(
    torpor: Torpor, other: Torpor, third: Torpor, agent: AgentProcess, tmp_path: Path
) -> None:
    # each job holds ~110 MiB; each peer has 180 MiB to give: one job each, and none for the third
    peers = [
        loopback_peer(torpor, other, "b", tmp_path, "180M"),
        loopback_peer(torpor, third, "c", tmp_path, "180M"),
    ]
    jobs = {"low": "0", "mid": "1", "top": "2"}
    try:
        agent.start()
        for name, priority in jobs.items():
            torpor.run("run", "--name", name, "--priority", priority, *python_job("memory_hog.py", "100"))
        for name in jobs:
            torpor.wait_log(name, "step 3")

        drained = torpor.run("drain", "--to-peers", "--why", "maintenance")
        out = drained.stdout
        assert re.search(r"^top +moved to b ", out, re.M) and re.search(r"^mid +moved to c ", out, re.M), out
        assert re.search(r"^low +durable ", out, re.M), out
        assert re.search(r"^low stayed here: no peer has .* free", out, re.M), out
        report = torpor.json("drain", "--to-peers")  # a second drain: nothing left to move or save
        assert report["saved"] == {} and report["failed"] == {}

        # the two that moved run there, their output whole and going on; the source knows where they went
        for name, there in (("top", other), ("mid", third)):
            assert torpor.job(name)["moved_to"] == ("b" if there is other else "c")
            assert there.job(name)["state"] == "running"
            counts_on(there, name, steps(torpor.log(name)))
        assert [j["name"] for j in other.json("ps")] == ["top"] and [j["name"] for j in third.json("ps")] == [
            "mid"
        ]

        # the one no peer took is hibernated here, into the durable tier, and nothing of it went anywhere
        assert torpor.job("low")["state"] == "hibernated" and torpor.job("low")["moved_to"] is None
        moved = [e for e in agent.events() if e["action"] == "moved"]
        assert sorted((e["job"], e["reason"]) for e in moved) == [
            ("mid", "evacuation (drain): to peer c"),
            ("top", "evacuation (drain): to peer b"),
        ]
        evacuated = agent.wait_event("evacuated")
        assert "2 moved to peers (top to b, mid to c)" in evacuated["reason"], evacuated
        page = agent.api.get("/").text  # the node's page: where each went, in its row and its timeline
        assert "moved to b" in page and "moved to c" in page and "evacuation (drain): to peer b" in page

        # the drain's end brings back only what it hibernated here
        cancelled = torpor.json("drain", "--cancel")
        assert cancelled["resumed"] == ["low"]
        torpor.wait_for(lambda: torpor.job("low")["state"] == "running", 60, "low to run again")
        counts_on(torpor, "low", steps(torpor.log("low")))
    finally:
        for each in peers:
            each.agent.close()
        for home, names in ((other, ["top"]), (third, ["mid"]), (torpor, list(jobs))):
            for name in names:
                home.run("rm", "--force", name, check=False)


def test_a_spot_notice_moves_the_job_to_the_peer_that_answers_with_evacuate_to_peers(
    torpor: Torpor, other: Torpor, agent: AgentProcess, service: tuple[str, Metadata], tmp_path: Path
) -> None:
    url, meta = service
    peer = loopback_peer(torpor, other, "b", tmp_path)
    token = secret(tmp_path / "gone.token")  # a peer whose agent is gone: asked, and passed over
    torpor.run(
        "peers", "add", "gone", f"http://127.0.0.1:{free_port()}", "--token-file", str(token), "--no-check"
    )
    try:
        torpor.run("run", "--name", "c", *python_job("counter.py"))
        path = "/latest/meta-data/spot/instance-action"
        agent.start("--notice-url", url + path, "--notice-interval", "200ms", "--evacuate-to-peers")
        torpor.wait_log("c", "step 3")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
        _serve(meta, path, 200, json.dumps({"action": "terminate", "time": when}).encode())
        evacuated = agent.wait_event("evacuated", timeout=120)
        assert evacuated["detail"]["saved"]["c"]["moved_to"] == "b", evacuated
        assert torpor.job("c")["moved_to"] == "b" and other.job("c")["state"] == "running"
        counts_on(other, "c", steps(torpor.log("c")))
    finally:
        peer.agent.close()
        other.run("rm", "--force", "c", check=False)
        torpor.run("rm", "--force", "c", check=False)
