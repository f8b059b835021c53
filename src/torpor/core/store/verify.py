"""Checking what is read back against its content hash (invariant 4 of DESIGN.md).

Two checks: one chunk's stored object as it is decoded (:func:`chunk_plaintext`: present, authentic,
hashed to its name, of its size), and files already on disk against their manifest entries, extent by
extent (:func:`verify_extents`: for images restored with their memory left unverified until CRIU reads
it). Both raise :class:`~torpor.errors.CorruptImage` naming the checkpoint and the place; what to do
about a damaged checkpoint is the caller's decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torpor.core.store.chunking import all_zero, over_mapping
from torpor.core.store.format import DEFAULT_CHUNK_SIZE
from torpor.core.store.manifest import ChunkId, FileEntry
from torpor.core.store.objects import KIND_CHUNK, Codec
from torpor.errors import CorruptImage, ObjectNotFound


def chunk_plaintext(
    codec: Codec,
    load: Callable[[str, memoryview], bytes | memoryview],
    checkpoint_id: str,
    chunk: str,
    length: int,
    place: str | None,
    verify: bool,
    buffer: memoryview,
) -> bytes | memoryview:
    """The plaintext of ``chunk`` of a checkpoint, as ``load`` gives its stored object (into ``buffer``
    where it can), checked: present, intact, hashed to its name unless not ``verify``, of ``length`` bytes.

    Raises CorruptImage saying which checkpoint is damaged and where (``place``, e.g. ``pages-1.img at
    offset 4096``).
    """
    what = f"{place}: chunk {chunk[:16]}…" if place else f"chunk {chunk[:16]}… of checkpoint {checkpoint_id}"
    try:
        blob = load(chunk, buffer)
    except ObjectNotFound as exc:
        raise CorruptImage(f"checkpoint {checkpoint_id} is damaged: its {what} is missing") from exc
    try:
        data = codec.decode(KIND_CHUNK, blob, what, bytes.fromhex(chunk), verify=verify)
    except CorruptImage as exc:
        raise CorruptImage(f"checkpoint {checkpoint_id} is damaged: {exc.message}") from exc
    if len(data) != length:
        raise CorruptImage(f"checkpoint {checkpoint_id} is damaged: {what} has the wrong size")
    return data


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
            good = all(all_zero(data[at : at + len(zero)], zero) for at in range(0, length, len(zero)))
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
                    over_mapping(pool, folder / entry.name, entry.size, one, calls)
                ) as run:
                    for _ in run:
                        pass
            except OSError as exc:
                raise CorruptImage(
                    f"checkpoint {checkpoint_id}: cannot read {entry.name} to verify it ({exc.strerror})"
                ) from exc
