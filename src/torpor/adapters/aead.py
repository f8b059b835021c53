"""Authenticated encryption (AES-256-GCM) for stored objects, through ``cryptography``.

The store decides what is encrypted and with which associated data; this module only seals and opens,
and turns the library's failures into torpor errors.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from torpor.errors import CorruptImage

NONCE_SIZE = 12
TAG_SIZE = 16


class Aead:
    """AES-256-GCM with a random 96-bit nonce per object (sealed = nonce + ciphertext + tag)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("AES-256-GCM needs a 32-byte key")
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, associated: bytes) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._aead.encrypt(nonce, plaintext, associated)

    def open(self, sealed: bytes | memoryview, associated: bytes, what: str) -> bytes:
        if len(sealed) < NONCE_SIZE + TAG_SIZE:
            raise CorruptImage(f"{what} is truncated")
        try:
            return self._aead.decrypt(sealed[:NONCE_SIZE], sealed[NONCE_SIZE:], associated)
        except InvalidTag as exc:
            raise CorruptImage(f"{what} fails authentication (corrupt, or sealed with another key)") from exc
