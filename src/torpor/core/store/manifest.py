"""The manifest of one checkpoint: what the image is and which chunks rebuild each of its files.

Written last and atomically (it is one object), so a checkpoint is listed only when every chunk it names
is stored (invariant 2). A manifest read back is validated before anything is written from it: names are
plain file names, extents are in bounds and contiguous, chunk ids are hex digests — a malicious or corrupt
manifest cannot write outside the restore folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NewType

from torpor.errors import CorruptImage, StoreError

FORMAT = "torpor-checkpoint"
VERSION = 1

_HEX = re.compile(r"^[0-9a-f]{64}$")

#: a chunk's name: the hex digest of its plaintext (see objects.py)
ChunkId = NewType("ChunkId", str)
#: (offset in the file, length, chunk id — or None: all zeros, nothing stored)
Extent = tuple[int, int, ChunkId | None]


@dataclass(frozen=True)
class FileEntry:
    """One file of an image: its name, size, and the chunks (or zero runs) that rebuild it."""

    name: str
    size: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class Manifest:
    """One checkpoint in the cold tier: what the image is and how to rebuild each file; stored last."""

    id: str
    job: str
    created_at: float
    files: tuple[FileEntry, ...]
    chunk_size: int
    kernel: str
    #: what the engine said about the checkpoint: parent, CRIU version, job spec, timings
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: logical bytes, zero bytes, chunk counts, bytes newly stored, destage timings
    sizes: Mapping[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.files)

    def chunk_ids(self) -> Iterator[ChunkId]:
        for entry in self.files:
            for _, _, chunk in entry.extents:
                if chunk is not None:
                    yield chunk

    def to_bytes(self) -> bytes:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "id": self.id,
            "job": self.job,
            "created_at": self.created_at,
            "chunk_size": self.chunk_size,
            "kernel": self.kernel,
            "meta": dict(self.meta),
            "sizes": dict(self.sizes),
            "files": [
                {"name": e.name, "size": e.size, "extents": [list(x) for x in e.extents]} for e in self.files
            ],
        }
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview, what: str) -> Manifest:
        try:
            data = json.loads(bytes(raw))
        except ValueError as exc:
            raise CorruptImage(f"{what} is not valid JSON") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CorruptImage(f"{what} is not a torpor checkpoint manifest")
        if data.get("version") != VERSION:
            raise StoreError(
                f"{what} has format version {data.get('version')}; this torpor reads version {VERSION}"
            )
        try:
            files = tuple(_file_entry(item) for item in data["files"])
            names = [entry.name for entry in files]
            if len(set(names)) != len(names):
                raise ValueError("a file is listed twice")
            return cls(
                id=_str(data["id"]),
                job=_str(data["job"]),
                created_at=float(data["created_at"]),
                files=files,
                chunk_size=int(data["chunk_size"]),
                kernel=str(data.get("kernel", "")),
                meta=dict(data.get("meta") or {}),
                sizes=dict(data.get("sizes") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptImage(f"{what} is malformed ({exc})") from exc


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def safe_file_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def _file_entry(item: Any) -> FileEntry:
    name = _str(item["name"])
    if not safe_file_name(name) or name.startswith("."):
        raise ValueError(f"bad file name {name!r}")
    size = int(item["size"])
    extents: list[Extent] = []
    position = 0
    for raw in item["extents"]:
        offset, length, chunk = raw
        if not isinstance(offset, int) or not isinstance(length, int) or offset != position or length <= 0:
            raise ValueError(f"{name}: extents are not contiguous")
        if chunk is not None and (not isinstance(chunk, str) or not _HEX.match(chunk)):
            raise ValueError(f"{name}: bad chunk id {chunk!r}")
        extents.append((offset, length, ChunkId(chunk) if chunk is not None else None))
        position += length
    if position != size or size < 0:
        raise ValueError(f"{name}: extents cover {position} of {size} bytes")
    return FileEntry(name, size, tuple(extents))
