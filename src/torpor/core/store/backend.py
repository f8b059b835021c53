"""Backends: flat namespaces of named, immutable objects — the one seam between the store and storage.

A backend knows nothing of chunks, manifests or encryption; it stores bytes under names like
``packs/ab/ab12…`` and gives them back, whole or a range of them. Every backend keeps the same small
contract (checked by one contract test suite, ``tests/store/test_backends.py``):

* ``store`` is atomic: a reader sees the old object, no object, or the whole new one — never a part;
  once ``sync`` returns, every object stored before it survives a crash;
* ``writer`` writes one object in parts, for objects built as they go (pack files); it is as atomic as
  ``store``: the object appears whole at ``commit``, or not at all;
* ``load`` of a missing object raises :class:`~torpor.errors.ObjectNotFound`; ``load_into`` gives the
  same bytes, or a range of them, as a part of the caller's buffer (a memoryview) where the backend read
  them into it, or as new bytes; a range past the end gives fewer bytes (the caller verifies them);
* ``delete`` of a missing object is not an error;
* ``list(folder)`` yields every object name under ``folder/`` (recursively), in no particular order;
* failures are torpor errors (:class:`~torpor.errors.StorageFull` when there is no room), with the
  original exception as the cause.

:class:`Backend` is the store's seam, so it lives here, with the store; the backends themselves touch
storage, so they are adapters: a folder (:mod:`torpor.adapters.folder`) and S3
(:mod:`torpor.adapters.s3`), which share the rule for object names (:mod:`torpor.adapters.objectstore`).
This module also picks one from a store URL.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from torpor.adapters.folder import FolderBackend
from torpor.errors import UsageError

#: for :meth:`Backend.load_into`: new bytes, always
NO_BUFFER = memoryview(b"")


class Backend(Protocol):
    """A flat namespace of named, immutable objects (a folder, an S3 prefix): all the store needs of storage."""

    url: str
    #: each load is a round trip over a network: worth asking for many objects at once
    remote: bool

    def create(self) -> None:
        """Make the container (folder, bucket prefix) if it is missing; idempotent."""

    def store(self, name: str, *parts: bytes | memoryview) -> None:
        """Write object ``name``, the concatenation of ``parts``, atomically (replacing any of that name)."""

    def load(self, name: str) -> bytes:
        """The bytes of object ``name``."""

    def load_into(
        self, name: str, buffer: memoryview, offset: int = 0, length: int = -1
    ) -> memoryview | bytes:
        """``length`` bytes of object ``name`` from ``offset`` (-1: to its end): the front of ``buffer``
        if they were read into it, else new bytes; fewer where the object ends sooner."""

    def in_memory(self, name: str, offset: int, length: int) -> float:
        """The share of these bytes of object ``name`` that a load would get without waiting for a disk
        or a network (a folder's file in the page cache): 0.0 to 1.0, 0.0 when unsure. Never fails."""

    def writer(self, name: str, cache: bool = True) -> ObjectWriter:
        """A new object ``name``, written in parts; it exists once :meth:`ObjectWriter.commit` returns.

        ``cache=False``: nothing will read it soon, so a backend with a cache of its own (a folder's page
        cache) may write it around that cache."""

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...

    def list(self, folder: str) -> Iterator[str]:
        """Names of all objects under ``folder/``, as full names (``folder/...``)."""

    def sync(self) -> None:
        """Make every object stored so far durable."""

    def remove_leftovers(self, min_age_s: float = 3600.0, idle: Collection[str] = ()) -> int:
        """Delete what a crash left behind mid-``store`` (for gc); returns how many.

        Under the top folders named in ``idle`` nobody writes now (gc holds the store): everything
        there; elsewhere only what is older than ``min_age_s``. A backend whose stores leave nothing
        behind returns 0.
        """

    def close(self) -> None: ...


class ObjectWriter(Protocol):
    """An object written in parts; it exists, whole, only once :meth:`commit` returns."""

    def write(self, *parts: bytes | memoryview) -> None:
        """Append ``parts`` (the caller may reuse their memory once this returns)."""

    def commit(self) -> None:
        """Make the object appear, whole, under its name (durable after the backend's next ``sync``)."""

    def abort(self) -> None:
        """Drop what was written; idempotent, and harmless after ``commit``."""


def normalize_url(url: str) -> str:
    """The one spelling of a store URL: an absolute folder path, or ``s3://BUCKET[/PREFIX]``.

    Raises UsageError for what no backend can open (so a bad URL is refused where it is set).
    """
    parts = urlsplit(url.strip())
    if parts.scheme in ("", "file"):
        path = parts.path if parts.scheme else url.strip()
        if not path:
            raise UsageError("a folder store needs a folder: a path or file:///PATH")
        return str(Path(path).absolute())
    if parts.scheme == "s3":
        if not parts.netloc:
            raise UsageError("an S3 store URL needs a bucket: s3://BUCKET[/PREFIX]")
        prefix = parts.path.strip("/")
        return f"s3://{parts.netloc}/{prefix}" if prefix else f"s3://{parts.netloc}"
    raise UsageError(
        f"unsupported store URL scheme '{parts.scheme}://': use a folder path, file:///PATH or s3://BUCKET/PREFIX"
    )


def open_backend(url: str, *, s3_endpoint: str | None = None, workers: int = 8) -> Backend:
    """A backend for ``url``: a path or ``file://PATH`` (a folder), or ``s3://BUCKET[/PREFIX]``."""
    url = normalize_url(url)
    if not url.startswith("s3://"):
        return FolderBackend(Path(url))
    from torpor.adapters.s3 import S3Backend

    parts = urlsplit(url)
    return S3Backend(bucket=parts.netloc, prefix=parts.path.strip("/"), endpoint=s3_endpoint, workers=workers)
