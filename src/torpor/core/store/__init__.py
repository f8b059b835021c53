"""The image store: where finished CRIU image folders are kept, behind :class:`ImageStore`.

The engine hands the store a complete image folder and later asks for a verified copy back; it never
knows how images are kept. :func:`open_store` picks the implementation for a state directory.
"""

from __future__ import annotations

from pathlib import Path

from torpor.core.store.base import ImageStore, StoredImage
from torpor.core.store.folder import FolderStore

__all__ = ["FolderStore", "ImageStore", "StoredImage", "open_store"]


def open_store(images_dir: Path) -> ImageStore:
    return FolderStore(images_dir)
