"""Whether a job may move to a peer, decided before it is frozen (issue 30, part 4; ``torpor migrate``
asks it, :mod:`torpor.core.migrate` gathers what it needs).

A move is refused, each reason in a line naming what is wrong, when the job could not run there as it
runs here: the peer cannot be reached or drains; it has not the job's memory free of its budget (its own
accounting, ``free`` of ``GET /v1/node``); its architecture or CRIU differ (:func:`torpor.policy.peers.
differences`); a file the job reads is not there, or not the same (size and modification time); a port
the job listens on is taken there; the job has established TCP connections, which cannot follow it to
another address (unless the user lets them be reset: ``--drop-connections``); the job uses a GPU (not
supported until the GPU stage lands); a file the job writes could not be put in its place there (its
folder is missing, or another user owns the file there).

The files the job writes are carried (:func:`to_carry`): each one the peer does not have the same (size
and modification time) — a shared file system, or a copy made before — is sent once the job is stopped.

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
    #: the regular files it has open for writing, or mapped shared and writable -> their owner and
    #: group here
    written_files: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class WrittenThere:
    """A file the job writes, as the peer has it: whether its folder is there, reached without a
    symbolic link, and that folder's owner, group and mode; who owns the file there (None: there is
    no file at that path)."""

    folder: bool
    owner: int | None = None
    plain: bool = True
    folder_stat: tuple[int, int, int] = (0, 0, 0o755)


def may_create(uid: int, gid: int, folder_stat: tuple[int, int, int]) -> bool:
    """Whether user ``uid`` (group ``gid``) may make a file in a folder of (owner, group, mode), by its
    mode bits (not its ACL, nor the user's other groups): a carried file is put only where its owner
    could have put it."""
    owner, group, mode = folder_stat
    if uid == 0:
        return True
    if uid == owner:
        return bool(mode & 0o300 == 0o300)
    if gid == group:
        return bool(mode & 0o030 == 0o030)
    return bool(mode & 0o003 == 0o003)


@dataclass(frozen=True)
class Peer:
    """What is known of the peer: why it cannot be asked (None: it answered), its ``GET /v1/node``, the
    stamps there of the job's read files (None: not there), and which of the job's ports are taken."""

    name: str
    problem: str | None
    node: Mapping[str, Any] = field(default_factory=dict)
    stamps: Mapping[str, Stamp | None] = field(default_factory=dict)
    ports_taken: Sequence[int] = ()
    written: Mapping[str, WrittenThere] = field(default_factory=dict)


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
    found += _written_refusals(job, peer)
    if job.connections and not drop_connections:
        found.append(
            f"established TCP connections cannot follow the job to another address: "
            f"{_some(sorted(job.connections))} (--drop-connections resets them)"
        )
    return found


#: why a file the job writes could not be put in its place on a machine (:func:`written_problems`)
NO_FOLDER, LINKED, FOREIGN, SHUT = "no folder", "linked", "foreign", "shut"


def written_problems(owner: tuple[int, int], there: WrittenThere) -> list[str]:
    """Why a file the job writes, of ``owner`` (user, group), could not be put in its place on a machine
    where it is ``there``: its folder is not there (:data:`NO_FOLDER`), its path goes through a
    symbolic link (:data:`LINKED`), another user's file is at that path (:data:`FOREIGN`: it would be
    replaced), or the folder is not its owner's to write in (:data:`SHUT`). Empty: it may be put there.
    Asked before the freeze of the peer's answer, and by the peer itself when it puts the file."""
    found = []
    if not there.folder:
        found.append(NO_FOLDER)
    elif not there.plain:
        found.append(LINKED)
    if there.owner is not None and there.owner != owner[0]:
        found.append(FOREIGN)
    if there.folder and there.plain and not may_create(*owner, there.folder_stat):
        found.append(SHUT)
    return found


def _written_refusals(job: Job, peer: Peer) -> list[str]:
    """The refusals of :func:`written_problems` for each file the job writes, a line for each kind."""
    problems = {
        path: written_problems(owner, peer.written.get(path, WrittenThere(folder=False)))
        for path, owner in job.written_files.items()
    }
    said = {
        NO_FOLDER: f"the folder of a file the job writes is not on peer {peer.name}",
        LINKED: f"a file the job writes is reached through a symbolic link on peer {peer.name}",
        FOREIGN: f"a file the job writes is another user's on peer {peer.name} (it would be replaced)",
        SHUT: f"the folder of a file the job writes is not its owner's to write in on peer {peer.name}",
    }
    found = []
    for kind, text in said.items():
        paths = sorted(path for path, kinds in problems.items() if kind in kinds)
        if paths:
            found.append(f"{text}: {_some(paths)}")
    return found


def to_carry(here: Mapping[str, Stamp], there: Mapping[str, Stamp | None]) -> list[str]:
    """Which of the files the stopped job writes (``here``: their stamps on this machine) are sent to the
    peer (``there``: its stamps of them, None: none there): each one not the same there, by size and
    modification time. A file the peer has the same is the same file (a shared file system) or a copy,
    as for the files the job reads."""
    return sorted(path for path, stamp in here.items() if there.get(path) != stamp)


def _some(items: Sequence[str]) -> str:
    named = ", ".join(items[:_NAMED])
    return named + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")
