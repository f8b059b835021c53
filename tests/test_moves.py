"""core/moves: the hand-off's steps written to torpor.db (real SQLite), each in one transaction."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from conftest import Torpor, python_job
from torpor.core.moves import Moves
from torpor.core.records import Records
from torpor.errors import UsageError
from torpor.policy.handoff import Action, Incoming, PeerRecord, Source, SourceRecord


def moves(folder: Path) -> Moves:
    folder.mkdir(exist_ok=True)
    return Moves(Records(folder / "torpor.db"))


def test_a_move_goes_through_every_step_and_each_record_outlives_its_connection(tmp_path: Path) -> None:
    source, peer = moves(tmp_path / "node1"), moves(tmp_path / "node2")
    assert source.outgoing("train") == (SourceRecord(), "")
    gen = source.start("train", "node2")
    assert gen == 1
    with pytest.raises(UsageError, match="being moved to peer node2 already"):
        source.start("train", "node2")
    assert peer.arrived("train", gen, "node1")
    assert peer.arrived("train", gen, "node1")  # sent again: the same record
    assert source.commit("train")
    assert peer.go("train", gen) == Action.RUN
    assert peer.go("train", gen) == Action.ACK  # a lost ack: the job is already its
    assert source.acknowledged("train", gen) == SourceRecord(Source.GONE, 1)
    # a new connection to each database, as after a restart, reads what was written
    assert moves(tmp_path / "node1").outgoing("train") == (SourceRecord(Source.GONE, 1), "node2")
    assert moves(tmp_path / "node2").incoming("train") == (PeerRecord(Incoming.OWNED, 1), "node1")
    with pytest.raises(UsageError, match="moved to peer node2: it is that machine's now"):
        source.start("train", "node3")


def test_a_question_before_the_commit_aborts_the_move_so_that_it_can_never_commit(tmp_path: Path) -> None:
    source, peer = moves(tmp_path / "node1"), moves(tmp_path / "node2")
    gen = source.start("db", "node2")
    assert peer.arrived("db", gen, "node1")
    assert source.question("db", gen) is False  # the peer started again and asked
    assert moves(tmp_path / "node1").outgoing("db") == (SourceRecord(Source.HERE, 1), "node2")
    assert not source.commit("db")
    assert peer.answered("db", False) == Action.DROP
    assert peer.go("db", gen) == Action.NOTHING  # a late go of the aborted attempt
    again = source.start("db", "node2")  # a second attempt: the next generation
    assert again == 2
    assert not peer.arrived("db", gen, "node1")  # the first attempt's image, late: refused
    assert peer.arrived("db", again, "node1")
    assert source.commit("db")
    assert source.question("db", again) is True
    assert peer.answered("db", True) == Action.RUN


def test_on_restart_an_uncommitted_move_is_aborted_and_a_committed_one_sends_go_again(tmp_path: Path) -> None:
    source = moves(tmp_path / "node1")
    source.start("a", "node2")
    source.start("b", "node3")
    assert source.commit("b")
    source.start("c", "node2")
    assert source.commit("c")
    source.acknowledged("c", 1)
    assert source.unfinished() == [("a", "node2"), ("b", "node3")]  # read, nothing rewritten
    assert source.outgoing("a") == (SourceRecord(Source.MOVING, 1), "node2")
    found = moves(tmp_path / "node1").restart_outgoing()
    assert found == [
        ("a", "node2", SourceRecord(Source.HERE, 1), Action.ABORT),
        ("b", "node3", SourceRecord(Source.COMMITTED, 1), Action.SEND_GO),
    ]
    assert source.outgoing("a") == (SourceRecord(Source.HERE, 1), "node2")  # written before it returned
    assert source.abort("b") == SourceRecord(Source.COMMITTED, 1)  # a committed move is never aborted


def test_a_peer_that_cannot_ask_waits_and_an_abort_drops_only_its_own_generation(tmp_path: Path) -> None:
    peer = moves(tmp_path / "node2")
    assert peer.arrived("j", 3, "node1")
    assert peer.answered("j", None) == Action.WAIT
    assert peer.aborted("j", 2) == Action.NOTHING
    assert peer.incoming("j") == (PeerRecord(Incoming.ARRIVING, 3), "node1")
    assert peer.aborted("j", 3) == Action.DROP
    assert peer.incoming("j") == (PeerRecord(Incoming.NONE, 3), "node1")


def test_a_commit_racing_a_question_gives_yes_after_a_commit_and_no_to_a_move_that_never_commits(
    tmp_path: Path,
) -> None:
    source = moves(tmp_path / "node1")
    for round in range(30):
        job = f"j{round}"
        gen = source.start(job, "node2")
        committed, answer = _race(partial(source.commit, job), partial(source.question, job, gen))
        assert committed == answer, (committed, answer)
        phase = Source.COMMITTED if committed else Source.HERE
        assert source.outgoing(job) == (SourceRecord(phase, gen), "node2")


def _race(first: Callable[[], bool], second: Callable[[], bool]) -> tuple[bool, bool]:
    """Both called at once, each in a thread of its own: what each returned."""
    results: list[bool | None] = [None, None]
    start = threading.Barrier(2)

    def call(i: int, what: Callable[[], bool]) -> None:
        start.wait()
        results[i] = what()

    threads = [threading.Thread(target=call, args=(i, what)) for i, what in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0] is not None and results[1] is not None
    return results[0], results[1]


def test_a_job_that_goes_and_comes_back_takes_its_generation_along_and_is_held_where_it_is_not(
    tmp_path: Path,
) -> None:
    a, b = moves(tmp_path / "a"), moves(tmp_path / "b")

    def trip(source: Moves, peer: Moves, there: str, here: str) -> int:
        gen = source.start("j", there)
        assert (
            source.held("j")
            == f"job 'j' is being moved to peer {there}: it stays hibernated here unless that fails"
        )
        assert peer.arrived("j", gen, here)
        assert (
            peer.held("j")
            == f"job 'j' is arriving from {here}: it is not this machine's until {here} hands it over"
        )
        assert source.commit("j")
        assert peer.go("j", gen) == Action.RUN
        assert source.acknowledged("j", gen).phase == Source.GONE
        assert source.held("j") == f"job 'j' moved to peer {there}: it is that machine's now"
        assert peer.held("j") is None
        return gen

    assert a.held("j") is None
    assert [trip(a, b, "b", "a"), trip(b, a, "a", "b"), trip(a, b, "b", "a")] == [1, 2, 3]
    assert not b.arrived("j", 1, "a")  # a late copy of the first trip's arrival is refused


@pytest.mark.criu
def test_a_job_held_by_a_move_is_not_resumed_and_is_once_the_move_is_aborted(torpor: Torpor) -> None:
    torpor.run("run", "--name", "m", *python_job("counter.py"))
    torpor.wait_log("m", "step 1")
    torpor.run("hibernate", "m", "--wait")
    source = Moves(Records(torpor.home / "torpor.db"))
    source.start("m", "node2")
    refused = torpor.run("resume", "m", check=False)
    assert refused.returncode == 2, refused.stderr
    assert "job 'm' is being moved to peer node2" in refused.stderr and "Traceback" not in refused.stderr
    assert torpor.job("m")["state"] == "hibernated"
    source.abort("m")
    torpor.run("resume", "m")
    assert torpor.job("m")["state"] == "running"
