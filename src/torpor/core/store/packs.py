"""Packs and indexes: where the cold tier's chunks are written, and how it finds them again.

New chunks go into packs of about the store's pack size (one open pack per writing thread): a thousand
1 MiB objects cost a disk far more than a few 32 MiB ones (and a bucket a thousand requests). Each
writing session stores one index for all of its packs, after them and before any manifest that needs
them, so nothing can read a pack before it is whole. :class:`ChunkMap` is what the indexes say, read
lazily and kept in memory; :class:`Storer` is the write side, which stores each new chunk once.

An index is binary::

    "TPIX" | number of packs u32 | each pack's id (16 bytes) | per chunk: digest, pack number, offset, length

Which chunks are garbage, and rewriting packs that hold some, is :mod:`.gc`'s job.
"""

from __future__ import annotations

import struct
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping

from torpor.core.store.backend import Backend
from torpor.core.store.chunking import all_zero
from torpor.core.store.manifest import ChunkId
from torpor.core.store.objects import KIND_CHUNK, KIND_INDEX, Codec
from torpor.errors import CorruptImage, ObjectNotFound

#: where a chunk's stored object lies: (object name, offset, length; -1: all of the object)
Location = tuple[str, int, int]
#: a pack's chunks: (chunk, offset in the pack, length of its stored object)
PackEntry = tuple[ChunkId, int, int]

#: an index: magic and number of packs, then each pack's id (16 bytes), then each chunk's entry
_INDEX_HEAD = struct.Struct("<4sI")
_INDEX_MAGIC = b"TPIX"
_INDEX_ENTRY = struct.Struct("<32sIQI")  # chunk digest, number of its pack, offset, length
_PACK_ID_BYTES = 16


def pack_name(pack: str) -> str:
    return f"packs/{pack[:2]}/{pack}"


def index_bytes(packs: Mapping[str, Iterable[PackEntry]]) -> bytes:
    """The plaintext of an index of ``packs`` (pack id -> its chunks)."""
    ids = sorted(packs)
    out = [_INDEX_HEAD.pack(_INDEX_MAGIC, len(ids)), *(bytes.fromhex(pack) for pack in ids)]
    for number, pack in enumerate(ids):
        out.extend(
            _INDEX_ENTRY.pack(bytes.fromhex(chunk), number, offset, length)
            for chunk, offset, length in packs[pack]
        )
    return b"".join(out)


def parse_index(raw: bytes | memoryview, what: str) -> Iterator[tuple[ChunkId, str, int, int]]:
    """(chunk, pack id, offset, length) of each entry of an index; CorruptImage if it is malformed."""
    view = memoryview(raw)
    if len(view) < _INDEX_HEAD.size:
        raise CorruptImage(f"{what} is truncated")
    magic, count = _INDEX_HEAD.unpack_from(view)
    start = _INDEX_HEAD.size + count * _PACK_ID_BYTES
    if magic != _INDEX_MAGIC or len(view) < start or (len(view) - start) % _INDEX_ENTRY.size:
        raise CorruptImage(f"{what} is not a torpor index")
    ids = [
        bytes(view[at : at + _PACK_ID_BYTES]).hex() for at in range(_INDEX_HEAD.size, start, _PACK_ID_BYTES)
    ]
    for digest, number, offset, length in _INDEX_ENTRY.iter_unpack(view[start:]):
        if number >= count:
            raise CorruptImage(f"{what} names a pack it does not list")
        yield ChunkId(digest.hex()), ids[number], offset, length


def read_index(backend: Backend, codec: Codec, name: str) -> list[tuple[ChunkId, str, int, int]]:
    """The entries of the stored index ``name`` (ObjectNotFound if it is gone)."""
    what = f"the index {name} of the store {backend.url}"
    return list(parse_index(codec.decode(KIND_INDEX, backend.load(name), what), what))


class ChunkMap:
    """Where each chunk the store's indexes name lies (the first place an index gave), thread-safe.

    Indexes are read as they are needed: :meth:`refresh` reads those stored since it last looked, and
    all of them again once one is gone (gc merged them: places may have changed). :meth:`learn` takes
    an index this process has just stored, without reading it back.
    """

    def __init__(self, backend: Backend, codec: Codec) -> None:
        self._backend = backend
        self._codec = codec
        self._where: dict[str, Location] = {}
        #: the indexes read into ``_where``
        self._indexes: set[str] = set()
        self._guard = threading.Lock()
        self._reads = self._fresh_reads = 0

    def get(self, chunk: str) -> Location | None:
        """Where ``chunk`` lies as far as the indexes read so far say (None: none of them names it)."""
        return self._where.get(chunk)

    def chunks_in(self, packs: set[str]) -> set[str]:
        """The chunks known to lie in one of ``packs`` (object names)."""
        return {chunk for chunk, (name, _, _) in self._where.items() if name in packs}

    def refresh(self, fresh: bool = False) -> None:
        """Read the indexes stored since the last call (all of them if one went, or ``fresh``)."""
        reads, fresh_reads = self._reads, self._fresh_reads
        with self._guard:
            if (self._fresh_reads if fresh else self._reads) != (fresh_reads if fresh else reads):
                return  # another thread read them meanwhile (many miss the same chunks at once)
            self._reads += 1
            names = set(self._backend.list("index"))
            if fresh or self._indexes - names:  # gc merged indexes: places may have changed
                self._where, self._indexes = {}, set()
                self._fresh_reads += 1
            for name in sorted(names - self._indexes):
                try:
                    self._note(name, read_index(self._backend, self._codec, name))
                except ObjectNotFound:
                    continue  # merged by gc just now: the merged one is read next time

    def learn(self, name: str, packs: Mapping[str, Iterable[PackEntry]]) -> None:
        """Note the index ``name`` of ``packs`` this process just stored (no need to read it back)."""
        with self._guard:
            self._note(
                name, ((chunk, pack, at, n) for pack, entries in packs.items() for chunk, at, n in entries)
            )

    def forget(self) -> None:
        """Drop everything noted (gc rewrote the packs): the next :meth:`refresh` reads every index."""
        with self._guard:
            self._where, self._indexes = {}, set()

    def _note(self, name: str, entries: Iterable[tuple[ChunkId, str, int, int]]) -> None:
        """Note where index ``name`` says its chunks lie (a chunk's first known place stays); under the guard."""
        where = self._where
        for chunk, pack, offset, length in entries:
            where.setdefault(chunk, (pack_name(pack), offset, length))
        self._indexes.add(name)


class _OpenPack:
    def __init__(self, backend: Backend, cache: bool) -> None:
        self.id = uuid.uuid4().hex
        self.writer = backend.writer(pack_name(self.id), cache=cache)
        self.size = 0
        self.entries: list[PackEntry] = []


class Packs:
    """Chunks written into packs, one open pack per thread, then one index of them all (thread-safe).

    :meth:`add` appends a chunk's stored object to the calling thread's pack and commits the pack once
    it reaches ``pack_size``. :meth:`finish` commits the packs still open, stores the index (nothing can
    read the packs before that) and tells ``chunks`` of it; :meth:`abort` drops the open ones (committed
    ones without an index are left to gc). ``cache=False``: the packs will not be read soon, and may be
    written around the backend's cache (:meth:`Backend.writer`).
    """

    def __init__(
        self, backend: Backend, codec: Codec, pack_size: int, chunks: ChunkMap, cache: bool = True
    ) -> None:
        self._backend = backend
        self._cache = cache
        self._codec = codec
        self._pack_size = pack_size
        self._chunks = chunks
        self._local = threading.local()
        self._guard = threading.Lock()
        self._open: list[_OpenPack] = []
        #: committed packs: id -> their chunks
        self.committed: dict[str, list[PackEntry]] = {}

    def add(self, chunk: ChunkId, *parts: bytes | memoryview) -> None:
        pack: _OpenPack | None = getattr(self._local, "pack", None)
        if pack is None:
            pack = self._local.pack = _OpenPack(self._backend, self._cache)
            with self._guard:
                self._open.append(pack)
        length = sum(len(part) for part in parts)
        pack.writer.write(*parts)
        pack.entries.append((chunk, pack.size, length))
        pack.size += length
        if pack.size >= self._pack_size:
            self._local.pack = None
            self._commit(pack)

    def _commit(self, pack: _OpenPack) -> None:
        pack.writer.commit()
        with self._guard:
            self._open.remove(pack)
            self.committed[pack.id] = pack.entries

    def finish(self, also: Mapping[str, list[PackEntry]] | None = None) -> str | None:
        """Commit the open packs, then store one index of every pack committed (and of ``also``).

        Returns the index's name (None when there was nothing to index). Call it once every ``add``
        has returned.
        """
        for pack in list(self._open):
            self._commit(pack)
        self._local = threading.local()
        packs = {**(also or {}), **self.committed}
        if not packs:
            return None
        name = f"index/{uuid.uuid4().hex}"
        self._backend.store(name, self._codec.encode(KIND_INDEX, index_bytes(packs)))
        self._chunks.learn(name, packs)
        return name

    def abort(self) -> None:
        with self._guard:
            dropped, self._open = self._open, []
        for pack in dropped:
            pack.writer.abort()


class Storer:
    """Hashes pieces of an image and stores each chunk the store lacks, once (thread-safe).

    ``known``: the chunks in the store when this began (listed under the writers' lock: gc cannot drop
    them). A context: new chunks go into ``packs``, which leave it committed and indexed (or dropped, on
    an error).
    """

    def __init__(self, known: set[str], codec: Codec, chunk_size: int, packs: Packs) -> None:
        self.known = known
        self._codec = codec
        self._claimed: set[bytes] = set()
        self._guard = threading.Lock()
        self._zero = bytes(chunk_size)
        self._packs = packs

    def __enter__(self) -> Storer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._packs.finish()
        else:
            self._packs.abort()

    def store(self, data: memoryview) -> tuple[ChunkId | None, int]:
        """(chunk, bytes newly stored); (None, 0) for all zeros, which cost nothing."""
        if all_zero(data, self._zero):
            return None, 0
        codec = self._codec
        digest = codec.digest(data)
        chunk = ChunkId(digest.hex())
        with self._guard:
            fresh = chunk not in self.known and digest not in self._claimed
            self._claimed.add(digest)
        if not fresh:
            return chunk, 0
        header, payload = codec.encode_parts(KIND_CHUNK, data, digest)
        self._packs.add(chunk, header, payload)
        return chunk, len(header) + len(payload)
