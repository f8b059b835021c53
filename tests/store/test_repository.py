"""The cold tier on every backend: chunking along addresses, dedup, zero elision, compression,
verification on read, encryption, retention's deletes and gc (also while checkpoints are written)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from torpor.adapters.folder import FolderBackend
from torpor.core.store.backend import Backend
from torpor.core.store.prestore import Prestored
from torpor.core.store.repository import Repository
from torpor.errors import CheckpointNotFound, CorruptImage, KeyProblem

from .conftest import (
    chunks_cached_share,
    drop_chunk,
    evict_from_memory,
    flip_chunk_bit,
    same_files,
    write_image,
)

MiB = 1 << 20
BASE = 0x7F0000000000


def _random(n: int, seed: int = 0) -> bytes:
    return os.urandom(n) if seed == 0 else bytes((i * seed) % 251 for i in range(n))


def test_round_trip_is_exact_and_every_file_is_restored(backend: Backend, tmp_path: Path) -> None:
    image = write_image(tmp_path / "img", {BASE: _random(3 * MiB), BASE + 64 * MiB: bytes(MiB)})
    repo = Repository(backend, workers=4)
    manifest = repo.write("c1", "job", image, {"criu_version": "4.2.1", "parent": None})
    repo.read("c1", tmp_path / "out")
    assert same_files(image, tmp_path / "out")
    assert repo.ids() == ["c1"]
    assert manifest.meta["criu_version"] == "4.2.1" and manifest.kernel
    assert (
        repo.manifest("c1").sizes["logical"]
        == 4 * MiB + len(b"core") + (image / "pagemap-1.img").stat().st_size
    )


def test_zero_pages_cost_nothing(backend: Backend, tmp_path: Path) -> None:
    image = write_image(tmp_path / "img", {BASE: bytes(32 * MiB)})
    manifest = Repository(backend).write("z", "job", image, {})
    assert manifest.sizes["zero"] == 32 * MiB
    assert manifest.sizes["new_bytes"] < 4096  # the small files only


def test_an_unchanged_region_dedups_even_when_an_earlier_region_grew(
    backend: Backend, tmp_path: Path
) -> None:
    stable = _random(8 * MiB)
    first = write_image(tmp_path / "a", {BASE: _random(MiB), BASE + 256 * MiB: stable})
    # the earlier region grew by 5 pages: every byte of `stable` moved in the pages file
    second = write_image(tmp_path / "b", {BASE: _random(MiB + 5 * 4096), BASE + 256 * MiB: stable})
    repo = Repository(backend)
    one = repo.write("one", "job", first, {})
    two = repo.write("two", "job-b", second, {})
    assert two.sizes["new_bytes"] < 1.3 * MiB < one.sizes["new_bytes"]
    repo.read("two", tmp_path / "out")
    assert same_files(second, tmp_path / "out")


def test_compressible_data_is_compressed_and_random_data_is_not_inflated(
    backend: Backend, tmp_path: Path
) -> None:
    text = (b"the same training log line, again and again\n" * 100000)[: 4 * MiB]
    repo = Repository(backend)
    assert repo.write("t", "job", write_image(tmp_path / "t", {BASE: text}), {}).sizes["new_bytes"] < MiB / 10
    noise = repo.write("n", "job", write_image(tmp_path / "n", {BASE: _random(4 * MiB)}), {})
    assert noise.sizes["new_bytes"] < 4 * MiB * 1.01


def test_data_that_compresses_by_less_than_an_eighth_is_stored_raw(backend: Backend, tmp_path: Path) -> None:
    """Like model weights (5-10 %): compressing costs more CPU than the bytes it saves, twice."""
    repo = Repository(backend)
    slight, half = bytearray(_random(4 * MiB)), bytearray(_random(4 * MiB))
    slight[::8] = bytes(len(slight) // 8)  # zstd saves ~5 %
    for run in range(0, len(half), 128):  # zeros, half of it in runs of 64 bytes: zstd saves ~49 %
        half[run : run + 64] = bytes(64)
    stored = {
        name: repo.write(name, "job", write_image(tmp_path / name, {BASE: bytes(data)}), {}).sizes[
            "new_bytes"
        ]
        for name, data in (("slight", slight), ("half", half))
    }
    assert stored["slight"] >= 4 * MiB
    assert stored["half"] < 4 * MiB * 0.7
    repo.read("slight", tmp_path / "out")
    assert same_files(tmp_path / "slight", tmp_path / "out")


def _first_chunk(repo: Repository, checkpoint_id: str) -> str:
    manifest = repo.manifest(checkpoint_id)
    pages = next(f for f in manifest.files if f.name.startswith("pages-"))
    chunk = pages.extents[0][2]
    assert chunk is not None
    return chunk


def test_a_flipped_byte_is_refused_with_the_checkpoint_named(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    repo.write("good", "job", write_image(tmp_path / "img", {BASE: _random(2 * MiB)}), {})
    flip_chunk_bit(repo, _first_chunk(repo, "good"), MiB // 2)
    with pytest.raises(CorruptImage, match="checkpoint good is damaged"):
        repo.read("good", tmp_path / "out")


def test_a_missing_chunk_is_refused(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    repo.write("c", "job", write_image(tmp_path / "img", {BASE: _random(MiB)}), {})
    drop_chunk(repo, _first_chunk(repo, "c"))
    with pytest.raises(CorruptImage, match="missing"):
        repo.read("c", tmp_path / "out")
    assert not repo.intact("c")


def test_a_manifest_cannot_write_outside_the_restore_folder(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    manifest = repo.write("c", "job", write_image(tmp_path / "img", {BASE: _random(MiB)}), {})
    evil = manifest.to_bytes().replace(b'"name":"core-1.img"', b'"name":"../../evil"')
    backend.store("manifests/c", repo.codec.encode(2, evil))
    with pytest.raises(CorruptImage, match="bad file name"):
        repo.read("c", tmp_path / "out")
    assert not (tmp_path / "evil").exists()


def test_a_manifest_read_twice_is_parsed_once_but_changed_bytes_are_read_anew(
    backend: Backend, tmp_path: Path
) -> None:
    repo = Repository(backend)
    manifest = repo.write("c", "job", write_image(tmp_path / "img", {BASE: _random(MiB)}), {})
    assert repo.manifest("c") is repo.manifest("c")  # a restore asks twice: one parse
    evil = manifest.to_bytes().replace(b'"name":"core-1.img"', b'"name":"../../evil"')
    backend.store("manifests/c", repo.codec.encode(2, evil))
    with pytest.raises(CorruptImage, match="bad file name"):
        repo.manifest("c")


def test_unknown_checkpoint(backend: Backend) -> None:
    with pytest.raises(CheckpointNotFound):
        Repository(backend).manifest("nope")


def test_encrypted_store(backend: Backend, tmp_path: Path) -> None:
    key = os.urandom(32)
    secret = b"password=hunter2;" * 30000
    image = write_image(tmp_path / "img", {BASE: secret[: (len(secret) // 4096) * 4096]})
    repo = Repository(backend, key)
    repo.write("c", "job", image, {"command": ["secret-tool"]})
    assert list(backend.list("packs"))
    for name in backend.list("packs"):
        assert b"hunter2" not in backend.load(name)
    assert b"secret-tool" not in backend.load("manifests/c")
    repo.read("c", tmp_path / "out")
    assert same_files(image, tmp_path / "out")
    with pytest.raises(KeyProblem, match="not the key"):
        Repository(backend, os.urandom(32)).open()
    with pytest.raises(KeyProblem, match="encrypted"):
        Repository(backend).open()
    flip_chunk_bit(repo, _first_chunk(repo, "c"), -5, 0x40)
    with pytest.raises(CorruptImage, match="authentication"):
        repo.read("c", tmp_path / "out2")


def test_a_key_for_a_plain_store_is_refused(backend: Backend, tmp_path: Path) -> None:
    Repository(backend).open()
    with pytest.raises(KeyProblem, match="not encrypted"):
        Repository(backend, os.urandom(32)).open()


def test_gc_removes_only_unreferenced_chunks(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    shared = _random(MiB)
    repo.write("a", "job", write_image(tmp_path / "a", {BASE: shared, BASE + MiB: _random(MiB)}), {})
    repo.write("b", "job", write_image(tmp_path / "b", {BASE: shared, BASE + MiB: _random(MiB)}), {})
    before = len(repo.stored_chunks())
    repo.delete("a")
    report = repo.gc()
    assert report.chunks_deleted > 0 and report.chunks_kept == before - report.chunks_deleted
    repo.read("b", tmp_path / "out")
    assert same_files(tmp_path / "b", tmp_path / "out")
    assert repo.gc().chunks_deleted == 0


def test_chunks_go_into_packs_of_the_pack_size_with_one_index_per_write(
    backend: Backend, tmp_path: Path
) -> None:
    repo = Repository(backend, workers=3, pack_size=3 * MiB)
    image = write_image(tmp_path / "img", {BASE: _random(12 * MiB)})
    manifest = repo.write("c", "job", image, {})
    packs = list(backend.list("packs"))
    assert 4 <= len(packs) <= 7  # 12 chunks of ~1 MiB, 3 to a pack; at most one open pack per thread
    assert len(list(backend.list("index"))) == 1
    assert set(manifest.chunk_ids()) <= repo.stored_chunks()
    assert {repo.locate(chunk)[0] for chunk in manifest.chunk_ids()} == set(packs)
    fresh = Repository(backend)  # another process: finds the chunks through the index
    fresh.read("c", tmp_path / "out")
    assert same_files(image, tmp_path / "out")


def test_gc_rewrites_a_pack_that_holds_garbage_and_merges_the_indexes(
    backend: Backend, tmp_path: Path
) -> None:
    repo = Repository(backend, workers=1)  # one pack per write: a's holds the shared chunk and garbage
    shared = _random(MiB)
    repo.write("a", "job", write_image(tmp_path / "a", {BASE: shared, BASE + MiB: _random(MiB)}), {})
    repo.write("b", "job", write_image(tmp_path / "b", {BASE: shared, BASE + MiB: _random(MiB)}), {})
    reader = Repository(backend)
    reader.read("b", tmp_path / "early")  # knows where b's chunks were before gc moved them
    (garbage,) = set(repo.manifest("a").chunk_ids()) - set(repo.manifest("b").chunk_ids())
    held_garbage = repo.locate(garbage)[0]
    repo.delete("a")
    report = repo.gc()
    assert report.chunks_deleted == 1  # a's own memory chunk (its small files are b's too)
    assert len(list(backend.list("index"))) == 1
    assert held_garbage not in set(backend.list("packs"))  # deleted, its other chunks copied first
    assert garbage not in repo.stored_chunks()
    assert set(repo.manifest("b").chunk_ids()) <= repo.stored_chunks()
    reader.read("b", tmp_path / "out")  # its places are stale: it reads the indexes again
    assert same_files(tmp_path / "b", tmp_path / "out")
    assert repo.gc().chunks_deleted == 0
    assert len(list(backend.list("index"))) == 1


def test_gc_removes_packs_no_index_names(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend)
    repo.write("c", "job", write_image(tmp_path / "img", {BASE: _random(MiB)}), {})
    backend.store("packs/ab/" + "ab" * 16, b"a pack whose writer died before its index")
    repo.gc()
    assert "packs/ab/" + "ab" * 16 not in set(backend.list("packs"))
    repo.read("c", tmp_path / "out")


def test_gc_removes_the_temp_files_of_a_killed_writer_at_once_but_keeps_young_ones_elsewhere(
    tmp_path: Path,
) -> None:
    """gc holds the store exclusively, so no writer of packs, indexes or manifests runs: their temp files
    are leftovers whatever their age. Lock objects are written even during gc: a young one stays."""
    backend = FolderBackend(tmp_path / "objects")
    repo = Repository(backend)
    repo.write("c", "job", write_image(tmp_path / "img", {BASE: _random(MiB)}), {})
    root = tmp_path / "objects"
    pack_tmp = root / "packs" / "ab" / ".abab.1234abcd.tmp"  # a destager killed while writing a pack
    pack_tmp.parent.mkdir(parents=True, exist_ok=True)
    pack_tmp.write_bytes(b"half a pack")
    lock_tmp = root / "locks" / ".s-1234.tmp"
    lock_tmp.parent.mkdir(parents=True, exist_ok=True)
    lock_tmp.write_bytes(b"a lock being stored now")
    repo.gc()
    assert not pack_tmp.exists()
    assert lock_tmp.exists()
    repo.read("c", tmp_path / "out")


def test_a_store_of_format_1_is_read_and_collected(backend: Backend, tmp_path: Path) -> None:
    import json

    from torpor.core.store.format import chunk_name

    image = write_image(tmp_path / "img", {BASE: _random(2 * MiB)})
    Repository(backend).write("old", "job", image, {})
    Repository(backend).write("gone", "job", write_image(tmp_path / "gone", {BASE: _random(MiB)}), {})
    repo = Repository(backend)
    for chunk in repo.stored_chunks():  # as format 1 kept them: one object per chunk
        name, offset, length = repo.locate(chunk)
        backend.store(chunk_name(chunk), backend.load_into(name, memoryview(b""), offset, length))
    for name in [*backend.list("packs"), *backend.list("index")]:
        backend.delete(name)
    config = json.loads(backend.load("config"))
    backend.store("config", json.dumps({**config, "version": 1}).encode())
    repo = Repository(backend)
    repo.read("old", tmp_path / "out")
    assert same_files(image, tmp_path / "out")
    assert json.loads(backend.load("config"))["version"] == 2
    repo.delete("gone")
    assert repo.gc().chunks_deleted == 2
    assert repo.intact("old")


def test_gc_while_checkpoints_are_written_loses_nothing(backend: Backend, tmp_path: Path) -> None:
    repo = Repository(backend, workers=2)
    shared = _random(2 * MiB)
    repo.write("old", "job", write_image(tmp_path / "old", {BASE: shared}), {})
    repo.delete("old")  # its chunks are garbage now, and the writers below reuse them
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            image = write_image(tmp_path / f"w{i}", {BASE: shared, BASE + 8 * MiB: _random(MiB)})
            Repository(backend, workers=2).write(f"w{i}", f"job{i}", image, {})
        except BaseException as exc:
            errors.append(exc)

    def collector() -> None:
        try:
            for _ in range(4):
                Repository(backend).gc(timeout=60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=collector))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    repo.gc()
    for i in range(4):
        repo.read(f"w{i}", tmp_path / f"out{i}")
        assert same_files(tmp_path / f"w{i}", tmp_path / f"out{i}")


def _dump_in_progress(full: Path, folder: Path, written: int, entries: int) -> Path:
    """``full`` as CRIU leaves it mid-dump: ``written`` bytes of its pages file, its pagemap's head and
    first ``entries`` entries (CRIU flushes the pagemap a few KiB at a time, behind the pages)."""
    folder.mkdir()
    (folder / "pages-1.img").write_bytes((full / "pages-1.img").read_bytes()[:written])
    raw = (full / "pagemap-1.img").read_bytes()
    pos = 8
    for _ in range(1 + entries):
        pos += 4 + int.from_bytes(raw[pos : pos + 4], "little")
    (folder / "pagemap-1.img").write_bytes(raw[: pos + 3])  # and a few bytes of the next entry
    return folder


def _after(done: Callable[[], bool], limit: float = 10.0) -> Callable[[], bool]:
    """A ``finished`` for prestore: the dump "ends" once ``done()`` (or after ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    return lambda: done() or time.monotonic() > deadline


def test_chunks_stored_during_the_dump_are_used_only_for_the_very_same_piece(tmp_path: Path) -> None:
    backend = FolderBackend(tmp_path / "store")
    repo = Repository(backend)
    # a second mapping starts 512 KiB into a window: guessing that the first one goes on cuts it wrongly
    full = write_image(
        tmp_path / "full", {BASE: _random(3 * MiB), BASE + 64 * MiB + MiB // 2: _random(3 * MiB)}
    )
    dumping = _dump_in_progress(full, tmp_path / "dumping", written=5 * MiB, entries=1)
    prestored = Prestored()
    repo.prestore(dumping, prestored, finished=_after(lambda: len(prestored.pieces) >= 4))
    # the first mapping's three windows, and one guessed window of the second (the last one is left)
    assert sorted(prestored.pieces) == [("pages-1.img", n * MiB, MiB) for n in range(4)]
    manifest = repo.write("c", "job", full, {}, prestored=prestored)
    assert manifest.sizes["prestored"] == 3 * MiB
    repo.read("c", tmp_path / "out")
    assert same_files(full, tmp_path / "out")
    assert repo.gc().chunks_deleted == 1  # the chunk of the wrong guess


@pytest.mark.parametrize("cache", [False, True], ids=["checkpoint", "hibernation"])
def test_chunks_stored_during_the_dump_go_around_the_page_cache_unless_asked(
    tmp_path: Path, cache: bool
) -> None:
    """What a dump stores before it ends is kept as the rest of its image will be: a checkpoint's
    around the page cache (its RAM copy is what a restore reads), a hibernation's in it."""
    if not evict_from_memory(tmp_path):
        pytest.skip(f"{tmp_path} is a file system in memory")
    repo = Repository(FolderBackend(tmp_path / "store"))
    full = write_image(tmp_path / "full", {BASE: _random(4 * MiB)})
    prestored = Prestored()
    dumping = _dump_in_progress(full, tmp_path / "dumping", 4 * MiB, 1)
    repo.prestore(dumping, prestored, _after(lambda: len(prestored.pieces) >= 3), cache=cache)
    chunks = {chunk for chunk, _ in prestored.pieces.values() if chunk}
    assert len(chunks) == 3
    assert chunks_cached_share(repo, chunks) == (1.0 if cache else 0.0)


def test_a_chunk_stored_during_the_dump_then_lost_is_stored_again(tmp_path: Path) -> None:
    backend = FolderBackend(tmp_path / "store")
    repo = Repository(backend)
    full = write_image(tmp_path / "full", {BASE: _random(4 * MiB)})
    prestored = Prestored()
    dumping = _dump_in_progress(full, tmp_path / "dumping", 4 * MiB, 1)
    repo.prestore(dumping, prestored, _after(lambda: len(prestored.pieces) >= 3))  # the last piece is left
    lost, _ = prestored.pieces[("pages-1.img", 0, MiB)]
    assert lost is not None
    assert repo.gc().chunks_deleted == 3  # e.g. gc ran between the dump and the write
    manifest = repo.write("c", "job", full, {}, prestored=prestored)
    assert manifest.sizes["prestored"] == 0
    repo.read("c", tmp_path / "out")
    assert same_files(full, tmp_path / "out")
