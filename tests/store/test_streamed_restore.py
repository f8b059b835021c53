"""Restore from the cold tier by streaming: torpor as the image streamer of ``criu restore --stream``.

Covers the streamer's protocol against a scripted client speaking CRIU's side of it (files from the
folder, files from writers, files that do not exist, a writer that fails), the cold tier's file stream
(every piece verified before it is handed over; a damaged chunk stops it at that chunk) and, with real
CRIU: a process restored this way has exactly its memory. The CLI-level cases (a flipped byte refused,
the job never running) are in test_checkpoints.py, for both ways of restoring.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conftest import Torpor
from torpor.adapters.criu import Criu
from torpor.adapters.folder import FolderBackend
from torpor.adapters.imagestreamer import SOCKET_NAME, ImageStreamer, Writer
from torpor.adapters.pipefeed import PipeFeed
from torpor.core.store import TieredStore
from torpor.core.store.backend import Backend
from torpor.core.store.base import is_bulk
from torpor.core.store.manifest import FileEntry
from torpor.core.store.repository import Repository
from torpor.errors import CorruptImage
from torpor.settings import Settings

from .conftest import evict_from_memory, flip_chunk_bit, write_image
from .test_lazy_pageserver import CRIU, digests, hibernated_job

MiB = 1 << 20
BASE = 0x7F0000000000


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- the protocol, against a scripted CRIU -----------------------------------------------------------


def _ask(conn: socket.socket, name: str) -> bytes | None:
    """CRIU's side of one open: the request, the answer, the pipe; returns the file's bytes or None."""
    body = b"\x0a" + bytes([len(name)]) + name.encode()
    conn.sendall(struct.pack("<I", len(body)) + body)
    (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
    reply = conn.recv(length, socket.MSG_WAITALL)
    assert reply[0] == 0x08
    if not reply[1]:
        return None
    read_end, write_end = os.pipe()
    conn.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [write_end]))])
    os.close(write_end)
    data = bytearray()
    while chunk := os.read(read_end, MiB):
        data += chunk
    os.close(read_end)
    return bytes(data)


def _connect(folder: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(folder, os.O_PATH)
    try:
        conn.connect(f"/proc/self/fd/{fd}/{SOCKET_NAME}")  # CRIU connects from inside the folder
    finally:
        os.close(fd)
    return conn


def test_files_come_from_the_folder_or_a_writer_and_others_do_not_exist(tmp_path: Path) -> None:
    tmp_path = tmp_path / ("a-folder-whose-path-is-too-long-for-a-unix-socket-" * 3)
    tmp_path.mkdir()
    (tmp_path / "core-1.img").write_bytes(b"core" * 1000)
    (tmp_path / ".torpor.json").write_text("{}")
    pages = os.urandom(3 * MiB + 4096)

    def write_pages(fd: int) -> None:
        for at in range(0, len(pages), MiB):
            write_all(fd, pages[at : at + MiB])

    streamer = ImageStreamer(tmp_path, {"pages-1.img": write_pages})
    streamer.start()
    with _connect(tmp_path) as conn:
        assert _ask(conn, "core-1.img") == b"core" * 1000
        assert _ask(conn, "memfd.img") is None
        assert _ask(conn, "pages-1.img") == pages
        assert _ask(conn, ".torpor.json") is None  # torpor's own files are not CRIU's
        assert _ask(conn, "../etc/passwd") is None
    streamer.stop()
    assert streamer.error is None
    assert streamer.served == ["core-1.img", "pages-1.img"]
    assert not (tmp_path / SOCKET_NAME).exists()


def test_a_writer_that_fails_cuts_its_file_short_and_is_reported(tmp_path: Path) -> None:
    def write_pages(fd: int) -> None:
        write_all(fd, b"x" * MiB)
        raise CorruptImage("checkpoint c is damaged: pages-1.img at offset 1048576: a chunk does not match")

    streamer = ImageStreamer(tmp_path, {"pages-1.img": write_pages})
    streamer.start()
    with _connect(tmp_path) as conn:
        assert _ask(conn, "pages-1.img") == b"x" * MiB  # CRIU reads exactly its pages: short is fatal
    streamer.stop()
    assert isinstance(streamer.error, CorruptImage) and "offset 1048576" in str(streamer.error)


def test_stop_returns_when_criu_never_came_and_a_second_stop_is_harmless(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    streamer = ImageStreamer(tmp_path)
    streamer.start()
    streamer.stop()
    # its listener ended because it was told to, not because stop gave up waiting for it
    assert set(threading.enumerate()) <= before
    streamer.stop()
    assert not (tmp_path / SOCKET_NAME).exists()


# -- the cold tier's file stream --------------------------------------------------------------------


@pytest.mark.parametrize("workers", [4, 0], ids=["in a pool", "in the caller's thread"])
def test_file_data_is_the_file_with_zeros_and_stops_before_a_damaged_chunk(
    tmp_path: Path, workers: int
) -> None:
    backend: Backend = FolderBackend(tmp_path / "store")
    repo = Repository(backend)
    image = write_image(tmp_path / "img", {BASE: os.urandom(3 * MiB), BASE + 64 * MiB: bytes(2 * MiB)})
    repo.write("c", "job", image, {})
    entry = next(f for f in repo.manifest("c").files if is_bulk(f.name))
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(workers)) if workers else None
        assert b"".join(repo.file_data("c", entry, pool)) == (image / entry.name).read_bytes()
        offset, _, chunk = entry.extents[1]
        assert chunk is not None and offset == MiB
        flip_chunk_bit(repo, chunk, -10)
        handed: list[bytes] = []
        with pytest.raises(CorruptImage, match=f"checkpoint c is damaged: {entry.name} at offset {MiB}"):
            for piece in repo.file_data("c", entry, pool, ahead=3):
                handed.append(bytes(piece))
    assert b"".join(handed) == (image / entry.name).read_bytes()[:MiB]  # nothing of the bad chunk


def test_a_file_piped_from_the_callers_thread_is_the_file_and_ends_before_a_damaged_chunk(
    tmp_path: Path,
) -> None:
    """As a local cold tier streams the pages to CRIU: no pool, each chunk verified in the pipe's buffer."""
    repo = Repository(FolderBackend(tmp_path / "store"))
    image = write_image(tmp_path / "img", {BASE: os.urandom(5 * MiB), BASE + 64 * MiB: bytes(3 * MiB)})
    repo.write("c", "job", image, {})
    entry = next(f for f in repo.manifest("c").files if is_bulk(f.name))
    expected = (image / entry.name).read_bytes()
    for damaged in (False, True):
        if damaged:
            offset, _, chunk = entry.extents[2]
            assert chunk is not None and offset == 2 * MiB
            flip_chunk_bit(repo, chunk, 100)
        read_end, write_end = os.pipe()
        got = bytearray()
        reader = _slow_reader(read_end, got, 0)
        try:
            if damaged:
                with pytest.raises(CorruptImage, match=f"{entry.name} at offset {2 * MiB}"):
                    repo.pipe_file("c", entry, write_end, None)
            else:
                repo.pipe_file("c", entry, write_end, None)
        finally:
            os.close(write_end)
            reader.join()
        assert bytes(got) == (expected[: 2 * MiB] if damaged else expected)


def test_the_cold_tier_streams_pages_in_memory_from_its_own_thread_and_loads_pages_on_disk_ahead(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TieredStore(settings)
    data = os.urandom(6 * MiB)
    staging = store.staging_dir("c1")
    write_image(staging, {BASE: data})
    expected = (staging / "pages-1.img").read_bytes()
    store.put("c1", "job", staging, {"kind": "hibernate"})  # stored through the page cache: read back soon
    store.wait_durable("c1", timeout=60)
    store.hot.remove("c1")
    pools: list[ThreadPoolExecutor | None] = []
    pipe_file = Repository.pipe_file

    def spy(*args: Any) -> None:  # (repo, checkpoint_id, entry, fd, pool, ahead)
        pools.append(args[4])
        pipe_file(*args)

    monkeypatch.setattr(Repository, "pipe_file", spy)
    pages = store.stream_pages("c1", tmp_path / "restore")
    try:
        for evict in (False, True):
            if evict and not evict_from_memory(settings.home):
                pytest.skip(f"{settings.home} is a file system in memory")
            read_end, write_end = os.pipe()
            got = bytearray()
            reader = _slow_reader(read_end, got, 0)
            try:
                pages.write("pages-1.img", write_end)
            finally:
                os.close(write_end)
                reader.join()
            assert bytes(got) == expected
            assert (pools[-1] is not None) is evict  # on disk: a thread loads the chunks ahead
    finally:
        pages.close()


def test_chunk_into_puts_a_verified_chunk_on_a_page_boundary_of_the_buffer(tmp_path: Path) -> None:
    random = os.urandom(MiB)
    compressible = b"torpor " * (MiB // 7) + b"x" * (MiB % 7)
    for key in (None, os.urandom(32)):  # plain chunks are read in place; sealed ones decrypted into it
        backend = FolderBackend(tmp_path / f"store-{key is not None}")
        repo = Repository(backend, key)
        image = write_image(tmp_path / "img", {BASE: random + compressible})
        repo.write("c", "job", image, {})
        entry = next(f for f in repo.manifest("c").files if is_bulk(f.name))
        buffer = memoryview(mmap.mmap(-1, MiB + 2 * mmap.PAGESIZE))
        for (offset, length, chunk), expected in zip(entry.extents, (random, compressible), strict=True):
            assert chunk is not None and length == MiB
            got = repo.chunk_into("c", chunk, length, buffer, f"pages at {offset}")
            assert got.obj is buffer.obj and bytes(buffer[mmap.PAGESIZE : mmap.PAGESIZE + MiB]) == expected
        with pytest.raises(ValueError, match="cannot hold"):
            repo.chunk_into("c", chunk, length, buffer[: MiB + 100])
        flip_chunk_bit(repo, chunk, -10)
        with pytest.raises(CorruptImage, match="checkpoint c is damaged: pages at 1048576"):
            repo.chunk_into("c", chunk, length, buffer, "pages at 1048576")


# -- the pipe, filled by reference -------------------------------------------------------------------


def _slow_reader(read_end: int, into: bytearray, pause: float) -> threading.Thread:
    def read() -> None:
        while piece := os.read(read_end, 24 * 1024):
            into.extend(piece)
            time.sleep(pause)
        os.close(read_end)

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_a_pipe_feed_hands_over_every_byte_while_it_reuses_its_buffers() -> None:
    """Many more buffers than the ring holds, read slowly: a slot lent again too early would show."""
    read_end, write_end = os.pipe()  # 64 KiB: the ring has 2 + 2 slots of 32 KiB
    got = bytearray()
    reader = _slow_reader(read_end, got, 0.001)
    sent = bytearray()
    feed = PipeFeed(write_end, 32 * 1024, spare=2)
    ahead = [feed.buffer(), feed.buffer()]  # filled ahead of the one put next, as file_data does
    for i in range(60):
        buffer = ahead.pop(0)
        length = 1 + (i * 7919) % len(buffer)
        buffer[:length] = bytes([i % 251]) * length
        feed.put(buffer[:length])
        sent += buffer[:length]
        if i % 9 == 0:
            feed.put_zeros(5000)
            sent += bytes(5000)
        ahead.append(feed.buffer())
    feed.finish()
    assert feed.written == len(sent)
    os.close(write_end)
    reader.join()
    assert got == sent


def test_a_pipe_feed_takes_only_its_own_memory_and_lends_no_more_than_it_has() -> None:
    read_end, write_end = os.pipe()
    try:
        feed = PipeFeed(write_end, 4096, spare=1)
        with pytest.raises(ValueError, match=r"only memory from PipeFeed\.buffer"):
            feed.put(memoryview(bytearray(100)))
        lent = [feed.buffer() for _ in range(feed.capacity // 4096 + 1)]
        with pytest.raises(RuntimeError, match="buffers lent and not put"):
            feed.buffer()
        feed.put(lent[0][:10])
        assert os.read(read_end, 100) == bytes(10)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_pipe_feed_whose_reader_went_away_raises_broken_pipe() -> None:
    read_end, write_end = os.pipe()
    feed = PipeFeed(write_end, 4096)
    buffer = feed.buffer()
    buffer[:5] = b"hello"
    feed.put(buffer[:5])
    os.close(read_end)  # gone before it read anything
    try:
        with pytest.raises(BrokenPipeError):
            feed.finish()
        with pytest.raises(BrokenPipeError):
            feed.put_zeros(10)
    finally:
        os.close(write_end)


# -- real CRIU -----------------------------------------------------------------------------------------


@pytest.mark.criu
@pytest.mark.timeout(240)
def test_a_process_restored_through_the_streamer_has_exactly_its_memory(
    torpor: Torpor, tmp_path: Path
) -> None:
    repo, checkpoint, digest = hibernated_job(torpor, "streamed", 64)
    lines = len(digests(torpor.log("streamed")))
    folder = tmp_path / ("a-restore-folder-whose-path-is-too-long-for-a-unix-socket-" * 3)
    manifest = repo.read(checkpoint, folder, skip=is_bulk)
    with ThreadPoolExecutor(4) as pool:

        def writer(entry: FileEntry) -> Writer:
            def write(fd: int) -> None:  # as the cold tier does: chunks verified in the pipe's buffers
                repo.pipe_file(checkpoint, entry, fd, pool)

            return write

        writers = {entry.name: writer(entry) for entry in manifest.files if is_bulk(entry.name)}
        assert writers and not any((folder / name).exists() for name in writers)
        streamer = ImageStreamer(folder, writers)
        streamer.start()
        try:
            pid = Criu(CRIU).restore(folder, tmp_path / "restore.log", folder / "restored.pid", stream=True)
        finally:
            streamer.stop()
    try:
        assert streamer.error is None and set(writers) <= set(streamer.served)
        torpor.wait_for(
            lambda: len(digests(torpor.log("streamed"))) >= lines + 2, what="digests after restore"
        )
        assert set(digests(torpor.log("streamed"))) == {digest}
    finally:
        os.kill(pid, signal.SIGKILL)
