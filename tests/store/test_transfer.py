"""core/store/transfer: a checkpoint sent from one cold tier to another that has its own key, on real
folder stores: what the receiver lacks is all that is sent, and it reads the checkpoint back intact."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pytest

from torpor.adapters.folder import FolderBackend
from torpor.core.store.repository import Repository
from torpor.core.store.transfer import Receiver, frames, parse
from torpor.errors import CorruptImage, StoreError

CHUNK = 1 << 20


def image(folder: Path, pages: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "pages-1.img").write_bytes(pages)
    (folder / "core-1.img").write_bytes(b"core of the job\n" * 100)
    return folder


def store(folder: Path) -> Repository:
    return Repository(FolderBackend(folder), key=os.urandom(32))


def joined(frames: Iterable[tuple[bytes, bytes | memoryview]]) -> bytes:
    """The body that carries ``frames``."""
    return b"".join(piece for frame in frames for piece in frame)


def send(source: Repository, receiver: Receiver, checkpoint_id: str) -> list[str]:
    """What a move does: the chunks the receiver lacks, then the manifest; the chunks sent."""
    manifest = source.manifest(checkpoint_id)
    lacking = receiver.missing(manifest.chunk_ids())
    receiver.take(joined(frames(source, manifest, lacking)))
    receiver.write_manifest(manifest.to_bytes(), checkpoint_id)
    return lacking


def test_only_what_the_receiver_lacks_is_sent_and_each_store_keeps_its_own_key(tmp_path: Path) -> None:
    pages = bytearray(os.urandom(6 * CHUNK)) + bytes(2 * CHUNK)  # the zeros are never stored nor sent
    source, peer = store(tmp_path / "a"), store(tmp_path / "b")
    source.write("c1", "job", image(tmp_path / "one", bytes(pages)), {})
    receiver = Receiver(peer)
    first = send(source, receiver, "c1")
    assert len(first) == len(set(source.manifest("c1").chunk_ids()))
    # the names differ (each store's own keyed digest): no chunk of one is named alike in the other
    assert not set(source.manifest("c1").chunk_ids()) & set(peer.manifest("c1").chunk_ids())
    pages[3 * CHUNK + 17] ^= 0xFF  # the job ran on and changed one page
    source.write("c2", "job", image(tmp_path / "two", bytes(pages)), {})
    second = send(source, receiver, "c2")
    assert len(second) == 1  # only the chunk that changed
    for checkpoint, expected in (("c1", tmp_path / "one"), ("c2", tmp_path / "two")):
        peer.read(checkpoint, tmp_path / f"back-{checkpoint}")
        for name in ("pages-1.img", "core-1.img"):
            assert (tmp_path / f"back-{checkpoint}" / name).read_bytes() == (expected / name).read_bytes()


def test_a_manifest_naming_chunks_never_sent_and_a_cut_frame_are_refused(tmp_path: Path) -> None:
    source, peer = store(tmp_path / "a"), store(tmp_path / "b")
    source.write("c1", "job", image(tmp_path / "one", os.urandom(3 * CHUNK)), {})
    manifest = source.manifest("c1")
    receiver = Receiver(peer)
    body = joined(frames(source, manifest, list(manifest.chunk_ids())[:1]))
    with pytest.raises(CorruptImage, match="cut short"):
        list(parse(body[:-1]))
    receiver.take(body)
    with pytest.raises(StoreError, match="were not sent here"):
        receiver.write_manifest(manifest.to_bytes(), "c1")
    assert not peer.has("c1")
    with pytest.raises(CorruptImage, match="is of c1"):
        receiver.write_manifest(manifest.to_bytes(), "c9")


def test_chunks_are_read_from_the_copy_in_ram_where_it_holds_them_and_from_the_store_where_not(
    tmp_path: Path,
) -> None:
    pages = os.urandom(4 * CHUNK)
    source = store(tmp_path / "a")
    copy = image(tmp_path / "copy", pages)
    source.write("c1", "job", copy, {})
    manifest = source.manifest("c1")
    chunks = sorted(set(manifest.chunk_ids()))
    expected = joined(frames(source, manifest, chunks))
    # the store's packs gone: the whole checkpoint still comes from the copy, verified
    packs = tmp_path / "a" / "packs"
    hidden = tmp_path / "packs-away"
    packs.rename(hidden)
    assert joined(frames(source, manifest, chunks, copy=copy)) == expected
    with pytest.raises(CorruptImage):
        joined(frames(source, manifest, chunks))
    hidden.rename(packs)
    # a copy whose bytes changed, or that lost a file, is read from the store instead, chunk by chunk
    with (copy / "pages-1.img").open("r+b") as changed:
        changed.seek(2 * CHUNK + 5)
        changed.write(b"\0")
    (copy / "core-1.img").unlink()
    assert joined(frames(source, manifest, chunks, copy=copy)) == expected
