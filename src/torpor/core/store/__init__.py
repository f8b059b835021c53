"""The image store: where CRIU images are kept, behind :class:`ImageStore`.

The engine hands the store a complete image folder and later asks for a verified copy back; it never
knows how images are kept. Modules, bottom up (one activity each, as in borg/borgstore)::

    base.py         the ImageStore contract, image states
    config.py       the state directory's store configuration: cold tier, key, retention
    backend.py      the Backend protocol; a folder (adapters/folder.py) or S3 (adapters/s3.py) by URL
    objects.py      the envelope of a stored object: hash, zstd, AES-GCM
    pagemap.py      where CRIU's pages lie in the address space, for chunking
    manifest.py     one checkpoint: files as lists of chunks
    lock.py         writers vs gc, across nodes
    format.py       the cold tier's config object: format version, chunk size, key check
    chunking.py     cutting an image into chunks
    packs.py        packs, indexes, where each chunk lies
    writing.py      the write path of the cold tier
    prestore.py     storing a dump while CRIU writes it; precopy
    reading.py      reading a checkpoint back
    verify.py       bytes read back against their hashes
    gc.py           removing what no checkpoint names
    repository.py   the cold tier: a facade over the eight above
    hot.py          the hot tier in RAM
    destager.py     the background process between the two
    lazy.py         a checkpoint's memory served page by page, for lazy restores
    transfer.py     a checkpoint sent to another store (another key): only the chunks it lacks
    tiered.py       the ImageStore the engine uses
"""

from __future__ import annotations

from torpor.core.store.base import (
    DESTAGING,
    DURABLE,
    STAGED,
    Check,
    GcResult,
    ImageState,
    ImageStore,
    PageSource,
    PageStream,
    RestoreSource,
    StoredImage,
)
from torpor.core.store.config import StoreConfig
from torpor.core.store.hot import HotTier
from torpor.core.store.tiered import TieredStore, open_cold_tier
from torpor.settings import Settings

__all__ = [
    "DESTAGING",
    "DURABLE",
    "STAGED",
    "Check",
    "GcResult",
    "ImageState",
    "ImageStore",
    "PageSource",
    "PageStream",
    "RestoreSource",
    "StoreConfig",
    "StoredImage",
    "TieredStore",
    "open_cold_tier",
    "open_store",
    "remove_hot_tier",
]


def open_store(settings: Settings) -> ImageStore:
    return TieredStore(settings)


def remove_hot_tier(settings: Settings) -> None:
    """Delete the RAM hot tier of ``settings`` (it lives outside the state directory), mount and all."""
    HotTier(settings.hot_path, own_mount=settings.hot_dir is None).remove_all()
