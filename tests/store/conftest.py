"""Fixtures of the store tests: backends (a folder; S3 through a real moto server on loopback, the
``s3_endpoint`` of tests/conftest.py), synthetic
CRIU image folders (pages + pagemap written the way CRIU writes them) and torpor settings whose hot tier
is a private folder in /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from torpor.adapters.folder import FolderBackend
from torpor.adapters.system import disk
from torpor.core.store.backend import Backend
from torpor.core.store.manifest import ChunkId
from torpor.core.store.pagemap import PAGE_SIZE, PE_PRESENT
from torpor.core.store.repository import Repository
from torpor.settings import Settings


def s3_backend(endpoint: str, bucket: str | None = None) -> Backend:
    from torpor.adapters.s3 import S3Backend

    return S3Backend(bucket or f"b{uuid.uuid4().hex[:12]}", "torpor/test", endpoint=endpoint)


@pytest.fixture(params=["folder", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Every backend, for the contract tests (and the repository tests that run on both)."""
    if request.param == "folder":
        made: Backend = FolderBackend(tmp_path / "objects")
    else:
        made = s3_backend(request.getfixturevalue("s3_endpoint"))
    made.create()
    yield made
    made.close()


# -- synthetic CRIU images ---------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _message(fields: list[tuple[int, int]]) -> bytes:
    return b"".join(_varint(number << 3) + _varint(value) for number, value in fields)


def write_image(folder: Path, regions: dict[int, bytes], pages_id: int = 1, extra: bytes = b"core") -> Path:
    """A CRIU-like image: ``pages-N.img`` with ``regions`` (vaddr → bytes) and its ``pagemap``."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [_message([(1, pages_id)])]
    pages = bytearray()
    for vaddr in sorted(regions):
        data = regions[vaddr]
        assert len(data) % PAGE_SIZE == 0
        records.append(_message([(1, vaddr), (2, 0), (4, PE_PRESENT), (5, len(data) // PAGE_SIZE)]))
        pages += data
    raw = b"\x00" * 8 + b"".join(len(r).to_bytes(4, "little") + r for r in records)
    (folder / f"pagemap-{pages_id}.img").write_bytes(raw)
    (folder / f"pages-{pages_id}.img").write_bytes(bytes(pages))
    (folder / "core-1.img").write_bytes(extra)
    return folder


def flip_chunk_bit(repo: Repository, chunk: str, at: int | None = None, mask: int = 0x01) -> None:
    """Flip bits of ``chunk``'s stored object in the store, ``at`` bytes into it (from its end if < 0;
    None: in its middle)."""
    name, offset, length = repo.locate(chunk)
    blob = bytearray(repo.backend.load(name))
    end = len(blob) if length < 0 else offset + length
    if at is None:
        at = (end - offset) // 2
    blob[end + at if at < 0 else offset + at] ^= mask
    repo.backend.store(name, bytes(blob))


def drop_chunk(repo: Repository, chunk: str) -> None:
    """Delete the object holding ``chunk`` (its whole pack)."""
    repo.backend.delete(repo.locate(chunk)[0])


def in_memory_only(root: Path) -> bool:
    """Whether ``root`` is on a file system that keeps files in memory only (tmpfs): no page cache to leave."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(root)], capture_output=True, text=True, check=True)
    return kind.stdout.strip() in ("tmpfs", "ramfs")


def chunks_cached_share(repo: Repository, chunks: Iterable[ChunkId]) -> float:
    """The share of the bytes of stored ``chunks`` that the page cache holds."""
    repo.open().chunks.refresh()
    cached = total = 0.0
    for chunk in chunks:
        where = repo.chunks.get(chunk)
        assert where is not None
        cached += repo.backend.in_memory(*where) * where[2]
        total += where[2]
    return cached / total


def evict_from_memory(root: Path) -> bool:
    """Write every file under ``root`` to disk and drop it from the page cache; False where the file
    system keeps files in memory only (tmpfs), so that nothing could be dropped.

    A page another CPU touched last may sit in that CPU's list for a moment, where ``DONTNEED`` cannot
    drop it: it is asked again until ``mincore`` finds no page of the file in memory (a read, even one
    that must not wait, would start reading the file again).
    """
    if in_memory_only(root):
        return False
    for path in (p for p in root.rglob("*") if p.is_file() and p.stat().st_size):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            for _ in range(100):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if not disk.cached_pages(fd)[0]:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError(f"{path} stays in the page cache")
        finally:
            os.close(fd)
    return True


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if not p.name.startswith("."))
    other = sorted(p.name for p in b.iterdir() if not p.name.startswith("."))
    return names == other and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.fixture
def hot_root() -> Iterator[Path]:
    root = Path("/dev/shm") / f"torpor-test-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def settings(tmp_path: Path, hot_root: Path) -> Settings:
    return Settings(home=tmp_path / "home", criu=None, hot_dir=hot_root, store_workers=2)
