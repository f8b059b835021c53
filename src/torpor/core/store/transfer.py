"""A checkpoint sent from one cold tier to another's, each with its own key (issue 30: a job moving to a
peer takes its checkpoints along).

A chunk is named by a digest keyed with its store's key (objects.py), so the two stores name the same
bytes differently, and neither can tell the other's names from the bytes. The receiver keeps, for each
transfer, what it learnt: the sender's name of each chunk it took, and its own name for it. The sender
offers its names; the receiver answers those it lacks (:meth:`Receiver.missing`); the sender sends those
chunks as plaintext, verified (:func:`frames`: read from the checkpoint's copy in RAM where there is
one, else from the store and decrypted), and the receiver hashes and encrypts each again with its own
key as it stores it (:meth:`Receiver.take`). A second checkpoint of the same job — the final one of a
move, after one taken while the job ran on — sends only the chunks that changed. The manifest goes last,
its chunks renamed to the receiver's (:meth:`Receiver.write_manifest`), once each is stored there.

A frame is the sender's chunk name (32 bytes), the plaintext's length (4 bytes, big-endian) and the
plaintext. Nothing the sender says is trusted: each chunk is named here by its bytes, the manifest is
validated as any read from a store is, and a manifest naming a chunk the receiver was never given is
refused.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from torpor.core.store.lock import SHARED
from torpor.core.store.manifest import ChunkId, Manifest
from torpor.core.store.objects import KIND_MANIFEST
from torpor.core.store.repository import Repository
from torpor.errors import CorruptImage, StoreError

_HEAD = struct.Struct(">32sI")
#: the largest chunk a frame may carry (the stores' chunks are far smaller)
MAX_CHUNK = 64 << 20


def frames(
    repo: Repository,
    manifest: Manifest,
    chunks: Iterable[str],
    workers: int = 2,
    copy: Path | None = None,
) -> Generator[tuple[bytes, bytes | memoryview], None, None]:
    """The frames of ``chunks`` of ``manifest``'s checkpoint in ``repo``, each read back and verified, as
    (head, plaintext): sent as they are, never joined into one copy.

    ``copy``: a folder holding the checkpoint's files as they were stored (its copy in the hot tier, in
    RAM). A chunk is read from there where it can be and hashed to its name, and read from ``repo``
    (from the disk or a bucket, and decrypted) where not: a file gone from there, or bytes that are not
    the chunk's. ``workers`` chunks are read at once (reading, decrypting and hashing let go of the GIL),
    in order; at most twice as many wait to be taken.
    """
    lengths: dict[str, int] = {
        chunk: length for entry in manifest.files for _, length, chunk in entry.extents if chunk
    }
    local = _Copy(copy, manifest) if copy is not None else None

    def one(chunk: str) -> tuple[bytes, bytes | memoryview]:
        length, name = lengths[chunk], bytes.fromhex(chunk)
        here = local.read(chunk, length) if local is not None else None
        if here is not None and repo.codec.digest(here) == name:
            return _HEAD.pack(name, length), here
        data = repo.chunk_data(manifest.id, chunk, length)
        return _HEAD.pack(name, len(data)), data

    with contextlib.ExitStack() as stack:
        if local is not None:
            stack.callback(local.close)
        pool = stack.enter_context(ThreadPoolExecutor(max(1, workers), thread_name_prefix="torpor-frames"))
        ahead: deque[Future[tuple[bytes, bytes | memoryview]]] = deque()
        try:
            for chunk in chunks:
                if chunk not in lengths:
                    raise StoreError(f"checkpoint {manifest.id} has no chunk {chunk[:16]}…")
                ahead.append(pool.submit(one, chunk))
                if len(ahead) > 2 * workers:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for each in ahead:
                each.cancel()


class _Copy:
    """The files of a checkpoint's copy in ``folder``, each opened once (a copy deleted meanwhile is
    read all the same), read where ``manifest`` puts each chunk (its first place)."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        self.folder = folder
        self.where: dict[str, tuple[str, int]] = {}
        for entry in manifest.files:
            for offset, _, chunk in entry.extents:
                if chunk:
                    self.where.setdefault(chunk, (entry.name, offset))
        self._files: dict[str, int | None] = {}
        self._guard = threading.Lock()

    def read(self, chunk: str, length: int) -> bytes | None:
        """The ``length`` bytes where ``chunk`` lies in the copy; None where the copy has them not."""
        name, offset = self.where[chunk]
        fd = self._open(name)
        if fd is None:
            return None
        try:
            data = os.pread(fd, length, offset)
        except OSError:
            return None
        return data if len(data) == length else None

    def _open(self, name: str) -> int | None:
        with self._guard:
            if name not in self._files:
                try:
                    self._files[name] = os.open(
                        self.folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                    )
                except OSError:
                    self._files[name] = None
            return self._files[name]

    def close(self) -> None:
        with self._guard:
            for fd in self._files.values():
                if fd is not None:
                    os.close(fd)
            self._files = {}


def parse(body: bytes | memoryview) -> Iterator[tuple[str, memoryview]]:
    """The (sender's chunk name, plaintext) of each frame in ``body``; CorruptImage if it is cut."""
    view, at = memoryview(body), 0
    while at < len(view):
        if len(view) - at < _HEAD.size:
            raise CorruptImage("a chunk frame is cut short")
        name, length = _HEAD.unpack_from(view, at)
        at += _HEAD.size
        if length > MAX_CHUNK or len(view) - at < length:
            raise CorruptImage("a chunk frame is cut short, or longer than a chunk can be")
        yield name.hex(), view[at : at + length]
        at += length


@dataclass
class Receiver:
    """The receiving store of one transfer, and what it learnt: the sender's chunk names → its own."""

    repo: Repository
    learnt: dict[str, str] = field(default_factory=dict)

    def missing(self, chunks: Iterable[str]) -> list[str]:
        """Those of the sender's ``chunks`` this store has not been given, or no longer has (gc)."""
        stored = self.repo.stored_chunks()
        return sorted({c for c in chunks if self.learnt.get(c) not in stored})

    def take(self, body: bytes | memoryview) -> dict[str, str]:
        """Store the chunks of ``body``'s frames, each under its own name; what was learnt by them.

        Written through the backend's cache (a folder's: the page cache), though filling it costs this
        machine three to four times what the disk takes: the restore that ends the move reads them back
        from there while the job is stopped. Written around it (tried once, on a 1 GiB job), the move
        sent its chunks 1.1 s sooner and stopped the job 0.4 s longer."""
        self.repo.open()
        new: dict[str, str] = {}
        with self.repo.lock.hold(SHARED, timeout=600), self.repo.storer() as storer:
            for theirs, data in parse(body):
                ours, _ = storer.store(data)
                if ours is None:
                    raise CorruptImage(f"chunk {theirs[:16]}… is all zeros: a store never sends one")
                new[theirs] = ours
        self.repo.backend.sync()  # durable before anything is named by it
        self.learnt.update(new)
        return new

    def write_manifest(self, raw: bytes, checkpoint_id: str) -> Manifest:
        """Store the sender's manifest ``raw`` of ``checkpoint_id``, its chunks named as this store names
        them; StoreError naming how many of its chunks this store lacks, if any."""
        manifest = Manifest.from_bytes(raw, f"the manifest of checkpoint {checkpoint_id} sent")
        if manifest.id != checkpoint_id:
            raise CorruptImage(f"the manifest sent for checkpoint {checkpoint_id} is of {manifest.id}")
        self.repo.open()
        with self.repo.lock.hold(SHARED, timeout=600):
            lacking = self.missing(manifest.chunk_ids())
            if lacking:
                raise StoreError(
                    f"{len(lacking)} chunk(s) of checkpoint {checkpoint_id} were not sent here (or are gone)"
                )
            ours = renamed(manifest, self.learnt)
            self.repo.backend.store(
                f"manifests/{checkpoint_id}", self.repo.codec.encode(KIND_MANIFEST, ours.to_bytes())
            )
            self.repo.backend.sync()
        return ours


def renamed(manifest: Manifest, names: Mapping[str, str]) -> Manifest:
    """``manifest`` with each chunk given its name in ``names``."""
    files = tuple(
        replace(
            entry,
            extents=tuple(
                (offset, length, None if chunk is None else ChunkId(names[chunk]))
                for offset, length, chunk in entry.extents
            ),
        )
        for entry in manifest.files
    )
    return replace(manifest, files=files)
