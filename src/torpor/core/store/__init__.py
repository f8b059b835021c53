"""The image store: where CRIU images are kept, behind :class:`ImageStore`.

The engine hands the store a complete image folder and later asks for a verified copy back; it never
knows how images are kept. Modules, bottom up (one activity each, as in borg/borgstore)::

    config.py       the state directory's store configuration: cold tier, key, retention
    backend.py      named immutable objects on a folder (here) or S3 (adapters/s3.py)
    objects.py      the envelope of a stored object: hash, zstd, AES-GCM
    pagemap.py      where CRIU's pages lie in the address space, for chunking
    manifest.py     one checkpoint: files as lists of chunks
    lock.py         writers vs gc, across nodes
    repository.py   the cold tier: chunk, dedupe, store, verify, gc
    hot.py          the hot tier in RAM
    destager.py     the background process between the two
    lazy.py         a checkpoint's memory served page by page, for lazy restores
    tiered.py       the ImageStore the engine uses
"""

from __future__ import annotations

from torpor.core.store.base import (
    DESTAGING,
    DURABLE,
    STAGED,
    Check,
    GcResult,
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
