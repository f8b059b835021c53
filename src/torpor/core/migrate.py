"""What a move of a job to a peer needs to know before the job is frozen (issue 30, part 4), on both
sides: :func:`job_facts` on the source, from /proc of the running tree, and :func:`look` on the peer,
which the source asks through ``POST /v1/arrivals/look``; :func:`torpor.policy.migration.refusals`
decides from both. Then :func:`move` hands the job over (the peer's side is
:mod:`torpor.core.arrivals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import stat
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torpor.adapters.gpu import NVIDIA_DEVICE_PREFIX
from torpor.adapters.system import private, procfs, sockets
from torpor.core.context import Progress, quiet
from torpor.core.engine import Engine
from torpor.core.moves import Moves
from torpor.core.naming import check_name
from torpor.core.recordtypes import Checkpoint, JobName, JobState
from torpor.core.rewind import STOPPED_FILE
from torpor.core.store import TieredStore, transfer
from torpor.core.store.repository import Repository
from torpor.errors import EnvironmentProblem, TorporError, WrongState
from torpor.policy import migration
from torpor.policy.handoff import Source
from torpor.policy.migration import Job, Stamp
from torpor.policy.scheduler.sizes import format_size

#: what a peer is asked about at most (a job with more open files is unusual; the rest are not compared)
MAX_LOOKED_AT = 10_000


def job_facts(engine: Engine, name: str) -> Job:
    """What :func:`~torpor.policy.migration.refusals` needs of the running job ``name``: its memory (the
    tree's PSS), the files it maps or reads (its program, libraries, data it reads on) with their size
    and modification time here, the TCP ports it listens on, its established TCP connections, whether
    it uses a GPU. WrongState if it is not running."""
    status = engine.status(name)
    job = status.job
    if job.state != JobState.RUNNING or not job.pid:
        raise WrongState(f"job '{job.name}' is {job.state}: only a running job can be checked for a move")
    pids = procfs.namespace_members(job.pid)
    log = os.path.realpath(job.log_path)
    read = {path: stamp for path, stamp in stamps(procfs.program_files(pids)).items() if path != log}
    return Job(
        name=job.name,
        memory=status.rss_bytes or 0,
        read_files={path: stamp for path, stamp in read.items() if stamp is not None},
        listens=sorted({address.port for address in sockets.listening_sockets(pids)}),
        connections=sockets.established_connections(pids),
        gpu=procfs.uses_device(pids, NVIDIA_DEVICE_PREFIX),
        written_files={path: (info.st_uid, info.st_gid) for path, info in written_by(pids, log).items()},
    )


def written_by(pids: list[int], log: str) -> dict[str, os.stat_result]:
    """The regular files ``pids`` write (open for writing, or mapped shared and writable) with their
    ``stat``, but the job's log (which a move sends by itself)."""
    found = {}
    for path in procfs.written_files(pids):
        with contextlib.suppress(OSError):  # gone meanwhile
            info = os.stat(path)
            if path != log and stat.S_ISREG(info.st_mode):
                found[path] = info
    return found


def stamps(paths: Iterable[str]) -> dict[str, Stamp | None]:
    """Each regular file of ``paths`` with its (size, modification time in ns) here; None: not here, or
    not a regular file."""
    found: dict[str, Stamp | None] = {}
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            found[path] = None
            continue
        found[path] = (info.st_size, info.st_mtime_ns) if os.path.isfile(path) else None
    return found


def look(paths: Sequence[str], ports: Sequence[int], written: Sequence[str] = ()) -> dict[str, Any]:
    """What the peer answers ``POST /v1/arrivals/look``: the stamps of ``paths`` here (None: missing),
    which of ``ports`` a process of this network namespace listens on, and for each of ``written`` (the
    files the job writes) whether its folder is here and who owns a file at that path here."""
    if max(len(paths), len(ports), len(written)) > MAX_LOOKED_AT:
        raise ValueError(f"at most {MAX_LOOKED_AT} files and ports are looked at")
    taken = sorted({port for port in ports if sockets.port_listeners(port)})
    return {
        "stamps": {path: list(stamp) if stamp else None for path, stamp in stamps(paths).items()},
        "ports_taken": taken,
        "written": {path: dataclasses.asdict(written_there(path)) for path in written},
    }


def written_there(path: str) -> migration.WrittenThere:
    """A file the job writes, as it is on this machine (what :func:`~torpor.policy.migration.
    written_problems` judges)."""
    try:
        owner: int | None = os.lstat(path).st_uid
    except OSError:
        owner = None
    try:
        info = os.stat(os.path.dirname(path))
    except OSError:
        return migration.WrittenThere(folder=False, owner=owner)
    return migration.WrittenThere(
        folder=stat.S_ISDIR(info.st_mode),
        owner=owner,
        plain=os.path.realpath(path) == path,
        folder_stat=(info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)),
    )


# -- the move ---------------------------------------------------------------------------------------------


class PeerLink(Protocol):
    """The peer's agent, as the source calls it (``/v1/arrivals``): each call raises a TorporError when
    the peer refuses or cannot be reached."""

    name: str

    def missing(self, job: str, chunks: list[str]) -> list[str]: ...
    def send_chunks(self, job: str, body: Sequence[bytes | memoryview]) -> None: ...
    def send_log(self, job: str, offset: int, data: bytes) -> None: ...
    def look(self, paths: list[str]) -> dict[str, Stamp | None]: ...
    def send_file(self, job: str, index: int, offset: int, data: bytes) -> None: ...
    def arrive(self, job: str, gen: int, spec: dict[str, Any]) -> None: ...
    def go(self, job: str, gen: int, resume: bool, lazy: bool) -> dict[str, Any]: ...
    def abort(self, job: str, gen: int) -> None: ...


#: at most this many bytes of chunks in one request
BATCH_BYTES = 32 << 20
#: at most this many requests of chunks at once
IN_FLIGHT = 2
#: at most this many chunks read back and verified at once for sending (:func:`transfer.frames`)
READERS = 2


@dataclass
class Moved:
    """What a move did: the generation, the chunks and bytes sent in each round, how long the job was
    stopped here (from its hibernation to the peer's answer to *go*), the peer's answer, and the files
    the job writes that were carried."""

    job: str
    peer: str
    gen: int = 0
    rounds: list[dict[str, int]] = field(default_factory=list)
    stopped_s: float = 0.0
    answer: dict[str, Any] = field(default_factory=dict)
    #: the files the job writes that were sent (the peer had not the same)
    files: list[str] = field(default_factory=list)


@contextlib.contextmanager
def moving(engine: Engine, name: str) -> Iterator[None]:
    """Held while this process moves ``name``: one move of a job at a time, and a record left by a
    move whose process is gone (killed) is known for one by holding this."""
    folder = engine.settings.run_dir
    private.make_private_dirs(folder)
    fd = private.open_private(folder / f"move-{check_name(name)}.lock", os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WrongState(f"job '{name}' is being moved by another 'torpor migrate'") from None
        yield
    finally:
        os.close(fd)


def carry_on(engine: Engine, name: str, link: PeerLink, lazy: bool = False) -> Moved | None:
    """What a move of ``name`` that was cut off (its process killed, the peer unreachable) left: hand
    over a committed one (None if there was none to finish); abort one that was not committed, so that
    the job resumes here and may be moved afresh. Call it holding :func:`moving`."""
    moves = Moves(engine.records)
    record, peer = moves.outgoing(name)
    if record.phase == Source.MOVING:
        _abort(engine, moves, _Named(link, peer), name, record.gen, None)
        return None
    if record.phase != Source.COMMITTED:
        return None
    if peer != link.name:
        raise WrongState(
            f"job '{name}' was handed to peer {peer}: 'torpor migrate {name} --to {peer}' finishes that"
        )
    done = Moved(name, peer, record.gen)
    done.answer = link.go(name, record.gen, resume=True, lazy=lazy)
    finish(engine, name, record.gen, peer)
    return done


@dataclass
class _Named:
    """``link``, or nothing if the record names another peer (an abort it cannot be told of)."""

    link: PeerLink
    peer: str

    def abort(self, job: str, gen: int) -> None:
        if self.peer == self.link.name:
            self.link.abort(job, gen)


def move(engine: Engine, name: str, link: PeerLink, lazy: bool = False, progress: Progress = quiet) -> Moved:
    """Move the running job ``name`` to ``link``'s machine (the hand-off of :mod:`torpor.policy.handoff`).

    A checkpoint taken while the job runs on goes first; then the job is hibernated here (its image
    durable), recorded MOVING, and its final checkpoint sends only the chunks that changed; its log and
    records follow, then the commit, then *go*. Before the commit any failure aborts: the peer is told
    to drop what it got, and the job is resumed here. After it the job is the peer's: a *go* that gets
    no answer leaves it hibernated here, image kept, and raises saying so.
    """
    moves = Moves(engine.records)
    job = engine.records.job(name)
    done = Moved(job.name, link.name)
    store = _store(engine)
    repo = store.repo
    learnt: set[str] = set()  # the chunks the peer was seen to have, or was sent
    progress("copying its memory while it runs")
    first = engine.checkpoint(job.name, progress=progress)
    engine.wait_durable(first.id)
    progress(f"sending it to peer {link.name}")
    done.rounds.append(_send(store, link, job.name, first.id, learnt))
    written = (
        sorted(written_by(procfs.namespace_members(job.pid), os.path.realpath(job.log_path)))
        if job.pid
        else []
    )
    done.gen = moves.start(job.name, link.name)
    stopped = time.monotonic()
    try:
        progress("hibernating it")
        final = engine.checkpoint(job.name, hibernate=True, progress=progress)
        engine.wait_durable(final.id)
        progress("sending what changed since")
        checkpoints = [c for c in engine.records.checkpoints(job.name) if c.id in set(repo.ids())]
        for each in checkpoints:
            done.rounds.append(_send(store, link, job.name, each.id, learnt))
        _send_log(link, job.name, Path(job.log_path))
        files = _send_files(link, job.name, written, progress)
        done.files = [each["path"] for each in files]
        link.arrive(job.name, done.gen, {**_spec(engine, job.name, checkpoints, repo), "files": files})
    except TorporError as exc:
        _abort(engine, moves, link, job.name, done.gen, exc)
        raise
    if not moves.commit(job.name):  # the peer asked meanwhile and was told no: the move is off
        _abort(engine, moves, link, job.name, done.gen, None)
        raise EnvironmentProblem(f"the move of '{job.name}' to peer {link.name} was called off; it runs here")
    progress(f"handing it over to peer {link.name}")
    try:
        done.answer = link.go(job.name, done.gen, resume=True, lazy=lazy)
    except TorporError as exc:
        exc.details.append(
            f"job '{job.name}' is peer {link.name}'s now (generation {done.gen}); it stays hibernated here, "
            f"its image kept, until peer {link.name} answers: 'torpor migrate {job.name} --to {link.name}' "
            "again hands it over"
        )
        raise
    done.stopped_s = time.monotonic() - stopped
    finish(engine, job.name, done.gen, link.name)
    return done


def finish(engine: Engine, name: str, gen: int, peer: str) -> None:
    """The peer owns ``name``: the source records it gone and lets its images go (its record stays)."""
    Moves(engine.records).acknowledged(name, gen)
    for each in engine.records.checkpoints(name):
        engine.ctx.store.delete(each.id)
        engine.records.delete_checkpoint(each.id)
    engine.records.set_fields(JobName(name), message=f"moved to {peer}")


def _send(
    store: TieredStore, link: PeerLink, job: str, checkpoint_id: str, learnt: set[str]
) -> dict[str, int]:
    """Send the chunks of ``checkpoint_id`` the peer lacks, in batches; what was sent. Batches are read
    here (several chunks at once, each verified: from the checkpoint's copy in RAM where it has one,
    else from the cold tier, decrypted) while up to :data:`IN_FLIGHT` others travel and are stored
    there: the three overlap."""
    repo = store.repo
    manifest = repo.manifest(checkpoint_id)
    offered = sorted({str(chunk) for chunk in manifest.chunk_ids()} - learnt)
    lacking = link.missing(job, offered) if offered else []
    sent = {"chunks": 0, "bytes": 0}
    copy = store.hot_copy(checkpoint_id)
    frames = transfer.frames(repo, manifest, lacking, min(repo.workers, READERS), copy)
    with contextlib.closing(frames), ThreadPoolExecutor(IN_FLIGHT, "torpor-send") as senders:
        travelling: deque[Future[None]] = deque()
        for body, count, size in _batches(frames):
            if len(travelling) == IN_FLIGHT:
                travelling.popleft().result()  # a failed batch fails the move here
            travelling.append(senders.submit(link.send_chunks, job, body))
            sent["chunks"] += count
            sent["bytes"] += size
        for each in travelling:
            each.result()
    learnt.update(manifest.chunk_ids())
    return sent


def _batches(
    frames: Iterator[tuple[bytes, bytes | memoryview]],
) -> Iterator[tuple[list[bytes | memoryview], int, int]]:
    """``frames`` gathered in bodies of about :data:`BATCH_BYTES`: each body's pieces (sent one after
    another, never joined: a joined copy of each body cost as much as reading it), how many frames it
    holds, and its size."""
    batch: list[bytes | memoryview] = []
    size = 0
    for frame in frames:
        batch.extend(frame)
        size += sum(len(piece) for piece in frame)
        if size >= BATCH_BYTES:
            yield batch, len(batch) // 2, size
            batch, size = [], 0
    if batch:
        yield batch, len(batch) // 2, size


def _send_log(link: PeerLink, job: str, log: Path) -> None:
    """The job's log, in pieces of at most :data:`BATCH_BYTES` (an empty one if it has none)."""
    offset = 0
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(log.open("rb")) if log.exists() else None
        while True:
            piece = source.read(BATCH_BYTES) if source else b""
            if piece or offset == 0:
                link.send_log(job, offset, piece)
            offset += len(piece)
            if len(piece) < BATCH_BYTES:
                return


def _send_files(link: PeerLink, job: str, written: list[str], progress: Progress) -> list[dict[str, Any]]:
    """Send the files the stopped job writes that the peer has not the same
    (:func:`~torpor.policy.migration.to_carry`), each in pieces of at most :data:`BATCH_BYTES` and cut
    to its size now (the job is gone: its size at the checkpoint, or later bytes the restore there cuts
    back); what the peer is told of each (the ``files`` of the arrival)."""
    here = {path: stamp for path, stamp in stamps(written).items() if stamp is not None}
    carried = migration.to_carry(here, link.look(sorted(here)) if here else {})
    if carried:
        total = sum(here[path][0] for path in carried)
        progress(
            f"sending {len(carried)} file{'s' if len(carried) > 1 else ''} it writes ({format_size(total)})"
        )
    sent = []
    for index, path in enumerate(carried):
        try:
            with open(path, "rb") as source:
                info = os.fstat(source.fileno())
                size, offset = here[path][0], 0
                while True:
                    piece = source.read(min(BATCH_BYTES, size - offset))
                    link.send_file(job, index, offset, piece)
                    offset += len(piece)
                    if offset >= size or not piece:
                        break
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read {path}, a file the job writes: {exc.strerror}") from exc
        sent.append(
            {
                "path": path,
                "index": index,
                "size": offset,
                "mtime_ns": info.st_mtime_ns,
                "mode": stat.S_IMODE(info.st_mode),
                "uid": info.st_uid,
                "gid": info.st_gid,
            }
        )
    return sent


def _spec(engine: Engine, name: str, checkpoints: list[Checkpoint], repo: Repository) -> dict[str, Any]:
    """The job's records as the peer writes them (:meth:`torpor.core.arrivals.Arrivals.arrive`)."""
    job = engine.records.job(name)
    stopped = engine.settings.job_dir(name) / STOPPED_FILE
    return {
        "command": job.command,
        "cwd": job.cwd,
        "log_path": job.log_path,
        "started_at": job.started_at,
        "ended_at": job.ended_at,
        "policy": engine.records.care(name).policy.to_dict(),
        "stopped": json.loads(stopped.read_text()) if stopped.exists() else None,
        "checkpoints": [
            {**dataclasses.asdict(c), "manifest": repo.manifest(c.id).to_bytes().decode()}
            for c in checkpoints
        ],
    }


class _Aborts(Protocol):
    def abort(self, job: str, gen: int) -> None: ...


def _abort(
    engine: Engine, moves: Moves, link: _Aborts, name: str, gen: int, cause: TorporError | None
) -> None:
    """Before the commit: the job is this machine's again, told to the peer (if it can be) and resumed."""
    moves.abort(name)
    with contextlib.suppress(TorporError):
        link.abort(name, gen)
    job = engine.records.job(name)
    if job.state == JobState.HIBERNATED:
        try:
            engine.restore(name)
        except TorporError as exc:
            if cause is not None:
                cause.details.append(f"job '{name}' stays hibernated here: resuming it failed: {exc.message}")
            return
    if cause is not None:
        cause.details.append(f"job '{name}' was not moved: it runs here as before")


def _store(engine: Engine) -> TieredStore:
    store = engine.ctx.store
    if not isinstance(store, TieredStore):
        raise EnvironmentProblem("this state directory's store cannot send a job to another machine")
    return store
