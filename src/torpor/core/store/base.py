"""The contract every image store keeps (invariants 2 and 4 of DESIGN.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class StoredImage:
    checkpoint_id: str
    job: str
    size_bytes: int  # bytes of the CRIU image as dumped (logical size)
    stored_bytes: int  # bytes the store spends on it


class ImageStore(Protocol):
    def staging_dir(self, checkpoint_id: str) -> Path:
        """A new empty folder for CRIU to dump into, placed so that :meth:`put` is cheap."""

    def put(self, checkpoint_id: str, job: str, image_dir: Path) -> StoredImage:
        """Take ownership of a complete image folder (it is moved or consumed on success).

        The image becomes visible only when complete: a crash at any moment leaves it absent or whole.
        On failure ``image_dir`` is left as it was (the caller may still restore from it) and
        :class:`~torpor.errors.StorageFull` says when there was no room.
        """

    def discard(self, image_dir: Path) -> None:
        """Remove a staging folder that will not be put (a failed dump, or a put that failed)."""

    def get(self, checkpoint_id: str, dest: Path) -> None:
        """Write the image's files into the empty folder ``dest``, each verified against its hash.

        Raises :class:`~torpor.errors.CorruptImage` on a mismatch and
        :class:`~torpor.errors.CheckpointNotFound` if there is no such image.
        """

    def list(self) -> list[StoredImage]:
        """Every complete image."""

    def delete(self, checkpoint_id: str) -> None:
        """Forget an image; deleting one that does not exist is not an error."""
