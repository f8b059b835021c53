"""Moving a job to a peer through the peer's agent: :class:`PeerAgent` (the link
:func:`torpor.core.migrate.move` sends through), :func:`check` (may it move, asked before anything is
frozen) and :func:`relocate` (check, then move), for ``torpor migrate`` and the evacuation to peers.

Evacuation to peers (issue 30, part 5): ``torpor drain --to-peers``, and the spot and maintenance
notices of an agent started with ``--evacuate-to-peers``, move each job the evacuation would hibernate
to a peer that has room, and hibernate here only the jobs no peer takes. Which peer takes which job is
:func:`torpor.policy.placement.place`'s (:func:`destinations`), from what every peer answers ``GET
/v1/node`` (asked all at once, each within the peers' timeout) and each job's memory here, in the
evacuation's order (most valuable first). Each move is checked first, so that a job the peer cannot run
(a port taken there, a file missing, a connection) is refused before anything is frozen, and hibernated
here instead.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

from torpor.apps.agent.peering import ask, client_of
from torpor.core.context import Progress, quiet
from torpor.core.engine import Engine
from torpor.core.migrate import Moved, carry_on, job_facts, move, moving
from torpor.core.moves import Moves
from torpor.core.peers import Peers, this_machine
from torpor.core.recordtypes import JobName, Peer
from torpor.errors import EnvironmentProblem, TorporError, WrongState
from torpor.policy import migration, placement

log = logging.getLogger("torpor.agent")


class Acting(Protocol):
    """What :func:`evacuate_one` needs of the agent (:class:`torpor.apps.agent.service.Agent`)."""

    engine: Engine

    def acting(self, name: JobName, action: str) -> AbstractContextManager[None]: ...
    def event(self, job: str | None, action: str, reason: str, **detail: object) -> None: ...


#: how long one call of a move may wait for the peer (a batch of chunks over a slow link, a restore
#: there): a cut network fails the call after this long
TRANSFER_TIMEOUT_S = 120.0


class PeerAgent:
    """:class:`torpor.core.migrate.PeerLink` over the peer's API (its token, its certificate)."""

    def __init__(self, peer: Peer, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self.name = peer.name
        self.client = client_of(peer, timeout_s=timeout_s)
        self.source = socket.gethostname()

    def missing(self, job: str, chunks: list[str]) -> list[str]:
        return [
            str(c) for c in self.client.arrival("POST", job, "missing", json={"chunks": chunks})["missing"]
        ]

    def send_chunks(self, job: str, body: Sequence[bytes | memoryview]) -> None:
        headers = {**_BINARY, "Content-Length": str(sum(len(piece) for piece in body))}
        pieces = cast("list[bytes]", list(body))  # each written to the socket as it is: any buffer will do
        self.client.arrival("POST", job, "chunks", content=pieces, headers=headers)

    def send_log(self, job: str, offset: int, data: bytes) -> None:
        self.client.arrival("PUT", job, "log", content=data, headers=_BINARY, params={"offset": offset})

    def look(self, paths: list[str]) -> dict[str, migration.Stamp | None]:
        return _stamps(self.client.look(paths, []))

    def send_file(self, job: str, index: int, offset: int, data: bytes) -> None:
        params = {"index": index, "offset": offset}
        self.client.arrival("PUT", job, "file", content=data, headers=_BINARY, params=params)

    def arrive(self, job: str, gen: int, spec: dict[str, Any]) -> None:
        self.client.arrival("POST", job, json={"gen": gen, "source": self.source, "spec": spec})

    def go(self, job: str, gen: int, resume: bool, lazy: bool) -> dict[str, Any]:
        return dict(self.client.arrival("POST", job, "go", json={"gen": gen, "resume": resume, "lazy": lazy}))

    def abort(self, job: str, gen: int) -> None:
        self.client.arrival("POST", job, "abort", json={"gen": gen})

    def close(self) -> None:
        self.client.close()


_BINARY = {"Content-Type": "application/octet-stream"}


def _written_there(looked: dict[str, Any]) -> migration.WrittenThere:
    """A file the job writes as a peer's ``look`` answer describes it."""
    folder_stat = looked.get("folder_stat") or [0, 0, 0]
    return migration.WrittenThere(
        folder=bool(looked.get("folder")),
        owner=None if looked.get("owner") is None else int(looked["owner"]),
        plain=bool(looked.get("plain", False)),
        folder_stat=(int(folder_stat[0]), int(folder_stat[1]), int(folder_stat[2])),
    )


def _stamps(looked: dict[str, Any]) -> dict[str, migration.Stamp | None]:
    """The stamps of a peer's ``look`` answer."""
    return {path: (int(s[0]), int(s[1])) if s else None for path, s in (looked.get("stamps") or {}).items()}


def check(
    engine: Engine, name: str, peer: Peer, drop_connections: bool = False
) -> tuple[migration.Job, list[str]]:
    """The running job ``name`` as a move sees it, and why it may not move to ``peer`` (each a line;
    none: it may), asked of the peer's agent before anything is frozen."""
    job = job_facts(engine, name)
    seen = ask(peer)
    peer_facts = migration.Peer(peer.name, seen.problem, seen.node)
    if seen.problem is None:
        client = client_of(peer)
        try:
            there = client.look(sorted(job.read_files), list(job.listens), sorted(job.written_files))
        except TorporError as exc:
            problem = exc.message.removeprefix("the agent did not answer: ").splitlines()[0]
            peer_facts = migration.Peer(peer.name, problem)
        else:
            taken = [int(port) for port in there.get("ports_taken") or []]
            written = {
                path: migration.WrittenThere(
                    bool(w.get("folder")), None if w.get("owner") is None else int(w["owner"])
                )
                for path, w in (there.get("written") or {}).items()
            }
            peer_facts = migration.Peer(peer.name, None, seen.node, _stamps(there), taken, written)
        finally:
            client.close()
    return job, migration.refusals(job, peer_facts, this_machine(engine.settings), drop_connections)


def relocate(
    engine: Engine,
    name: str,
    peer: Peer,
    drop_connections: bool = False,
    lazy: bool = False,
    progress: Progress = quiet,
) -> Moved:
    """Move ``name`` to ``peer`` (``torpor migrate``, an evacuation to peers): a move of it that was cut
    off is finished or undone first; then it is checked (EnvironmentProblem naming each refusal) and
    handed over (:func:`torpor.core.migrate.move`)."""
    with moving(engine, name):
        link = PeerAgent(peer)
        try:
            finished = carry_on(engine, name, link, lazy=lazy)
            if finished is not None:
                return finished
            job, refusals = check(engine, name, peer, drop_connections)
            if refusals:
                raise EnvironmentProblem(
                    f"job '{job.name}' cannot move to peer {peer.name}", details=refusals
                )
            return move(engine, name, link, lazy=lazy, progress=progress)
        finally:
            link.close()


def destinations(engine: Engine, names: list[str]) -> placement.Placement:
    """Where each of ``names`` (in the evacuation's order) goes: the peer that takes it, or why none."""
    known = Peers(engine.records).all()
    with ThreadPoolExecutor(max(1, min(16, len(known))), "torpor-peers") as pool:
        seen = list(pool.map(ask, known))
    peers = [
        placement.Peer(
            each.peer.name,
            free=int((each.node.get("memory") or {}).get("free") or 0),
            reachable=each.problem is None,
            draining=bool(each.node.get("draining")),
        )
        for each in seen
    ]
    return placement.place([placement.Job(name, _memory(engine, name)) for name in names], peers)


def _memory(engine: Engine, name: str) -> int:
    """What ``name`` would need on a peer: its tree's PSS, as ``torpor migrate`` checks it."""
    try:
        return engine.status(name).rss_bytes or 0
    except TorporError:
        return 0


def evacuate_one(
    agent: Acting, name: JobName, by: str, peer: str, stayed: dict[str, str]
) -> dict[str, Any] | None:
    """An evacuation's move of the running job ``name`` to ``peer``: what the report says of it, or None
    if it stays (why, in ``stayed``): the evacuation hibernates it here instead. A move that failed after
    its commit raises: the job is the peer's, hibernated here, and the next ``torpor migrate`` (or this
    agent, :class:`CutOffMoves`) hands it over. The job is the agent's busy one meanwhile: no periodic
    checkpoint or idle hibernation of it starts."""
    with agent.acting(name, "move"):
        try:
            moved = relocate(agent.engine, name, Peers(agent.engine.records).get(peer))
        except TorporError as exc:
            said = "; ".join([exc.message, *exc.details])
            if Moves(agent.engine.records).held(name) is not None:  # committed: the peer's now
                raise EnvironmentProblem(said) from exc
            stayed[name] = said
            agent.event(name, "stay", f"evacuation ({by}): not moved to {peer}: {exc.message}")
            return None
    sent = sum(r["bytes"] for r in moved.rounds)
    agent.event(
        name, "moved", f"evacuation ({by}): to peer {peer}", stopped_s=moved.stopped_s, sent_bytes=sent
    )
    return {"moved_to": peer, "stopped_s": moved.stopped_s, "sent_bytes": sent, "at": time.time()}


class CutOffMoves:
    """The source agent's part in a move whose ``torpor migrate`` (or evacuation) was cut off, killed or
    left with a peer that did not answer: every :data:`EVERY_S`, in a thread of its own (a peer may take
    its timeout to answer), each such move whose lock no live process holds is finished, as the next
    ``torpor migrate`` of it would (:func:`torpor.core.migrate.carry_on`): one not committed is aborted,
    the peer told to drop what it got and the job resumed here; a committed one's *go* is sent again
    until the peer answers. A round hook of the agent (:attr:`Agent.round_hooks`)."""

    EVERY_S = 10.0

    def __init__(self, engine: Engine, event: Callable[..., None]) -> None:
        self.engine, self.event = engine, event
        self._running = threading.Lock()
        self._last = -self.EVERY_S

    def __call__(self, jobs: object, cares: object) -> None:
        now = time.monotonic()
        if now - self._last < self.EVERY_S or self._running.locked():
            return
        self._last = now
        pending = Moves(self.engine.records).unfinished()
        if pending:
            threading.Thread(target=self._take_up, args=(pending,), name="torpor-moves", daemon=True).start()

    def _take_up(self, pending: list[tuple[str, str]]) -> None:
        with self._running:
            for job, peer in pending:
                try:
                    with moving(self.engine, job):
                        link = PeerAgent(Peers(self.engine.records).get(peer))
                        try:
                            done = carry_on(self.engine, job, link)
                        finally:
                            link.close()
                except WrongState:
                    continue  # a 'torpor migrate' of it runs now: it is that one's to finish
                except TorporError as exc:
                    log.info("%s: the cut-off move to %s is not finished yet: %s", job, peer, exc.message)
                    continue
                if done is not None:
                    self.event(job, "moved", f"a cut-off move finished: handed over to peer {peer}")
                else:
                    self.event(
                        job, "stay", f"a cut-off move to peer {peer} undone: the job is this machine's"
                    )
