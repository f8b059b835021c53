"""policy.handoff: a job handed to a peer runs on one machine at most, and is never lost.

The protocol is explored exhaustively: every interleaving of its steps with crashes and restarts of
either side, messages lost, delayed past later ones, or delivered twice, and a source that gives up on a
move before its commit, for two attempts in a row. At each state reached: at most one side may run the
job, and one side holds its image. From each state, once both sides are up and the network delivers,
the move settles with exactly one owner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest

from torpor.policy import handoff as h
from torpor.policy.handoff import Action, Incoming, PeerRecord, Source, SourceRecord

Message = tuple[str, int, bool]  # (kind, generation, answer); the answer only for "answer"
_TO_PEER = {"arrive", "go", "abort", "answer"}


@dataclass(frozen=True)
class World:
    src: SourceRecord = field(default_factory=SourceRecord)
    peer: PeerRecord = field(default_factory=PeerRecord)
    src_up: bool = True
    peer_up: bool = True
    net: frozenset[Message] = frozenset()
    attempts: int = 0


def _send(world: World, *messages: Message) -> World:
    return replace(world, net=world.net | set(messages))


def _deliver(world: World, message: Message) -> World:
    kind, gen, answer = message
    if kind == "arrive":
        stored = h.peer_on_arrival(world.peer, gen)
        return world if stored is None else _send(replace(world, peer=stored), ("stored", gen, False))
    if kind == "stored":
        committed = h.source_commit(world.src) if world.src.gen == gen else None
        return world if committed is None else _send(replace(world, src=committed), ("go", gen, False))
    if kind == "go":
        peer, action = h.peer_on_go(world.peer, gen)
        world = replace(world, peer=peer)
        return _send(world, ("ack", gen, False)) if action in (Action.RUN, Action.ACK) else world
    if kind == "ack":
        return replace(world, src=h.source_on_ack(world.src, gen))
    if kind == "abort":
        return replace(world, peer=h.peer_on_abort(world.peer, gen)[0])
    if kind == "ask":
        src, yes = h.source_on_question(world.src, gen)
        return _send(replace(world, src=src), ("answer", gen, yes))
    assert kind == "answer"
    if world.peer.state != Incoming.ARRIVING or world.peer.gen != gen:
        return world
    return replace(world, peer=h.peer_on_restart(world.peer, answer)[0])


def _up(world: World, message: Message) -> bool:
    return world.peer_up if message[0] in _TO_PEER else world.src_up


def _source_restarts(world: World) -> World:
    src, action = h.source_on_restart(world.src)
    world = replace(world, src=src, src_up=True)
    if action == Action.ABORT:
        return _send(world, ("abort", src.gen, False))
    if action == Action.SEND_GO:
        return _send(world, ("go", src.gen, False))
    return world


def _peer_restarts(world: World) -> World:
    world = replace(world, peer_up=True)
    if world.peer.state == Incoming.ARRIVING:
        return _send(world, ("ask", world.peer.gen, False))
    return world


def _steps(world: World) -> Iterator[World]:
    """Every state one event leads to from ``world``."""
    for message in world.net:
        rest = replace(world, net=world.net - {message})
        yield rest  # lost
        if _up(world, message):
            yield _deliver(rest, message)
            yield _deliver(world, message)  # delivered, and delivered again later
    if world.src_up:
        started = h.source_start(world.src)
        if started is not None and world.attempts < 2:
            yield _send(
                replace(world, src=started, attempts=world.attempts + 1), ("arrive", started.gen, False)
            )
        if world.src.phase == Source.MOVING:  # the transfer failed or timed out: give up before the commit
            yield _send(replace(world, src=h.source_abort(world.src)), ("abort", world.src.gen, False))
        if world.src.phase == Source.COMMITTED:  # go, sent again until acknowledged
            yield _send(world, ("go", world.src.gen, False))
        yield replace(world, src_up=False)
    else:
        yield _source_restarts(world)
    if world.peer_up:
        if world.peer.state == Incoming.ARRIVING:  # asks again, while it waits
            yield _send(world, ("ask", world.peer.gen, False))
        yield replace(world, peer_up=False)
    else:
        yield _peer_restarts(world)


def _explore() -> set[World]:
    seen = {World()}
    todo = deque(seen)
    while todo:
        for following in _steps(todo.popleft()):
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


@pytest.fixture(scope="module")
def reached() -> set[World]:
    """Every state the protocol reaches (some 32,000: seconds, hence slow)."""
    return _explore()


def _settle(world: World) -> World:
    """Both sides up, every message delivered, the retries made: where the move ends."""
    if not world.src_up:
        world = _source_restarts(world)
    if not world.peer_up:
        world = _peer_restarts(world)
    for _ in range(100):
        if world.net:
            message = min(world.net)
            world = _deliver(replace(world, net=world.net - {message}), message)
        elif world.src.phase == Source.MOVING:
            world = _send(replace(world, src=h.source_abort(world.src)), ("abort", world.src.gen, False))
        elif world.src.phase == Source.COMMITTED:
            world = _send(world, ("go", world.src.gen, False))
        elif world.peer.state == Incoming.ARRIVING:
            world = _send(world, ("ask", world.peer.gen, False))
        else:
            return world
    raise AssertionError(f"never settles: {world}")


@pytest.mark.slow
def test_the_exploration_reaches_every_phase_of_both_sides(reached: set[World]) -> None:
    assert {w.src.phase for w in reached} == set(Source)
    assert {w.peer.state for w in reached} == set(Incoming)
    assert any(
        w.src.gen == 2 and w.peer.state == Incoming.OWNED for w in reached
    )  # a second attempt that moved
    assert len(reached) > 1000


@pytest.mark.slow
def test_the_job_never_may_run_on_both_machines(reached: set[World]) -> None:
    both = [w for w in reached if h.source_may_resume(w.src) and h.peer_may_run(w.peer)]
    assert not both, both[0]


@pytest.mark.slow
def test_the_peer_owns_only_what_the_source_committed_to_it(reached: set[World]) -> None:
    for world in reached:
        if world.peer.state == Incoming.OWNED:
            assert world.src.gen == world.peer.gen and world.src.phase in (Source.COMMITTED, Source.GONE), (
                world
            )


@pytest.mark.slow
def test_the_source_lets_its_image_go_only_once_the_peer_owns_the_job(reached: set[World]) -> None:
    for world in reached:
        if world.src.phase == Source.GONE:
            assert world.peer.state == Incoming.OWNED and world.peer.gen == world.src.gen, world


@pytest.mark.slow
def test_from_anywhere_the_move_settles_with_exactly_one_owner(reached: set[World]) -> None:
    for world in reached:
        end = _settle(world)
        here, there = h.source_may_resume(end.src), h.peer_may_run(end.peer)
        assert here != there, (world, end)
        assert end.peer.state != Incoming.ARRIVING, (world, end)  # nothing left half-way
        assert there == (end.src.phase == Source.GONE), (world, end)


def test_a_no_is_never_followed_by_a_commit() -> None:
    moving = SourceRecord(Source.MOVING, 3)
    aborted, yes = h.source_on_question(moving, 3)
    assert not yes and aborted == SourceRecord(Source.HERE, 3)
    assert h.source_commit(aborted) is None


def test_late_messages_of_an_earlier_attempt_change_nothing() -> None:
    owned = PeerRecord(Incoming.OWNED, 2)
    assert h.peer_on_go(owned, 1) == (owned, Action.NOTHING)
    assert h.peer_on_abort(owned, 1) == (owned, Action.NOTHING)
    assert h.peer_on_arrival(owned, 1) is None
    assert h.source_on_ack(SourceRecord(Source.COMMITTED, 2), 1) == SourceRecord(Source.COMMITTED, 2)


def test_a_job_that_came_back_is_here_again_and_its_next_move_is_of_a_later_generation() -> None:
    gone = SourceRecord(Source.GONE, 1)  # it left for the peer in generation 1...
    back = PeerRecord(Incoming.OWNED, 2)  # ...and came back in generation 2
    assert h.current(gone, back) == SourceRecord(Source.HERE, 2)
    assert h.held(gone, back) is None
    assert h.source_start(h.current(gone, back)) == SourceRecord(Source.MOVING, 3)
    # an older arrival, or one owned before the job left again, changes nothing
    assert h.current(SourceRecord(Source.GONE, 3), back) == SourceRecord(Source.GONE, 3)
    assert h.held(SourceRecord(Source.GONE, 3), back) == h.Held.MOVED


@pytest.mark.parametrize(
    ("outgoing", "incoming", "why"),
    [
        (SourceRecord(), PeerRecord(), None),
        (SourceRecord(Source.HERE, 1), PeerRecord(), None),  # a move aborted
        (SourceRecord(Source.MOVING, 1), PeerRecord(), h.Held.MOVING),
        (SourceRecord(Source.COMMITTED, 1), PeerRecord(), h.Held.MOVED),
        (SourceRecord(Source.GONE, 1), PeerRecord(), h.Held.MOVED),
        (SourceRecord(), PeerRecord(Incoming.ARRIVING, 1), h.Held.ARRIVING),
        (SourceRecord(Source.GONE, 1), PeerRecord(Incoming.ARRIVING, 2), h.Held.ARRIVING),  # coming back
        (SourceRecord(), PeerRecord(Incoming.OWNED, 1), None),
        (SourceRecord(), PeerRecord(Incoming.NONE, 1), None),  # dropped: the source kept it
    ],
)
def test_a_machine_may_run_a_job_only_when_neither_of_its_records_holds_it(
    outgoing: SourceRecord, incoming: PeerRecord, why: h.Held | None
) -> None:
    assert h.held(outgoing, incoming) == why
