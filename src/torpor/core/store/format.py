"""The cold tier's own ``config`` object: which format a store is in, its chunk size and its key check.

Opening a store reads this object first (creating it for a new store), turns a store of format 1 into
format 2 (format 2 still reads format 1's one-object-per-chunk layout; format 1 cannot read packs), and
refuses a store of another format, or a key that is not the store's. Not to be confused with
:mod:`.config`, the state directory's configuration of *which* store to use; what is in the objects is
left to :mod:`.packs` and :mod:`.manifest`.
"""

from __future__ import annotations

import json

from torpor.core.store.backend import Backend
from torpor.core.store.objects import Codec
from torpor.errors import KeyProblem, ObjectNotFound, StoreError

STORE_FORMAT = "torpor-store"
#: 2: chunks in packs; 1: one object per chunk (read still, and turned into 2 by the first open)
STORE_VERSION = 2
DEFAULT_CHUNK_SIZE = 1 << 20
#: a pack is closed once it holds this many bytes
DEFAULT_PACK_SIZE = 32 << 20


def chunk_name(chunk: str) -> str:
    """The object of one chunk in a store of format 1."""
    return f"chunks/{chunk[:2]}/{chunk}"


def open_config(backend: Backend, codec: Codec, chunk_size: int) -> int:
    """Read the store's config (creating the store if it is new) and check ``codec``'s key against it.

    A new store gets ``chunk_size``; returns the store's chunk size.
    """
    backend.create()
    try:
        config = json.loads(backend.load("config"))
    except ObjectNotFound:
        config = {
            "format": STORE_FORMAT,
            "version": STORE_VERSION,
            "chunk_size": chunk_size,
            "encryption": "aes-256-gcm" if codec.encrypted else None,
            "key_check": codec.key_check,
        }
        backend.store("config", json.dumps(config).encode())
        backend.sync()
    except ValueError as exc:
        raise StoreError(f"the config of the store {backend.url} is unreadable") from exc
    if not isinstance(config, dict) or config.get("format") != STORE_FORMAT:
        raise StoreError(f"{backend.url} is not a torpor store")
    if config.get("version") == 1:  # format 2 reads 1's chunks; 1 cannot read 2's packs
        config["version"] = STORE_VERSION
        backend.store("config", json.dumps(config).encode())
        backend.sync()
    if config.get("version") != STORE_VERSION:
        raise StoreError(
            f"the store {backend.url} has format {config.get('version')}; this torpor reads {STORE_VERSION}"
        )
    if config.get("encryption") and not codec.encrypted:
        raise KeyProblem(
            f"the store {backend.url} is encrypted: set its key file with 'torpor store set --key-file FILE'"
        )
    if not config.get("encryption") and codec.encrypted:
        raise KeyProblem(
            f"a key file is configured but the store {backend.url} is not encrypted; unset "
            "it with 'torpor store set --no-key', or use a new store ('--url')"
        )
    if config.get("key_check") != codec.key_check:
        raise KeyProblem(f"the configured key file is not the key of the store {backend.url}")
    return int(config.get("chunk_size", DEFAULT_CHUNK_SIZE))
