"""``torpor migrate NAME --to PEER --check``: whether a running job could move to a peer, asked before
anything is frozen (issue 30, part 4; docs/peers.md). The job's facts come from /proc here
(:func:`torpor.core.migrate.job_facts`), the peer's from its agent (``GET /v1/node``, ``POST
/v1/arrivals/look``), the verdict from :func:`torpor.policy.migration.refusals`. Moving the job is not
built yet: without ``--check`` the command says so and changes nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

from torpor.apps import peers as peers_app
from torpor.apps.render import emit_json, human_bytes
from torpor.core.engine import Engine
from torpor.core.migrate import job_facts
from torpor.core.peers import Peers, this_machine
from torpor.errors import EnvironmentProblem, TorporError, UsageError
from torpor.policy import migration

NOT_BUILT = (
    "moving a job to another machine is not built yet (issue 30); 'torpor migrate NAME --to PEER --check' "
    "says whether it could move, and why not"
)


def cmd_migrate(engine: Engine, args: argparse.Namespace) -> int:
    if not args.check:
        raise UsageError(NOT_BUILT)
    peer = Peers(engine.records).get(args.to)
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
        "check whether a running job could move to a peer (--check): room, architecture and CRIU, its "
        "files, its ports, its connections; moving it is not built yet"
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
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=cmd_migrate)
