"""The cold tier: checkpoints as content-addressed chunks plus one manifest each, on any backend.

Layout of objects in the backend::

    config                  format, version, chunk size, encryption and key check (plain JSON)
    packs/ab/ab12…          chunks, one after another, each a stored object of its own (objects.py)
    index/<random>          where each chunk of some packs lies: (chunk, pack, offset, length)
    manifests/<id>          one checkpoint (manifest.py), stored after all of its chunks
    pins/<id>               a pinned checkpoint, kept by retention
    locks/<kind>-<random>   writers (shared) and gc (exclusive), see lock.py
    chunks/ab/ab12…         one chunk per object: stores of format 1, still read

Images are cut into chunks of at most ``chunk_size`` bytes. A ``pages-N.img`` is cut along virtual
addresses (pagemap.py), any other file along its offsets. All-zero chunks are not stored at all. A chunk
already in the store is not stored again, whichever checkpoint or job it came from. A chunk is named by
the hex digest of its plaintext.

:class:`Repository` is the one door to the cold tier, a facade over modules that do one job each::

    format.py       the config object: format version, chunk size, key check; format 1 migrated
    chunking.py     cutting an image into chunks; work over a mapped file in parallel
    packs.py        packs and indexes; where each chunk lies (ChunkMap); storing new chunks once
    writing.py      the write path: chunks, then the manifest
    prestore.py     chunks stored while CRIU still writes the dump, and precopy from the stopped job
    reading.py      a checkpoint back into a folder, a consumer or a pipe
    verify.py       a chunk's and a file's bytes against their hashes
    gc.py           removing what no manifest names; merging indexes
"""

from __future__ import annotations

import contextlib
import mmap
import uuid
from collections.abc import Sequence

from torpor.core.store import gc as _gc
from torpor.core.store import prestore as _prestore
from torpor.core.store import reading, writing
from torpor.core.store.backend import NO_BUFFER, Backend
from torpor.core.store.format import DEFAULT_CHUNK_SIZE, DEFAULT_PACK_SIZE, chunk_name, open_config
from torpor.core.store.lock import RepositoryLock
from torpor.core.store.manifest import Manifest
from torpor.core.store.objects import HEADER, KIND_MANIFEST, Codec
from torpor.core.store.packs import ChunkMap, Location, Packs, Storer

# where Repository.write takes what Repository.prestore stored; importable from here as before
from torpor.core.store.verify import chunk_plaintext
from torpor.errors import CheckpointNotFound, CorruptImage, ObjectNotFound, StoreError


class Repository:
    """A store of checkpoints on one backend: write, read, verify, pin, delete and gc them.

    Thread-safe; opened (config read, key checked) on first use. Each method says what it does; how is
    the business of the module it hands over to (see this module's docstring).
    """

    def __init__(
        self,
        backend: Backend,
        key: bytes | None = None,
        workers: int = 4,
        pack_size: int = DEFAULT_PACK_SIZE,
    ) -> None:
        self.backend = backend
        self.codec = Codec(key)
        self.workers = max(1, workers)
        self.pack_size = pack_size
        self.lock = RepositoryLock(backend)
        self.chunk_size = DEFAULT_CHUNK_SIZE
        self._opened = False
        #: where each chunk the indexes read so far name lies
        self.chunks = ChunkMap(backend, self.codec)
        #: the manifest read last, with the stored bytes it came from (a restore reads one twice)
        self._last_manifest: tuple[bytes, Manifest] | None = None

    # -- config ---------------------------------------------------------------------------------------

    def open(self) -> Repository:
        """Read the store's config (creating the store if it is new) and check the key against it."""
        if self._opened:
            return self
        self.chunk_size = open_config(self.backend, self.codec, self.chunk_size)
        self._opened = True
        return self

    def probe(self) -> None:
        """Store and delete a small object: raises the backend's error if the store takes no writes now.

        Opening reads only; this finds a store that became read-only or full, before an image is sent.
        """
        self.open()
        name = f"probe/{uuid.uuid4().hex}"
        try:
            self.backend.store(name, b"torpor checks that the store takes writes\n")
            self.backend.delete(name)
        except StoreError as exc:
            cause = exc.__cause__
            why = cause.strerror if isinstance(cause, OSError) and cause.strerror else exc.message
            raise type(exc)(f"the store {self.backend.url} takes no writes: {why}") from exc

    # -- writing --------------------------------------------------------------------------------------

    #: store an image as a checkpoint, its manifest last (:func:`~torpor.core.store.writing.write_image`)
    write = writing.write_image
    #: store what CRIU has written of a dump in progress (:func:`~torpor.core.store.prestore.prestore`)
    prestore = _prestore.prestore

    def packs(self, cache: bool = True) -> Packs:
        """New packs for this store, which tell :attr:`chunks` of their index (``cache``: see :class:`Packs`)."""
        return Packs(self.backend, self.codec, self.pack_size, self.chunks, cache)

    def storer(self, cache: bool = True) -> Storer:
        """A writing session's deduplicating chunk storer (call it under the writers' lock)."""
        return Storer(self.stored_chunks(), self.codec, self.chunk_size, self.packs(cache))

    # -- reading --------------------------------------------------------------------------------------

    def manifest(self, checkpoint_id: str) -> Manifest:
        self.open()
        what = f"the manifest of checkpoint {checkpoint_id}"
        try:
            blob = self.backend.load(f"manifests/{checkpoint_id}")
        except ObjectNotFound as exc:
            raise CheckpointNotFound(
                f"checkpoint {checkpoint_id} is not in the store {self.backend.url}"
            ) from exc
        last = self._last_manifest
        if last is not None and last[0] == blob and last[1].id == checkpoint_id:
            return last[1]  # the very bytes decoded, verified and parsed before: the same manifest
        manifest = Manifest.from_bytes(self.codec.decode(KIND_MANIFEST, blob, what), what)
        if manifest.id != checkpoint_id:
            raise CorruptImage(f"{what} describes another checkpoint ({manifest.id})")
        self._last_manifest = (bytes(blob), manifest)
        return manifest

    def ids(self) -> list[str]:
        self.open()
        return sorted(name.rsplit("/", 1)[-1] for name in self.backend.list("manifests"))

    def has(self, checkpoint_id: str) -> bool:
        self.open()
        return self.backend.exists(f"manifests/{checkpoint_id}")

    #: a checkpoint into a folder (:func:`~torpor.core.store.reading.read`)
    read = reading.read
    #: one file of a checkpoint, front to back, verified (:func:`~torpor.core.store.reading.file_data`)
    file_data = reading.file_data
    #: one file of a checkpoint into a pipe (:func:`~torpor.core.store.reading.pipe_file`)
    pipe_file = reading.pipe_file

    def chunk_data(
        self, checkpoint_id: str, chunk: str, length: int, verify: bool = True, place: str | None = None
    ) -> bytes | memoryview:
        """The plaintext of one chunk of a checkpoint (``verify=False``: not hashed; the caller will).

        ``place`` (e.g. ``pages-1.img at offset 4096``) says where the chunk belongs, for the error.
        """
        return chunk_plaintext(
            self.codec, self.load_chunk, checkpoint_id, chunk, length, place, verify, NO_BUFFER
        )

    def chunk_into(
        self, checkpoint_id: str, chunk: str, length: int, buffer: memoryview, place: str | None = None
    ) -> memoryview:
        """:meth:`chunk_data`, verified, in ``buffer``: its ``length`` bytes from the second page on.

        The object is read straight into ``buffer`` where the backend can (no new memory is touched), so
        that a plain chunk's bytes start on a page boundary; anything else is copied there once decoded.
        ``buffer`` holds a page plus the chunk size (an object too big for the rest of it, such as an
        encrypted chunk in a buffer of just that, is read into new memory and copied).
        """
        start = mmap.PAGESIZE
        if len(buffer) < start + length:
            raise ValueError(f"a buffer of {len(buffer)} bytes cannot hold a chunk of {length}")
        into = buffer[start - HEADER.size :]  # so that a plain chunk's payload lands at ``start``
        data = chunk_plaintext(self.codec, self.load_chunk, checkpoint_id, chunk, length, place, True, into)
        # a plain chunk read into the buffer is already in place; decrypted or decompressed bytes are new
        if not (isinstance(data, memoryview) and data.obj is buffer.obj):
            buffer[start : start + length] = data
        return buffer[start : start + length]

    def intact(self, checkpoint_id: str, chunks: set[str] | None = None) -> bool:
        """Whether every chunk the checkpoint names is present (cheap: names only, not contents)."""
        try:
            manifest = self.manifest(checkpoint_id)
        except StoreError:
            return False
        if chunks is None:
            chunks = self.stored_chunks()
        return all(chunk in chunks for chunk in manifest.chunk_ids())

    # -- where chunks are ---------------------------------------------------------------------------------

    def load_chunk(self, chunk: str, buffer: memoryview = NO_BUFFER) -> bytes | memoryview:
        """The stored object of ``chunk``, unverified (the front of ``buffer`` where it was read into it).

        Raises ObjectNotFound when the store does not have it.
        """
        self.open()
        where = self._where(chunk)
        if where is not None:
            try:
                return self.backend.load_into(where[0], buffer, where[1], where[2])
            except ObjectNotFound:
                self.chunks.refresh(fresh=True)  # gc rewrote the pack since this looked
                where = self.chunks.get(chunk)
                if where is not None:
                    return self.backend.load_into(where[0], buffer, where[1], where[2])
        return self.backend.load_into(chunk_name(chunk), buffer)  # one object per chunk (format 1)

    def in_memory(self, chunks: Sequence[str], probes: int = 8) -> float:
        """The share of ``chunks`` a load would get without waiting for a disk or a network, judged by
        ``probes`` of them spread evenly (``Backend.in_memory``; a chunk the store lacks counts as 0)."""
        self.open()
        step = max(1, -(-len(chunks) // max(1, probes)))
        sample = [*chunks[::step], *chunks[-1:]]
        shares = [
            0.0 if (where := self._where(chunk)) is None else self.backend.in_memory(*where)
            for chunk in sample
        ]
        return sum(shares) / len(shares) if shares else 1.0

    def _where(self, chunk: str) -> Location | None:
        """Where the packs' indexes put ``chunk``, looking again once if they do not (an index stored since
        this looked, such as the destager's); None for a chunk no index names."""
        where = self.chunks.get(chunk)
        if where is None:
            self.chunks.refresh()
            where = self.chunks.get(chunk)
        return where

    def locate(self, chunk: str) -> Location:
        """Where ``chunk``'s stored object lies, as the indexes say (a format 1 object if none names it)."""
        self.open()
        self.chunks.refresh()
        return self.chunks.get(chunk) or (chunk_name(chunk), 0, -1)

    def stored_chunks(self) -> set[str]:
        """Every chunk in the store (by its indexes and the packs present: no chunk is read)."""
        self.open()
        self.chunks.refresh()
        packs = set(self.backend.list("packs"))
        chunks = self.chunks.chunks_in(packs)
        chunks.update(name.rsplit("/", 1)[-1] for name in self.backend.list("chunks"))
        return chunks

    # -- deleting ---------------------------------------------------------------------------------------

    def delete(self, checkpoint_id: str) -> None:
        """Forget a checkpoint; its chunks go at the next :meth:`gc`."""
        self.open()
        self.backend.delete(f"manifests/{checkpoint_id}")
        self.backend.delete(f"pins/{checkpoint_id}")
        self.backend.sync()

    def set_pinned(self, checkpoint_id: str, pinned: bool) -> None:
        self.open()
        if pinned:
            self.backend.store(f"pins/{checkpoint_id}", b"")
        else:
            self.backend.delete(f"pins/{checkpoint_id}")
        self.backend.sync()

    def pinned(self) -> set[str]:
        self.open()
        return {name.rsplit("/", 1)[-1] for name in self.backend.list("pins")}

    #: delete every chunk no manifest names (:func:`~torpor.core.store.gc.gc`)
    gc = _gc.gc

    def close(self) -> None:
        with contextlib.suppress(StoreError):
            self.backend.close()
