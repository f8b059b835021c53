"""The envelope every stored object wears: magic, version, flags, size, content hash; compressed, sealed.

::

    "TPR1" | flags u8 | kind u8 | reserved u16 | plaintext size u64 | digest 32 bytes | payload

``digest`` is BLAKE3 of the plaintext — keyed with a key derived from the encryption key when the store
is encrypted, so that chunk names reveal nothing about memory contents to whoever can list the bucket.
The payload is the plaintext, zstd-compressed (level -1) when that saves at least 12.5 %, then, when
encrypted, sealed with AES-256-GCM with the header as associated data (a header cannot be swapped or
edited).

:meth:`Codec.decode` checks everything: magic, sizes, authentication, and the digest of the plaintext —
against the object's name for chunks (invariant 4 of DESIGN.md: every byte read back is verified).
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import blake3
import zstandard

from torpor.adapters.aead import Aead
from torpor.errors import CorruptImage, KeyProblem

MAGIC = b"TPR1"
HEADER = struct.Struct("<4sBBHQ32s")
FLAG_ZSTD = 1
FLAG_SEALED = 2

KIND_CHUNK = 1
KIND_MANIFEST = 2
KIND_CONFIG = 3
KIND_INDEX = 4

#: store compressed only when it saves at least this fraction (an eighth, as ZFS requires of a block).
#: A trained model's weights save 5-10 % at zstd's level 1: stored raw,
#: their destaging skips most of its compressing (a training checkpoint's destager: 2.2-3.0 s of CPU
#: instead of 3.3-3.9 s here, durable 0.3-0.4 s sooner) and their restore all of its decompressing,
#: for ~8 % more bytes on the disk.
_MIN_SAVING = 0.125
#: bytes compressed first to tell whether compressing the whole object is worth it
_PROBE = 16 << 10
#: zstd's level: -1 (``zstd --fast=1``), which finds repeats (runs of zeros most of all) but leaves the
#: other bytes as they are, as borg's default lz4 does. A training checkpoint's destaging, level 1 against
#: -1 against not compressing at all: durable 2.90 s, 2.26 s, 2.22 s (medians of 4, alternated, on 2
#: cores); 379 MiB, 334 MiB, nothing saved of its 1.5 GiB
_LEVEL = -1


def read_key_file(path: Path) -> bytes:
    """A key file holds 32 random bytes, raw or as 64 hex digits (``head -c 32 /dev/urandom > KEY``)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise KeyProblem(
            f"the key file {path} does not exist; create one with 'head -c 32 /dev/urandom > {path}' "
            "and keep a copy: without it no checkpoint can be restored"
        ) from exc
    except OSError as exc:
        raise KeyProblem(f"cannot read the key file {path}: {exc.strerror}") from exc
    if len(raw) == 32:
        return raw
    text = raw.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise KeyProblem(f"the key file {path} must hold 32 bytes (or 64 hex digits); it has {len(raw)} bytes")


class Codec:
    """Turns plaintext into stored objects and back, for one store (one key, or none)."""

    def __init__(self, key: bytes | None = None, level: int = _LEVEL) -> None:
        self.encrypted = key is not None
        self._level = level
        self._local = threading.local()
        if key is None:
            self._id_key: bytes | None = None
            self._aead: Aead | None = None
        else:
            self._id_key = blake3.blake3(key, derive_key_context="torpor 2026-11 object id").digest()
            self._aead = Aead(blake3.blake3(key, derive_key_context="torpor 2026-11 aes-256-gcm").digest())

    @property
    def key_check(self) -> str | None:
        """A value stored in the store's config that tells whether a key is the store's key."""
        if self._id_key is None:
            return None
        return str(blake3.blake3(b"torpor key check", key=self._id_key).hexdigest()[:32])

    def digest(self, data: bytes | memoryview) -> bytes:
        if self._id_key is None:
            return bytes(blake3.blake3(data).digest())
        return bytes(blake3.blake3(data, key=self._id_key).digest())

    def _zstd(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        pair: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(
            self._local, "pair", None
        )
        if pair is None:
            pair = (zstandard.ZstdCompressor(level=self._level), zstandard.ZstdDecompressor())
            self._local.pair = pair
        return pair

    def encode(self, kind: int, data: bytes | memoryview, digest: bytes | None = None) -> bytes:
        """The stored form of ``data`` (``digest``: its :meth:`digest`, when the caller has it)."""
        return b"".join(self.encode_parts(kind, data, digest))

    def encode_parts(
        self, kind: int, data: bytes | memoryview, digest: bytes | None = None
    ) -> tuple[bytes, bytes | memoryview]:
        """:meth:`encode` as (header, payload), so a backend can write them without joining (a copy)."""
        digest = digest or self.digest(data)
        flags = 0
        payload: bytes | memoryview = data
        compressor = self._zstd()[0]
        # a cheap probe first: random memory (most of a trained model) does not compress, and zstd on
        # all of it would cost more than everything else the destager does
        probe = data[:_PROBE]
        if len(data) <= _PROBE or len(compressor.compress(probe)) <= len(probe) * (1 - _MIN_SAVING):
            compressed = compressor.compress(data)
            if len(compressed) <= len(data) * (1 - _MIN_SAVING):
                payload, flags = compressed, FLAG_ZSTD
        if self._aead is not None:
            flags |= FLAG_SEALED
            header = HEADER.pack(MAGIC, flags, kind, 0, len(data), digest)
            return header, self._aead.seal(bytes(payload), header)
        return HEADER.pack(MAGIC, flags, kind, 0, len(data), digest), payload

    def decode(
        self, kind: int, blob: bytes | memoryview, what: str, expect: bytes | None = None, verify: bool = True
    ) -> bytes | memoryview:
        """The verified plaintext of a stored object; ``expect``: the digest its name promises.

        ``verify=False`` skips hashing the plaintext: for a caller that hashes it later, where it put
        it (a restore verifies the pages CRIU reads while CRIU already reads them).
        """
        if len(blob) < HEADER.size:
            raise CorruptImage(f"{what} is truncated ({len(blob)} bytes)")
        magic, flags, got_kind, _, size, digest = HEADER.unpack_from(blob)
        if magic != MAGIC or got_kind != kind:
            raise CorruptImage(f"{what} is not a torpor object of the expected kind")
        if expect is not None and digest != expect:
            raise CorruptImage(f"{what} does not carry the hash its name promises")
        payload: bytes | memoryview = memoryview(blob)[HEADER.size :]  # no copy of a large chunk
        if flags & FLAG_SEALED:
            if self._aead is None:
                raise KeyProblem(
                    f"{what} is encrypted and no key is configured; set it with 'torpor store set --key-file FILE'"
                )
            payload = self._aead.open(payload, bytes(blob[: HEADER.size]), what)
        elif self._aead is not None:
            raise CorruptImage(f"{what} is not encrypted, but this store's objects must be")
        if flags & FLAG_ZSTD:
            try:
                payload = self._zstd()[1].decompress(payload, max_output_size=size)
            except zstandard.ZstdError as exc:
                raise CorruptImage(f"{what} does not decompress ({exc})") from exc
        if len(payload) != size or (verify and self.digest(payload) != digest):
            raise CorruptImage(f"{what} does not match its content hash")
        return payload
