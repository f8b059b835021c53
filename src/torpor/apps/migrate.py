"""``torpor migrate NAME --to PEER``: a running job moved to a peer (issue 30; docs/peers.md).

First whether it may move, asked before anything is frozen: the job's facts come from /proc here
(:func:`torpor.core.migrate.job_facts`), the peer's from its agent (``GET /v1/node``, ``POST
/v1/arrivals/look``), the verdict from :func:`torpor.policy.migration.refusals`; ``--check`` stops
there (:func:`torpor.apps.agent.abroad.check`). Then :func:`torpor.core.migrate.move` hands it over,
through :class:`torpor.apps.agent.abroad.PeerAgent`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from torpor.apps.agent import abroad
from torpor.apps.render import emit_json, human_bytes, progress
from torpor.core.engine import Engine
from torpor.core.migrate import Moved
from torpor.core.peers import Peers
from torpor.errors import EnvironmentProblem
from torpor.policy import migration


def cmd_migrate(engine: Engine, args: argparse.Namespace) -> int:
    peer = Peers(engine.records).get(args.to)
    if not args.check:
        return _said(
            abroad.relocate(engine, args.name, peer, args.drop_connections, args.lazy, progress(args)), args
        )
    job, refusals = abroad.check(engine, args.name, peer, args.drop_connections)
    if args.json:
        emit_json(_report(job, peer.name, refusals))
        return EnvironmentProblem.exit_code if refusals else 0
    if refusals:
        raise EnvironmentProblem(f"job '{job.name}' cannot move to peer {peer.name}", details=refusals)
    print(
        f"job '{job.name}' could move to peer {peer.name}: {human_bytes(job.memory)} fit there, its "
        f"{len(job.read_files)} program and read-only files are the same there"
        + (f", its ports {', '.join(map(str, job.listens))} are free" if job.listens else "")
        + (f"; the {len(job.written_files)} file(s) it writes go with it" if job.written_files else "")
        + (f"; {len(job.connections)} connection(s) would be reset" if job.connections else "")
    )
    return 0


def _said(done: Moved, args: argparse.Namespace) -> int:
    sent = sum(r["bytes"] for r in done.rounds)
    if args.json:
        emit_json(dataclasses.asdict(done) | {"sent_bytes": sent})
    else:
        print(
            f"moved job '{done.job}' to peer {done.peer}: {human_bytes(sent)} sent in {len(done.rounds)} "
            f"round(s), stopped {done.stopped_s:.2f} s"
            + (f", {len(done.files)} file(s) it writes carried" if done.files else "")
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
        "written_files": sorted(job.written_files),
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
