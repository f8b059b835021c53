"""``torpor migrate NAME --to PEER``: a running job moved to a peer (issue 30; docs/peers.md).

First whether it may move, asked before anything is frozen: the job's facts come from /proc here
(:func:`torpor.core.migrate.job_facts`), the peer's from its agent (``GET /v1/node``, ``POST
/v1/arrivals/look``), the verdict from :func:`torpor.policy.migration.refusals`; ``--check`` stops
there. Then :func:`torpor.core.migrate.move` hands it over, through :class:`PeerAgent`.
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from typing import Any

from torpor.apps import peers as peers_app
from torpor.apps.render import emit_json, human_bytes, progress
from torpor.core.engine import Engine
from torpor.core.migrate import Moved, carry_on, job_facts, move, moving
from torpor.core.peers import Peers, this_machine
from torpor.core.recordtypes import Peer
from torpor.errors import EnvironmentProblem, TorporError
from torpor.policy import migration

#: how long one call of a move may wait for the peer (a batch of chunks over a slow link, a restore
#: there): a cut network fails the call after this long
TRANSFER_TIMEOUT_S = 120.0


class PeerAgent:
    """:class:`torpor.core.migrate.PeerLink` over the peer's API (its token, its certificate)."""

    def __init__(self, peer: Peer, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self.name = peer.name
        self.client = peers_app.client_of(peer, timeout_s=timeout_s)
        self.source = socket.gethostname()

    def missing(self, job: str, chunks: list[str]) -> list[str]:
        return [
            str(c) for c in self.client.arrival("POST", job, "missing", json={"chunks": chunks})["missing"]
        ]

    def send_chunks(self, job: str, body: bytes) -> None:
        self.client.arrival("POST", job, "chunks", content=body, headers=_BINARY)

    def send_log(self, job: str, offset: int, data: bytes) -> None:
        self.client.arrival("PUT", job, "log", content=data, headers=_BINARY, params={"offset": offset})

    def arrive(self, job: str, gen: int, spec: dict[str, Any]) -> None:
        self.client.arrival("POST", job, json={"gen": gen, "source": self.source, "spec": spec})

    def go(self, job: str, gen: int, resume: bool, lazy: bool) -> dict[str, Any]:
        return dict(self.client.arrival("POST", job, "go", json={"gen": gen, "resume": resume, "lazy": lazy}))

    def abort(self, job: str, gen: int) -> None:
        self.client.arrival("POST", job, "abort", json={"gen": gen})

    def close(self) -> None:
        self.client.close()


_BINARY = {"Content-Type": "application/octet-stream"}


def cmd_migrate(engine: Engine, args: argparse.Namespace) -> int:
    peer = Peers(engine.records).get(args.to)
    if not args.check:
        with moving(engine, args.name):
            link = PeerAgent(peer)
            try:
                finished = carry_on(engine, args.name, link, lazy=args.lazy)
            finally:
                link.close()
        if finished is not None:
            return _said(finished, args)
    job = job_facts(engine, args.name)
    seen = peers_app.ask(peer)
    peer_facts = migration.Peer(peer.name, seen.problem, seen.node)
    if seen.problem is None:
        client = peers_app.client_of(peer)
        try:
            there = client.look(sorted(job.read_files), list(job.listens))
        except TorporError as exc:
            problem = exc.message.removeprefix("the agent did not answer: ").splitlines()[0]
            peer_facts = migration.Peer(peer.name, problem)
        else:
            stamps: dict[str, migration.Stamp | None] = {
                path: (int(s[0]), int(s[1])) if s else None for path, s in (there.get("stamps") or {}).items()
            }
            taken = [int(port) for port in there.get("ports_taken") or []]
            peer_facts = migration.Peer(peer.name, None, seen.node, stamps, taken)
        finally:
            client.close()
    refusals = migration.refusals(job, peer_facts, this_machine(engine.settings), args.drop_connections)
    if not args.check:
        if refusals:
            raise EnvironmentProblem(f"job '{job.name}' cannot move to peer {peer.name}", details=refusals)
        return _move(engine, args, peer)
    if args.json:
        emit_json(_report(job, peer.name, refusals))
        return EnvironmentProblem.exit_code if refusals else 0
    if refusals:
        raise EnvironmentProblem(f"job '{job.name}' cannot move to peer {peer.name}", details=refusals)
    print(
        f"job '{job.name}' could move to peer {peer.name}: {human_bytes(job.memory)} fit there, its "
        f"{len(job.read_files)} program and read-only files are the same there"
        + (f", its ports {', '.join(map(str, job.listens))} are free" if job.listens else "")
        + (f"; {len(job.connections)} connection(s) would be reset" if job.connections else "")
    )
    return 0


def _move(engine: Engine, args: argparse.Namespace, peer: Peer) -> int:
    link = PeerAgent(peer)
    try:
        with moving(engine, args.name):
            done = move(engine, args.name, link, lazy=args.lazy, progress=progress(args))
    finally:
        link.close()
    return _said(done, args)


def _said(done: Moved, args: argparse.Namespace) -> int:
    sent = sum(r["bytes"] for r in done.rounds)
    if args.json:
        emit_json(dataclasses.asdict(done) | {"sent_bytes": sent})
    else:
        print(
            f"moved job '{done.job}' to peer {done.peer}: {human_bytes(sent)} sent in {len(done.rounds)} "
            f"round(s), stopped {done.stopped_s:.2f} s"
            + ("" if done.answer.get("restored") else "; it is hibernated there")
        )
    return 0


def _report(job: migration.Job, peer: str, refusals: list[str]) -> dict[str, Any]:
    return {
        "job": job.name,
        "peer": peer,
        "may_move": not refusals,
        "refusals": refusals,
        "memory": job.memory,
        "read_files": len(job.read_files),
        "listens": list(job.listens),
        "connections": list(job.connections),
        "gpu": job.gpu,
    }


def add_parser(sub: Any) -> None:
    """``torpor migrate``."""
    text = (
        "move a running job to a peer, where it resumes under its name with its checkpoints, policy and "
        "log; first checked (room, architecture and CRIU, its files, its ports, its connections), and "
        "with --check only that"
    )
    parser = sub.add_parser("migrate", help=text, description=text + " (docs/peers.md).")
    parser.add_argument("name", metavar="NAME", help="the job")
    parser.add_argument("--to", required=True, metavar="PEER", help="the peer ('torpor peers' lists them)")
    parser.add_argument(
        "--check", action="store_true", help="only say whether the job could move, and why not (exit 3)"
    )
    parser.add_argument(
        "--drop-connections",
        action="store_true",
        help="let the job's established TCP connections be reset: they cannot follow it to another address",
    )
    parser.add_argument(
        "--lazy",
        action="store_true",
        help="the peer resumes it before all of its memory is in (as resume --lazy)",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=cmd_migrate)
