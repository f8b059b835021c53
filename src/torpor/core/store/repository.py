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

New chunks go into packs of about ``pack_size`` bytes (one open pack per writing thread): a thousand
1 MiB objects cost a disk far more than a few 32 MiB ones (and a bucket a thousand requests). Each
writing session stores one index for all of its packs, after them and before any manifest that needs
them; ``gc`` rewrites packs that hold unreferenced chunks and merges every index into one.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torpor.adapters import procmem, system
from torpor.adapters.pipefeed import PipeFeed
from torpor.core.store import pagemap
from torpor.core.store.backend import Backend
from torpor.core.store.lock import EXCLUSIVE, SHARED, RepositoryLock
from torpor.core.store.manifest import ChunkId, Extent, FileEntry, Manifest, safe_file_name
from torpor.core.store.objects import HEADER, KIND_CHUNK, KIND_INDEX, KIND_MANIFEST, Codec
from torpor.errors import CheckpointNotFound, CorruptImage, KeyProblem, ObjectNotFound, StoreError

STORE_FORMAT = "torpor-store"
#: 2: chunks in packs; 1: one object per chunk (read still, and turned into 2 by the first open)
STORE_VERSION = 2
DEFAULT_CHUNK_SIZE = 1 << 20
#: a pack is closed once it holds this many bytes
DEFAULT_PACK_SIZE = 32 << 20
#: the zeros :meth:`Repository.file_data` yields for zero extents (one chunk size of them)
ZEROS = bytes(DEFAULT_CHUNK_SIZE)

T = TypeVar("T")

#: for ``Backend.load_into``: new bytes, always
_NO_BUFFER = memoryview(b"")

#: (bytes done, bytes in all)
ProgressFn = Callable[[int, int], None]

#: where a chunk's stored object lies: (object name, offset, length; -1: all of the object)
Location = tuple[str, int, int]
#: a pack's chunks: (chunk, offset in the pack, length of its stored object)
PackEntry = tuple[ChunkId, int, int]

#: an index: magic and number of packs, then each pack's id (16 bytes), then each chunk's entry
_INDEX_HEAD = struct.Struct("<4sI")
_INDEX_MAGIC = b"TPIX"
_INDEX_ENTRY = struct.Struct("<32sIQI")  # chunk digest, number of its pack, offset, length
_PACK_ID_BYTES = 16

#: a piece of an image file: (file name, offset, length)
Piece = tuple[str, int, int]


@dataclass
class Prestored:
    """What :meth:`Repository.prestore` stored of a dump before it was complete."""

    #: pieces of the image as CRIU wrote them: piece -> (chunk, or None for zeros; bytes newly stored)
    pieces: dict[Piece, tuple[ChunkId | None, int]] = field(default_factory=dict)
    #: chunks read from the stopped processes that were new to the store -> bytes newly stored
    memory: dict[ChunkId, int] = field(default_factory=dict)
    #: bytes of memory read from the stopped processes
    memory_read: int = 0


def _no_progress(done: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class FilePlan:
    name: str
    size: int
    pieces: tuple[tuple[int, int], ...]  # (offset, length), contiguous, covering the file


@dataclass(frozen=True)
class GcReport:
    manifests: int
    chunks_kept: int
    chunks_deleted: int


def plan_image(
    image_dir: Path, chunk_size: int, skip: Callable[[str], bool] = lambda _: False
) -> list[FilePlan]:
    """How each file of a CRIU image folder is cut into chunks."""
    pagemaps = pagemap.read_pagemaps(image_dir)
    plans = []
    for path in sorted(image_dir.iterdir()):
        if path.name.startswith(".") or skip(path.name) or not path.is_file() or path.is_symlink():
            continue
        size = path.stat().st_size
        if path.name in pagemaps:
            pieces = tuple(pagemap.cuts(pagemaps[path.name], chunk_size))
        else:
            pieces = tuple((off, min(chunk_size, size - off)) for off in range(0, size, chunk_size))
        plans.append(FilePlan(path.name, size, pieces))
    return plans


def chunk_name(chunk: str) -> str:
    """The object of one chunk in a store of format 1."""
    return f"chunks/{chunk[:2]}/{chunk}"


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


class Repository:
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
        #: where each chunk the indexes read so far name lies (the first place an index gave)
        self._where: dict[str, Location] = {}
        #: the indexes read into ``_where``
        self._indexes: set[str] = set()
        self._index_guard = threading.Lock()
        self._reads = self._fresh_reads = 0

    # -- config ---------------------------------------------------------------------------------------

    def open(self) -> Repository:
        """Read the store's config (creating the store if it is new) and check the key against it."""
        if self._opened:
            return self
        self.backend.create()
        try:
            config = json.loads(self.backend.load("config"))
        except ObjectNotFound:
            config = {
                "format": STORE_FORMAT,
                "version": STORE_VERSION,
                "chunk_size": self.chunk_size,
                "encryption": "aes-256-gcm" if self.codec.encrypted else None,
                "key_check": self.codec.key_check,
            }
            self.backend.store("config", json.dumps(config).encode())
            self.backend.sync()
        except ValueError as exc:
            raise StoreError(f"the config of the store {self.backend.url} is unreadable") from exc
        if not isinstance(config, dict) or config.get("format") != STORE_FORMAT:
            raise StoreError(f"{self.backend.url} is not a torpor store")
        if config.get("version") == 1:  # format 2 reads 1's chunks; 1 cannot read 2's packs
            config["version"] = STORE_VERSION
            self.backend.store("config", json.dumps(config).encode())
            self.backend.sync()
        if config.get("version") != STORE_VERSION:
            raise StoreError(
                f"the store {self.backend.url} has format {config.get('version')}; this torpor reads "
                f"{STORE_VERSION}"
            )
        if config.get("encryption") and not self.codec.encrypted:
            raise KeyProblem(
                f"the store {self.backend.url} is encrypted: set its key file with "
                "'torpor store set --key-file FILE'"
            )
        if not config.get("encryption") and self.codec.encrypted:
            raise KeyProblem(
                f"a key file is configured but the store {self.backend.url} is not encrypted; unset "
                "it with 'torpor store set --no-key', or use a new store ('--url')"
            )
        if config.get("key_check") != self.codec.key_check:
            raise KeyProblem(f"the configured key file is not the key of the store {self.backend.url}")
        self.chunk_size = int(config.get("chunk_size", DEFAULT_CHUNK_SIZE))
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

    def write(
        self,
        checkpoint_id: str,
        job: str,
        image_dir: Path,
        meta: Mapping[str, Any],
        progress: ProgressFn = _no_progress,
        skip: Callable[[str], bool] = lambda _: False,
        prestored: Prestored | None = None,
    ) -> Manifest:
        """Store the image in ``image_dir`` as checkpoint ``checkpoint_id``; the manifest goes last.

        ``prestored``: what :meth:`prestore` did while CRIU wrote this image. A file of the image that
        vanished raises FileNotFoundError (the image was deleted meanwhile).
        """
        try:
            return self._write(checkpoint_id, job, image_dir, meta, progress, skip, prestored or Prestored())
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StoreError(f"cannot read the image in {image_dir}: {exc.strerror or exc}") from exc

    def _write(
        self,
        checkpoint_id: str,
        job: str,
        image_dir: Path,
        meta: Mapping[str, Any],
        progress: ProgressFn,
        skip: Callable[[str], bool],
        prestored: Prestored,
    ) -> Manifest:
        self.open()
        started = time.monotonic()
        plans = plan_image(image_dir, self.chunk_size, skip)
        total = sum(plan.size for plan in plans)
        guard = threading.Lock()
        counters = {"done": 0, "zero": 0, "new_chunks": 0, "new_bytes": 0, "prestored": 0, "from_memory": 0}
        from_memory = dict(prestored.memory)

        with self.lock.hold(SHARED, timeout=600) as held:
            storer = _Storer(self)

            def one(view: memoryview, name: str, offset: int, length: int) -> Extent:
                data = view[offset : offset + length]
                if len(data) != length:
                    raise StoreError(f"{image_dir} changed while it was being stored")
                ahead = prestored.pieces.get((name, offset, length))
                if ahead is not None and (ahead[0] is None or ahead[0] in storer.known):
                    chunk, new = ahead  # the same bytes, hashed (and stored) while CRIU wrote them
                else:
                    ahead = None
                    chunk, new = storer.store(data)
                with guard:
                    if not new and chunk in from_memory:  # stored from the stopped process ahead of it
                        new = from_memory.pop(chunk)  # new for this checkpoint all the same
                        counters["from_memory"] += length
                    if ahead is not None:
                        counters["prestored"] += length
                    counters["done"] += length
                    if chunk is None:
                        counters["zero"] += length
                    if new:
                        counters["new_chunks"] += 1
                        counters["new_bytes"] += new
                return (offset, length, chunk)

            files: list[FileEntry] = []
            last_report = 0.0
            with storer, ThreadPoolExecutor(self.workers, thread_name_prefix="destage") as pool:
                for plan in plans:
                    # mapped, not read: the chunks are hashed, compressed and written from the hot tier's
                    # pages without a copy
                    extents: list[Extent] = []
                    calls = [(plan.name, offset, length) for offset, length in plan.pieces]
                    results = _over_mapping(pool, image_dir / plan.name, plan.size, one, calls)
                    with contextlib.closing(results):
                        for extent in results:
                            extents.append(extent)
                            now = time.monotonic()
                            if now - last_report > 0.2:
                                last_report = now
                                progress(counters["done"], total)
                                held.refresh()
                    files.append(FileEntry(plan.name, plan.size, tuple(_merge_zeros(extents))))
            syncing = time.monotonic()
            self.backend.sync()  # every chunk durable before the manifest names it
            sync_s = time.monotonic() - syncing
            chunks = [c for f in files for _, _, c in f.extents if c is not None]
            manifest = Manifest(
                id=checkpoint_id,
                job=job,
                created_at=float(meta.get("created_at") or time.time()),
                files=tuple(files),
                chunk_size=self.chunk_size,
                kernel=os.uname().release,
                meta=dict(meta),
                sizes={
                    "logical": total,
                    "zero": counters["zero"],
                    "chunks": len(chunks),
                    "unique_chunks": len(set(chunks)),
                    "new_chunks": counters["new_chunks"],
                    "new_bytes": counters["new_bytes"],
                    "prestored": counters["prestored"],
                    "from_memory": counters["from_memory"],
                    "destage_s": round(time.monotonic() - started, 4),
                    "sync_s": round(sync_s, 4),
                },
            )
            self.backend.store(
                f"manifests/{checkpoint_id}", self.codec.encode(KIND_MANIFEST, manifest.to_bytes())
            )
            self.backend.sync()
        progress(total, total)
        return manifest

    def prestore(
        self,
        image_dir: Path,
        prestored: Prestored,
        finished: Callable[[], bool],
        workers: int = 1,
        memory_of: Sequence[int] = (),
    ) -> None:
        """Store the chunks of a dump still in progress that CRIU has written already (best effort).

        CRIU writes a process's pages file front to back and flushes its pagemap in blocks of a few KiB,
        a little behind. Each scan takes the pieces of every pages file that its pagemap so far places
        (all but the last one, which may still grow) and whose bytes are in the file, and hashes and
        stores them in ``workers`` threads of the lowest CPU priority (CRIU is freezing the job: it
        must not wait for a core).
        ``prestored.pieces`` notes each piece's chunk for :meth:`write`, which uses a note only for the very
        same piece of the same file, and only if the chunk is still in the store then. Returns once
        ``finished()`` (the dump is complete or gone); pieces not begun by then are left to ``write``.

        ``memory_of``: the processes being dumped. CRIU holds them stopped for a while before its
        parasite gathers their pages (on this machine mostly its network lock: ~0.4 s of the 0.7 s
        freeze of 1 GiB), and writes the pages only after that. Meanwhile one more idle-priority thread
        reads the pages CRIU will dump from the stopped processes themselves and stores them as the
        chunks they will be (adapters/procmem.py), until the parasite runs. Nothing read there is
        trusted: ``write`` still hashes every piece of the image, and finds these chunks stored
        (``prestored.memory`` says which were new, for the checkpoint's count of bytes it added).
        """
        self.open()
        fds: dict[str, int] = {}
        stop = threading.Event()
        pending: dict[Piece, Future[tuple[ChunkId | None, int]]] = {}
        local = threading.local()

        def one(fd: int, offset: int, length: int) -> tuple[ChunkId | None, int]:
            buffer = getattr(local, "buffer", None)
            if buffer is None or len(buffer) < length:
                buffer = local.buffer = bytearray(max(length, self.chunk_size))
            view = memoryview(buffer)[:length]
            if os.preadv(fd, [view], offset) != length:
                raise StoreError("a pages file shrank while it was being written")
            return storer.store(view)

        def collect() -> None:
            for piece, future in list(pending.items()):
                if future.done():
                    del pending[piece]
                    if not future.cancelled() and future.exception() is None:
                        prestored.pieces[piece] = future.result()

        def copy_memory() -> None:
            _idle_priority()
            with contextlib.suppress(OSError, ValueError, StoreError):  # only a head start
                while not all(procmem.stopped(pid) for pid in memory_of):  # CRIU has not frozen them yet
                    if stop.wait(0.002):
                        return
                zero = procmem.zero_page_frame()
                buffer = bytearray(self.chunk_size)
                for pid in memory_of:
                    for n, window in enumerate(procmem.windows(pid, self.chunk_size, zero, stop.is_set)):
                        if stop.is_set() or (n % 8 == 0 and not procmem.stopped(pid)):
                            return  # CRIU's parasite runs in it now, or the dump is over
                        try:
                            size = procmem.read(pid, window.runs, memoryview(buffer))
                        except OSError:
                            continue  # e.g. a mapping CRIU does not let us read: only that window
                        chunk, new = storer.store(memoryview(buffer)[:size])
                        prestored.memory_read += size
                        if chunk is not None and new:
                            prestored.memory[chunk] = new

        with self.lock.hold(SHARED, timeout=600) as held, _Storer(self) as storer:
            pool = ThreadPoolExecutor(
                max(1, workers), thread_name_prefix="prestore", initializer=_idle_priority
            )
            copier = threading.Thread(target=copy_memory, name="precopy", daemon=True)
            if memory_of:
                copier.start()
            try:
                while True:
                    over = finished()  # before the scan: a scan after the end sees everything
                    for name, pieces in _written_pieces(image_dir, self.chunk_size, fds):
                        for offset, length in pieces:
                            piece = (name, offset, length)
                            if piece not in prestored.pieces and piece not in pending:
                                pending[piece] = pool.submit(one, fds[name], offset, length)
                    collect()
                    if over or not image_dir.is_dir():
                        break
                    held.refresh()
                    time.sleep(0.01)
            finally:
                stop.set()
                if copier.is_alive():
                    copier.join()
                pool.shutdown(wait=True, cancel_futures=True)
                collect()
                for fd in fds.values():
                    os.close(fd)

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
        manifest = Manifest.from_bytes(self.codec.decode(KIND_MANIFEST, blob, what), what)
        if manifest.id != checkpoint_id:
            raise CorruptImage(f"{what} describes another checkpoint ({manifest.id})")
        return manifest

    def ids(self) -> list[str]:
        self.open()
        return sorted(name.rsplit("/", 1)[-1] for name in self.backend.list("manifests"))

    def has(self, checkpoint_id: str) -> bool:
        self.open()
        return self.backend.exists(f"manifests/{checkpoint_id}")

    def read(
        self,
        checkpoint_id: str,
        dest: Path,
        progress: ProgressFn = _no_progress,
        defer: Callable[[str], bool] = lambda _: False,
        skip: Callable[[str], bool] = lambda _: False,
    ) -> Manifest:
        """Rebuild checkpoint ``checkpoint_id`` in ``dest``, fetching and verifying chunks in parallel.

        The chunks of files ``defer`` names are written unverified: the caller must run
        :func:`verify_extents` on those files before it trusts them. Files ``skip`` names are not
        written at all (see :meth:`file_data`).
        """
        manifest = self.manifest(checkpoint_id)
        system.make_private_dirs(dest)
        total = manifest.size
        done = [0]
        guard = threading.Lock()

        def one(fd: int, offset: int, length: int, chunk: str, verify: bool) -> None:
            os.pwrite(fd, self.chunk_data(checkpoint_id, chunk, length, verify), offset)
            with guard:
                done[0] += length

        fds: list[int] = []
        try:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="fetch") as pool:
                futures = []
                for entry in manifest.files:
                    if skip(entry.name):
                        done[0] += entry.size
                        continue
                    if not safe_file_name(entry.name):  # validated already; never write outside dest
                        raise CorruptImage(f"checkpoint {checkpoint_id} names a bad file {entry.name!r}")
                    fd = os.open(dest / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    fds.append(fd)
                    os.ftruncate(fd, entry.size)  # zero extents stay holes
                    verify = not defer(entry.name)
                    for offset, length, chunk in entry.extents:
                        if chunk is None:
                            done[0] += length
                        else:
                            futures.append(pool.submit(one, fd, offset, length, chunk, verify))
                try:
                    last = 0.0
                    for future in futures:
                        future.result()
                        if time.monotonic() - last > 0.2:
                            last = time.monotonic()
                            progress(done[0], total)
                finally:
                    for future in futures:
                        future.cancel()
        except OSError as exc:
            raise StoreError(f"cannot write checkpoint {checkpoint_id} into {dest}: {exc.strerror}") from exc
        finally:
            for fd in fds:
                os.close(fd)
        progress(total, total)
        return manifest

    def file_data(
        self,
        checkpoint_id: str,
        entry: FileEntry,
        pool: ThreadPoolExecutor,
        ahead: int = 8,
        buffers: Callable[[], memoryview] | None = None,
    ) -> Generator[bytes | memoryview, None, None]:
        """The content of one file of a checkpoint, front to back, every piece verified before it is yielded.

        Chunks are fetched and verified in ``pool``, at most ``ahead`` of them before the one being
        yielded; zero extents come as pieces of :data:`ZEROS` (``piece.obj is ZEROS``), at most one chunk
        size each. ``buffers``: where each chunk goes (:meth:`chunk_into`; one buffer asked for per chunk,
        in order), instead of new memory. Raises CorruptImage at the first chunk that is missing or does
        not match its hash.
        """
        pending: deque[tuple[int, Future[bytes | memoryview] | None]] = deque()
        extents = iter(entry.extents)
        try:
            while True:
                while len(pending) < max(1, ahead):
                    extent = next(extents, None)
                    if extent is None:
                        break
                    offset, length, chunk = extent
                    place = f"{entry.name} at offset {offset}"
                    future: Future[bytes | memoryview] | None = None
                    if chunk is not None and buffers is not None:
                        future = pool.submit(self.chunk_into, checkpoint_id, chunk, length, buffers(), place)
                    elif chunk is not None:
                        future = pool.submit(self.chunk_data, checkpoint_id, chunk, length, True, place)
                    pending.append((length, future))
                if not pending:
                    return
                length, future = pending.popleft()
                if future is not None:
                    yield future.result()
                    continue
                for at in range(0, length, len(ZEROS)):
                    yield memoryview(ZEROS)[: min(len(ZEROS), length - at)]
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()

    def pipe_file(
        self, checkpoint_id: str, entry: FileEntry, fd: int, pool: ThreadPoolExecutor, ahead: int = 8
    ) -> None:
        """Write one file of a checkpoint into the pipe ``fd`` (its write end), every chunk verified first.

        Each chunk is read into a buffer of a :class:`PipeFeed` (``ahead`` of them at once, in ``pool``)
        and verified there; the pipe then takes the buffer's pages by reference, so the reader copies
        each byte once. Returns when the reader has read it all; raises CorruptImage (see
        :meth:`file_data`) with nothing of the bad chunk in the pipe.
        """
        # a buffer holds a chunk from its second page on, and a page more for an encrypted one's header
        feed = PipeFeed(fd, self.chunk_size + 2 * mmap.PAGESIZE, spare=ahead + 1)
        for piece in self.file_data(checkpoint_id, entry, pool, ahead, feed.buffer):
            if isinstance(piece, memoryview) and piece.obj is ZEROS:
                feed.put_zeros(len(piece))
            else:
                feed.put(memoryview(piece))
        feed.finish()  # the buffers must outlive every byte of theirs in the pipe

    def chunk_data(
        self, checkpoint_id: str, chunk: str, length: int, verify: bool = True, place: str | None = None
    ) -> bytes | memoryview:
        """The plaintext of one chunk of a checkpoint (``verify=False``: not hashed; the caller will).

        ``place`` (e.g. ``pages-1.img at offset 4096``) says where the chunk belongs, for the error.
        """
        return self._chunk_plaintext(checkpoint_id, chunk, length, place, verify, _NO_BUFFER)

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
        data = self._chunk_plaintext(checkpoint_id, chunk, length, place, True, buffer[start - HEADER.size :])
        # a plain chunk read into the buffer is already in place; decrypted or decompressed bytes are new
        if not (isinstance(data, memoryview) and data.obj is buffer.obj):
            buffer[start : start + length] = data
        return buffer[start : start + length]

    def _chunk_plaintext(
        self,
        checkpoint_id: str,
        chunk: str,
        length: int,
        place: str | None,
        verify: bool,
        buffer: memoryview,
    ) -> bytes | memoryview:
        what = (
            f"{place}: chunk {chunk[:16]}…" if place else f"chunk {chunk[:16]}… of checkpoint {checkpoint_id}"
        )
        try:
            blob = self.load_chunk(chunk, buffer)
        except ObjectNotFound as exc:
            raise CorruptImage(f"checkpoint {checkpoint_id} is damaged: its {what} is missing") from exc
        try:
            data = self.codec.decode(KIND_CHUNK, blob, what, bytes.fromhex(chunk), verify=verify)
        except CorruptImage as exc:
            raise CorruptImage(f"checkpoint {checkpoint_id} is damaged: {exc.message}") from exc
        if len(data) != length:
            raise CorruptImage(f"checkpoint {checkpoint_id} is damaged: {what} has the wrong size")
        return data

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

    def load_chunk(self, chunk: str, buffer: memoryview = _NO_BUFFER) -> bytes | memoryview:
        """The stored object of ``chunk``, unverified (the front of ``buffer`` where it was read into it).

        Raises ObjectNotFound when the store does not have it.
        """
        self.open()
        where = self._where.get(chunk)
        if where is None:
            self._read_indexes()  # an index stored since this looked
            where = self._where.get(chunk)
        if where is not None:
            try:
                return self.backend.load_into(where[0], buffer, where[1], where[2])
            except ObjectNotFound:
                self._read_indexes(fresh=True)  # gc rewrote the pack since this looked
                where = self._where.get(chunk)
                if where is not None:
                    return self.backend.load_into(where[0], buffer, where[1], where[2])
        return self.backend.load_into(chunk_name(chunk), buffer)  # one object per chunk (format 1)

    def locate(self, chunk: str) -> Location:
        """Where ``chunk``'s stored object lies, as the indexes say (a format 1 object if none names it)."""
        self.open()
        self._read_indexes()
        return self._where.get(chunk) or (chunk_name(chunk), 0, -1)

    def stored_chunks(self) -> set[str]:
        """Every chunk in the store (by its indexes and the packs present: no chunk is read)."""
        self.open()
        self._read_indexes()
        packs = set(self.backend.list("packs"))
        chunks = {chunk for chunk, (name, _, _) in self._where.items() if name in packs}
        chunks.update(name.rsplit("/", 1)[-1] for name in self.backend.list("chunks"))
        return chunks

    def _read_indexes(self, fresh: bool = False) -> None:
        """Read the indexes stored since the last call (all of them if one went, or ``fresh``)."""
        reads, fresh_reads = self._reads, self._fresh_reads
        with self._index_guard:
            if (self._fresh_reads if fresh else self._reads) != (fresh_reads if fresh else reads):
                return  # another thread read them meanwhile (many miss the same chunks at once)
            self._reads += 1
            names = set(self.backend.list("index"))
            if fresh or self._indexes - names:  # gc merged indexes: places may have changed
                self._where, self._indexes = {}, set()
                self._fresh_reads += 1
            for name in sorted(names - self._indexes):
                try:
                    self._note(name, self._index_entries(name))
                except ObjectNotFound:
                    continue  # merged by gc just now: the merged one is read next time

    def _index_entries(self, name: str) -> list[tuple[ChunkId, str, int, int]]:
        what = f"the index {name} of the store {self.backend.url}"
        return list(parse_index(self.codec.decode(KIND_INDEX, self.backend.load(name), what), what))

    def _learn(self, name: str, packs: Mapping[str, Iterable[PackEntry]]) -> None:
        """Note the index this process just stored (no need to read it back)."""
        with self._index_guard:
            self._note(
                name, ((chunk, pack, at, n) for pack, entries in packs.items() for chunk, at, n in entries)
            )

    def _note(self, name: str, entries: Iterable[tuple[ChunkId, str, int, int]]) -> None:
        """Note where index ``name`` says its chunks lie (a chunk's first known place stays); under the guard."""
        where = self._where
        for chunk, pack, offset, length in entries:
            where.setdefault(chunk, (pack_name(pack), offset, length))
        self._indexes.add(name)

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

    def gc(self, timeout: float = 120.0) -> GcReport:
        """Delete every chunk no manifest names; waits for writers, and writers wait for it.

        A pack whose chunks are all unreferenced is deleted; one holding some is rewritten with the
        others only. Then one index of every pack replaces all indexes. New packs and the new index are
        durable before anything is deleted, so a crash at any point loses no referenced chunk (it may
        leave duplicates or unindexed packs, which the next gc removes).
        """
        self.open()
        with self.lock.hold(EXCLUSIVE, timeout=timeout) as held:
            referenced: set[str] = set()
            ids = self.ids()
            for checkpoint_id in ids:
                # a manifest that cannot be read aborts gc: its chunks must not be taken for garbage
                referenced.update(self.manifest(checkpoint_id).chunk_ids())
                held.refresh()
            indexes = sorted(self.backend.list("index"))
            present = {name.rsplit("/", 1)[-1] for name in self.backend.list("packs")}
            kept_at: dict[ChunkId, tuple[str, int, int]] = {}  # referenced chunk -> (pack, offset, length)
            entries_of: dict[str, int] = {}  # pack -> its entries in all indexes
            for name in indexes:
                for chunk, pack, offset, length in self._index_entries(name):
                    entries_of[pack] = entries_of.get(pack, 0) + 1
                    if chunk in referenced and chunk not in kept_at and pack in present:
                        kept_at[chunk] = (pack, offset, length)
                held.refresh()
            live: dict[str, list[PackEntry]] = {}
            for kept_chunk, (pack, offset, length) in kept_at.items():
                live.setdefault(pack, []).append((kept_chunk, offset, length))
            whole = {pack: entries for pack, entries in live.items() if len(entries) == entries_of[pack]}
            deleted = sum(entries_of.values()) - len(kept_at)
            if deleted or len(indexes) > 1 or present - set(whole):
                packs = _Packs(self)
                try:
                    for pack, entries in live.items():
                        if pack not in whole:  # some of its chunks are garbage: copy the others
                            for chunk, offset, length in entries:
                                packs.add(
                                    chunk,
                                    self.backend.load_into(pack_name(pack), _NO_BUFFER, offset, length),
                                )
                                held.refresh()
                    index = packs.finish(also=whole)
                except BaseException:
                    packs.abort()
                    raise
                self.backend.sync()
                for name in indexes:
                    if name != index:
                        self.backend.delete(name)
                for pack in present - set(whole):
                    self.backend.delete(pack_name(pack))
                    held.refresh()
            kept = len(kept_at)
            for name in list(self.backend.list("chunks")):  # stores of format 1
                held.refresh()  # a long gc must not look stale to writers
                if name.rsplit("/", 1)[-1] in referenced:
                    kept += 1
                else:
                    self.backend.delete(name)
                    deleted += 1
            remove_leftovers = getattr(self.backend, "remove_leftovers", None)
            if remove_leftovers is not None:  # writers of these hold the lock shared: none runs now
                remove_leftovers(idle=("packs", "index", "manifests", "chunks"))
            self.backend.sync()
            with self._index_guard:
                self._where, self._indexes = {}, set()
        return GcReport(len(ids), kept, deleted)

    def close(self) -> None:
        with contextlib.suppress(StoreError):
            self.backend.close()


def _idle_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; Linux sets it per thread)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class _Storer:
    """Hashes pieces of an image and stores each chunk the store lacks, once (thread-safe).

    A context: new chunks go into packs, which leave it committed and indexed (or dropped, on an error).
    """

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        #: the chunks in the store when this began (listed under the writers' lock: gc cannot drop them)
        self.known = repo.stored_chunks()
        self._claimed: set[bytes] = set()
        self._guard = threading.Lock()
        self._zero = bytes(repo.chunk_size)
        self._packs = _Packs(repo)

    def __enter__(self) -> _Storer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._packs.finish()
        else:
            self._packs.abort()

    def store(self, data: memoryview) -> tuple[ChunkId | None, int]:
        """(chunk, bytes newly stored); (None, 0) for all zeros, which cost nothing."""
        if _all_zero(data, self._zero):
            return None, 0
        codec = self.repo.codec
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


class _OpenPack:
    def __init__(self, repo: Repository) -> None:
        self.id = uuid.uuid4().hex
        self.writer = repo.backend.writer(pack_name(self.id))
        self.size = 0
        self.entries: list[PackEntry] = []


class _Packs:
    """Chunks written into packs, one open pack per thread, then one index of them all (thread-safe).

    :meth:`add` appends a chunk's stored object to the calling thread's pack and commits the pack once
    it reaches the store's pack size. :meth:`finish` commits the packs still open and stores the index
    (nothing can read the packs before that); :meth:`abort` drops the open ones (committed ones without
    an index are left to gc).
    """

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self._local = threading.local()
        self._guard = threading.Lock()
        self._open: list[_OpenPack] = []
        #: committed packs: id -> their chunks
        self.committed: dict[str, list[PackEntry]] = {}

    def add(self, chunk: ChunkId, *parts: bytes | memoryview) -> None:
        pack: _OpenPack | None = getattr(self._local, "pack", None)
        if pack is None:
            pack = self._local.pack = _OpenPack(self.repo)
            with self._guard:
                self._open.append(pack)
        length = sum(len(part) for part in parts)
        pack.writer.write(*parts)
        pack.entries.append((chunk, pack.size, length))
        pack.size += length
        if pack.size >= self.repo.pack_size:
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
        self.repo.backend.store(name, self.repo.codec.encode(KIND_INDEX, index_bytes(packs)))
        self.repo._learn(name, packs)
        return name

    def abort(self) -> None:
        with self._guard:
            dropped, self._open = self._open, []
        for pack in dropped:
            pack.writer.abort()


def _written_pieces(
    image_dir: Path, chunk_size: int, fds: dict[str, int]
) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """For a dump in progress: each pages file's pieces, as far as they are written (see ``prestore``).

    The pagemap lags behind the pages file, so the pages written past what it accounts for are taken
    to go on from its last run (as they do within one mapping: most of a big process's memory). A
    wrong guess costs only work: :meth:`Repository.write` uses what was stored for a piece only if the
    complete pagemap cuts the very same piece of the file. The last piece is left out (it may grow).
    Opens each pages file once into ``fds`` (it is read from there, even after the folder is renamed).
    """
    for path in sorted(image_dir.glob("pagemap-*.img")):
        try:
            so_far = pagemap.read_pagemap(path, partial=True)
            name = so_far.pages_file
            if name not in fds:
                fds[name] = os.open(image_dir / name, os.O_RDONLY)
            written = os.fstat(fds[name]).st_size
        except (OSError, ValueError, IndexError):
            continue  # not begun yet, or gone: the next scan (or write) sees it
        runs = list(so_far.runs)
        if runs and written > so_far.size:
            last = runs[-1]
            guess = (written - so_far.size) // pagemap.PAGE_SIZE
            runs.append(
                pagemap.PageRun(
                    last.vaddr + last.nr_pages * pagemap.PAGE_SIZE, guess, so_far.size, last.flags
                )
            )
        pieces = pagemap.cuts(pagemap.Pagemap(so_far.pages_id, tuple(runs)), chunk_size)[:-1]
        yield name, [(offset, length) for offset, length in pieces if offset + length <= written]


def verify_extents(
    codec: Codec,
    folder: Path,
    entries: Iterable[FileEntry],
    checkpoint_id: str,
    workers: int = 4,
    zeros: bool = True,
) -> None:
    """Check files of ``folder`` against their manifest entries, extent by extent, in parallel.

    Raises :class:`~torpor.errors.CorruptImage` naming the first file and offset that does not match
    (a chunk's hash, or zeros where the manifest says zeros; ``zeros=False`` skips those, for files
    :meth:`Repository.read` wrote, where they are holes it made).
    """
    zero = bytes(DEFAULT_CHUNK_SIZE)

    def one(view: memoryview, name: str, offset: int, length: int, chunk: ChunkId | None) -> None:
        data = view[offset : offset + length]
        if chunk is None:  # merged zero extents can be gigabytes: compare piece by piece
            good = all(_all_zero(data[at : at + len(zero)], zero) for at in range(0, length, len(zero)))
        else:
            good = len(data) == length and codec.digest(data) == bytes.fromhex(chunk)
        if not good:
            raise CorruptImage(
                f"checkpoint {checkpoint_id} is damaged: {name} at offset {offset} does not match its hash"
            )

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="verify") as pool:
        for entry in entries:
            calls = [(entry.name, *extent) for extent in entry.extents if zeros or extent[2] is not None]
            try:
                if (folder / entry.name).stat().st_size != entry.size:
                    raise CorruptImage(
                        f"checkpoint {checkpoint_id} is damaged: {entry.name} has the wrong size"
                    )
                with contextlib.closing(
                    _over_mapping(pool, folder / entry.name, entry.size, one, calls)
                ) as run:
                    for _ in run:
                        pass
            except OSError as exc:
                raise CorruptImage(
                    f"checkpoint {checkpoint_id}: cannot read {entry.name} to verify it ({exc.strerror})"
                ) from exc


def _over_mapping(
    pool: ThreadPoolExecutor,
    path: Path,
    size: int,
    task: Callable[..., T],
    calls: Iterable[tuple[Any, ...]],
) -> Generator[T, None, None]:
    """``task(view, *args)`` for each ``args`` of ``calls``, in ``pool``, on a read-only mapping of ``path``.

    Yields the results in order. The mapping is unmapped once every task has finished or been
    cancelled, whether they all succeeded or one raised (close the generator to stop early).
    """
    mapping = _map(path, size)
    view = memoryview(mapping)
    futures: list[Future[T]] = []
    try:
        futures = [pool.submit(task, view, *args) for args in calls]
        for future in futures:
            yield future.result()
    finally:
        for future in futures:
            future.cancel()
        wait(futures)
        if isinstance(mapping, mmap.mmap):
            # a failed task's traceback may still hold a slice: then the GC unmaps it
            with contextlib.suppress(BufferError):
                view.release()
                mapping.close()


def _all_zero(data: memoryview | bytes, zero: bytes) -> bool:
    """Whether ``data`` (at most ``len(zero)`` bytes) is all zeros; most memory fails on its first bytes."""
    head = min(len(data), 64)
    return data[:head] == zero[:head] and data == zero[: len(data)]


def _map(path: Path, size: int) -> mmap.mmap | bytes:
    if size == 0:
        return b""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _merge_zeros(extents: list[Extent]) -> list[Extent]:
    out: list[Extent] = []
    for extent in extents:
        if extent[2] is None and out and out[-1][2] is None:
            out[-1] = (out[-1][0], out[-1][1] + extent[1], None)
        else:
            out.append(extent)
    return out
