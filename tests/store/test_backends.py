"""The backend contract: every backend (a local folder; S3 through a real moto server) passes these."""

from __future__ import annotations

import errno
import fcntl
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torpor.adapters.folder import FolderBackend
from torpor.core.store.backend import Backend
from torpor.errors import ObjectNotFound

from .conftest import evict_from_memory


def test_store_then_load_gives_the_bytes_back(backend: Backend) -> None:
    backend.store("chunks/ab/abcd", b"hello")
    backend.store("config", b"")
    backend.sync()
    assert backend.load("chunks/ab/abcd") == b"hello"
    assert backend.load("config") == b""
    assert backend.exists("chunks/ab/abcd")


def test_load_into_gives_the_same_bytes_in_the_buffer_or_new(backend: Backend) -> None:
    backend.store("chunks/ab/abcd", b"hello", b" world")
    buffer = memoryview(bytearray(64))
    got = backend.load_into("chunks/ab/abcd", buffer)
    assert bytes(got) == b"hello world"
    if isinstance(got, memoryview):  # read into the buffer: its front, nothing else
        assert got.obj is buffer.obj and bytes(buffer[:11]) == b"hello world"
    assert bytes(backend.load_into("chunks/ab/abcd", memoryview(bytearray(4)))) == b"hello world"  # too big
    with pytest.raises(ObjectNotFound):
        backend.load_into("chunks/ab/nope", buffer)


def test_load_into_a_range(backend: Backend) -> None:
    backend.store("packs/ab/abcd", b"0123456789")
    buffer = memoryview(bytearray(64))
    assert bytes(backend.load_into("packs/ab/abcd", buffer, 3, 4)) == b"3456"
    assert bytes(backend.load_into("packs/ab/abcd", memoryview(b""), 3, 4)) == b"3456"  # new bytes
    assert bytes(backend.load_into("packs/ab/abcd", buffer, 7)) == b"789"  # to the end
    assert bytes(backend.load_into("packs/ab/abcd", buffer, 8, 10)) == b"89"  # the object ends sooner
    assert bytes(backend.load_into("packs/ab/abcd", buffer, 12, 4)) == b""
    with pytest.raises(ObjectNotFound):
        backend.load_into("packs/ab/nope", buffer, 3, 4)


def test_a_writer_object_appears_whole_at_commit_or_not_at_all(backend: Backend) -> None:
    writer = backend.writer("packs/ab/abcd")
    writer.write(b"one ", memoryview(b"two "))
    writer.write(b"three")
    assert not backend.exists("packs/ab/abcd")
    writer.commit()
    writer.abort()  # harmless after commit
    backend.sync()
    assert backend.load("packs/ab/abcd") == b"one two three"
    dropped = backend.writer("packs/cd/cdef")
    dropped.write(b"half")
    dropped.abort()
    assert not backend.exists("packs/cd/cdef")
    assert set(backend.list("packs")) == {"packs/ab/abcd"}


@pytest.mark.parametrize("size", [0, 1, 4095, 4097, (4 << 20) + 12345, 9 << 20])
def test_an_object_written_around_the_cache_is_the_same_object(backend: Backend, size: int) -> None:
    data = os.urandom(size)
    writer = backend.writer("packs/ab/abcd", cache=False)
    # parts of odd sizes: a header, then the rest in pieces that straddle any block or buffer
    writer.write(b"hdr", memoryview(data)[: size // 3])
    writer.write(memoryview(data)[size // 3 :])
    assert not backend.exists("packs/ab/abcd")
    writer.commit()
    backend.sync()
    assert backend.load("packs/ab/abcd") == b"hdr" + data
    dropped = backend.writer("packs/cd/cdef", cache=False)
    dropped.write(data)
    dropped.abort()
    assert set(backend.list("packs")) == {"packs/ab/abcd"}


def test_parallel_writers_around_the_cache_keep_their_bytes_apart(backend: Backend) -> None:
    def write(i: int) -> None:
        writer = backend.writer(f"packs/{i:02x}/{i:04x}", cache=False)
        for part in range(3):
            writer.write(bytes([i]) * (1_500_000 + part * 4099))
        writer.commit()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(16)))
    backend.sync()
    for i in range(16):
        assert backend.load(f"packs/{i:02x}/{i:04x}") == bytes([i]) * (3 * 1_500_000 + 3 * 4099)


def test_store_replaces_an_object(backend: Backend) -> None:
    backend.store("manifests/x", b"one")
    backend.store("manifests/x", b"two, longer")
    assert backend.load("manifests/x") == b"two, longer"


def test_missing_objects(backend: Backend) -> None:
    with pytest.raises(ObjectNotFound):
        backend.load("manifests/nope")
    assert not backend.exists("manifests/nope")
    backend.delete("manifests/nope")  # not an error


def test_in_memory_is_a_share_that_never_fails(backend: Backend) -> None:
    backend.store("packs/aa/x", b"y" * 10_000)
    assert backend.in_memory("packs/aa/nope", 0, 10) == 0.0
    assert backend.in_memory("packs/aa/x", 0, 10_000) == (0.0 if backend.remote else 1.0)  # just written
    assert backend.in_memory("packs/aa/x", 50_000, 10) == 0.0  # past the end: nothing to read
    assert backend.in_memory("../escape", 0, 10) == 0.0


def test_a_folder_tells_bytes_in_the_page_cache_from_bytes_on_disk(tmp_path: Path) -> None:
    backend = FolderBackend(tmp_path / "store")
    backend.store("packs/aa/x", os.urandom(1 << 20))
    assert backend.in_memory("packs/aa/x", 0, 1 << 20) == 1.0
    if not evict_from_memory(tmp_path / "store"):
        pytest.skip(f"{tmp_path} is a file system in memory")
    assert backend.in_memory("packs/aa/x", 0, 1 << 20) == 0.0
    backend.load_into("packs/aa/x", memoryview(bytearray(1 << 19)), 0, 1 << 19)
    assert 0.5 <= backend.in_memory("packs/aa/x", 0, 1 << 20) <= 1.0  # the kernel may read ahead
    backend.load("packs/aa/x")
    assert backend.in_memory("packs/aa/x", 0, 1 << 20) == 1.0


def test_a_folder_writes_an_object_no_one_will_read_soon_around_the_page_cache(tmp_path: Path) -> None:
    if not evict_from_memory(tmp_path):
        pytest.skip(f"{tmp_path} is a file system in memory")
    backend = FolderBackend(tmp_path / "store")
    data = os.urandom((3 << 20) + 5)
    for name, cache in (("packs/aa/cached", True), ("packs/aa/around", False)):
        writer = backend.writer(name, cache=cache)
        writer.write(data)
        writer.commit()
    backend.sync()
    assert backend.in_memory("packs/aa/cached", 0, len(data)) == 1.0
    assert backend.in_memory("packs/aa/around", 0, len(data)) == 0.0  # on the disk only
    assert backend.load("packs/aa/around") == data
    assert oct((tmp_path / "store/packs/aa/around").stat().st_mode & 0o777) == "0o600"


def test_a_folder_whose_file_system_refuses_a_direct_write_writes_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: list[int] = []
    write = os.write

    def refuse_direct(fd: int, data: bytes | memoryview) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return write(fd, data)

    monkeypatch.setattr(os, "write", refuse_direct)
    backend = FolderBackend(tmp_path / "store")
    data = os.urandom((5 << 20) + 7)
    writer = backend.writer("packs/aa/x", cache=False)
    writer.write(data)
    writer.commit()
    assert refused and backend.load("packs/aa/x") == data


def test_delete(backend: Backend) -> None:
    backend.store("pins/a", b"")
    backend.delete("pins/a")
    assert not backend.exists("pins/a")
    assert list(backend.list("pins")) == []


def test_list_is_recursive_and_scoped(backend: Backend) -> None:
    names = {"chunks/00/0011", "chunks/ff/ff22", "chunks/ff/ff33", "manifests/m1", "locks/s-1"}
    for name in names:
        backend.store(name, name.encode())
    assert set(backend.list("chunks")) == {n for n in names if n.startswith("chunks/")}
    assert set(backend.list("manifests")) == {"manifests/m1"}
    assert list(backend.list("empty")) == []


def test_large_object_and_parallel_writers(backend: Backend) -> None:
    big = bytes(range(256)) * 20000
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: backend.store(f"chunks/{i:02x}/{i:04x}", big[i:]), range(32)))
    backend.sync()
    assert all(backend.load(f"chunks/{i:02x}/{i:04x}") == big[i:] for i in range(32))


def test_remove_leftovers_keeps_every_stored_object_and_dropped_writers_leave_nothing(
    backend: Backend,
) -> None:
    backend.store("packs/ab/abcd", b"kept")
    dropped = backend.writer("packs/ab/abce")
    dropped.write(b"half")
    dropped.abort()
    backend.sync()
    assert backend.remove_leftovers(idle=("packs", "index")) == 0
    assert set(backend.list("packs")) == {"packs/ab/abcd"} and backend.load("packs/ab/abcd") == b"kept"


@pytest.mark.parametrize("name", ["../escape", "/abs", "a//b", ".hidden", "chunks/../x", ""])
def test_names_cannot_escape(backend: Backend, name: str) -> None:
    with pytest.raises(ValueError):
        backend.store(name, b"x")
