"""policy.placement: which peer takes which job — best fit by free memory, ties spread, none over its room."""

from __future__ import annotations

import random

import pytest

from torpor.policy.placement import Job, Peer, Placement, place

GIB = 2**30


def test_a_job_goes_to_the_peer_it_fits_best_and_leaves_the_large_room_whole() -> None:
    peers = [Peer("big", 64 * GIB), Peer("small", 5 * GIB), Peer("mid", 16 * GIB)]
    assert place([Job("a", 4 * GIB)], peers).peer_of("a") == "small"
    assert place([Job("a", 8 * GIB)], peers).peer_of("a") == "mid"
    # then the large job still finds the large room
    placement = place([Job("a", 8 * GIB), Job("b", 60 * GIB)], peers)
    assert [(m.job, m.peer) for m in placement.moves] == [("a", "mid"), ("b", "big")]


def test_a_job_that_fills_a_peer_exactly_goes_there() -> None:
    assert place([Job("a", 5 * GIB)], [Peer("x", 9 * GIB), Peer("y", 5 * GIB)]).peer_of("a") == "y"


def test_of_peers_left_with_the_same_room_the_one_given_fewer_jobs_takes_the_next() -> None:
    peers = [Peer("a", 30 * GIB), Peer("b", 10 * GIB)]
    # only "a" has room for "x", and is left with 10 GiB, as "b" has: "y" goes to "b", given none yet
    placement = place([Job("x", 20 * GIB), Job("y", 3 * GIB)], peers)
    assert [(m.job, m.peer) for m in placement.moves] == [("x", "a"), ("y", "b")]


def test_identical_peers_filled_one_job_each_get_one_each() -> None:
    peers = [Peer(f"node{i}", 100 * GIB) for i in range(4)]
    placement = place([Job(f"j{i}", 100 * GIB) for i in range(4)], peers)
    assert sorted(move.peer for move in placement.moves) == ["node0", "node1", "node2", "node3"]


def test_an_unreachable_or_draining_peer_takes_nothing() -> None:
    peers = [
        Peer("gone", 99 * GIB, reachable=False),
        Peer("leaving", 99 * GIB, draining=True),
        Peer("ok", GIB),
    ]
    placement = place([Job("a", GIB), Job("b", GIB)], peers)
    assert placement.peer_of("a") == "ok"
    assert placement.peer_of("b") is None
    assert placement.stays[0].reason == "no peer has 1G free (the most: ok, 0)"


def test_with_no_peer_able_to_take_jobs_every_job_stays_and_says_why() -> None:
    placement = place([Job("a", 1), Job("b", 2)], [Peer("gone", GIB, reachable=False)])
    assert placement.moves == ()
    assert [stay.job for stay in placement.stays] == ["a", "b"]
    assert all("none is reachable and not draining" in stay.reason for stay in placement.stays)


def test_the_jobs_given_first_get_the_room_first() -> None:
    peers = [Peer("only", 10 * GIB)]
    first = place([Job("valuable", 8 * GIB), Job("other", 8 * GIB)], peers)
    assert first.peer_of("valuable") == "only" and first.peer_of("other") is None


def test_nothing_given_nothing_placed() -> None:
    assert place([], [Peer("x", GIB)]) == Placement((), ())


@pytest.mark.parametrize("seed", range(5))
def test_a_fleet_of_a_thousand_peers_never_gets_more_than_its_room_and_a_job_stays_only_if_none_fits(
    seed: int,
) -> None:
    rng = random.Random(seed)
    peers = [
        Peer(f"n{i:04}", rng.choice([0, 8, 16, 64, 128]) * GIB, reachable=rng.random() > 0.05)
        for i in range(1000)
    ]
    jobs = [Job(f"j{i:04}", rng.randint(1, 96) * GIB) for i in range(1000)]
    placement = place(jobs, peers)

    assert sorted([m.job for m in placement.moves] + [s.job for s in placement.stays]) == [
        j.name for j in jobs
    ]
    memory = {job.name: job.memory for job in jobs}
    left = {peer.name: peer.free for peer in peers if peer.reachable}
    for move in placement.moves:
        left[move.peer] -= memory[move.job]
    assert min(left.values()) >= 0
    # room only shrinks as the plan goes: a job that stayed fits nowhere even at the end
    assert all(memory[stay.job] > max(left.values()) for stay in placement.stays)
    assert placement.moves and placement.stays
