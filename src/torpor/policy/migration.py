"""Whether a job may move to a peer, decided before it is frozen (issue 30, part 4; ``torpor migrate``
asks it, :mod:`torpor.core.migrate` gathers what it needs).

A move is refused, each reason in a line naming what is wrong, when the job could not run there as it
runs here: the peer cannot be reached or drains; it has not the job's memory free of its budget (its own
accounting, ``free`` of ``GET /v1/node``); its architecture or CRIU differ (:func:`torpor.policy.peers.
differences`); a file the job reads is not there, or not the same (size and modification time); a port
the job listens on is taken there; the job has established TCP connections, which cannot follow it to
another address (unless the user lets them be reset: ``--drop-connections``); the job uses a GPU (not
supported until the GPU stage lands).

Pure: what is known of the job and of both machines in, the reasons out (none: it may move).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torpor.policy.peers import differences
from torpor.policy.scheduler.sizes import format_size

#: a file's stamp: its size and modification time (ns)
Stamp = tuple[int, int]

#: at most this many files or connections are named in a reason; the rest are counted
_NAMED = 3


@dataclass(frozen=True)
class Job:
    """What the move needs to know of the job: its memory (bytes, its charge here), the files it only
    reads and their stamps here, the TCP ports it listens on, its established TCP connections
    (``"127.0.0.1:5432 -> 10.0.0.7:40112"``), whether it uses a GPU."""

    name: str
    memory: int
    read_files: Mapping[str, Stamp] = field(default_factory=dict)
    listens: Sequence[int] = ()
    connections: Sequence[str] = ()
    gpu: bool = False


@dataclass(frozen=True)
class Peer:
    """What is known of the peer: why it cannot be asked (None: it answered), its ``GET /v1/node``, the
    stamps there of the job's read files (None: not there), and which of the job's ports are taken."""

    name: str
    problem: str | None
    node: Mapping[str, Any] = field(default_factory=dict)
    stamps: Mapping[str, Stamp | None] = field(default_factory=dict)
    ports_taken: Sequence[int] = ()


def refusals(job: Job, peer: Peer, here: Mapping[str, Any], drop_connections: bool = False) -> list[str]:
    """Why ``job`` may not move to ``peer`` from the machine ``here`` (``arch``, ``criu``), each a line;
    empty: it may."""
    if peer.problem is not None:
        return [f"peer {peer.name} cannot be asked: {peer.problem}"]
    found = []
    if job.gpu:
        found.append("the job uses a GPU: moving a GPU job to another machine is not supported yet")
    if peer.node.get("draining"):
        found.append(f"peer {peer.name} is draining")
    free = (peer.node.get("memory") or {}).get("free")
    if isinstance(free, int) and free < job.memory:
        found.append(
            f"peer {peer.name} has {format_size(free)} free of its budget, the job needs {format_size(job.memory)}"
        )
    found += [f"the machines differ: {each}" for each in differences(here, peer.node)]
    there = {path: peer.stamps.get(path) for path in job.read_files}
    missing = sorted(path for path, stamp in there.items() if stamp is None)
    if missing:
        found.append(f"not on peer {peer.name}: {_some(missing)}")
    changed = sorted(path for path, stamp in there.items() if stamp not in (None, job.read_files[path]))
    if changed:
        found.append(f"not the same on peer {peer.name} (size or modification time): {_some(changed)}")
    taken = sorted(set(job.listens) & set(peer.ports_taken))
    if taken:
        found.append(
            f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} taken on peer {peer.name}"
        )
    if job.connections and not drop_connections:
        found.append(
            f"established TCP connections cannot follow the job to another address: "
            f"{_some(sorted(job.connections))} (--drop-connections resets them)"
        )
    return found


def _some(items: Sequence[str]) -> str:
    named = ", ".join(items[:_NAMED])
    return named + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")
