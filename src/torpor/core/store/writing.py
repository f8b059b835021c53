"""The write path of the cold tier: an image folder in, its chunks stored once each, its manifest last.

Each file of the image is cut into chunks (:mod:`.chunking`), hashed straight from a mapping of the hot
tier's pages, and each chunk the store lacks goes into a pack (:mod:`.packs`); all-zero chunks are not
stored at all. Only when every chunk is durable is the manifest stored (invariant 2 of DESIGN.md).
What a dump stored ahead of this (:mod:`.prestore`) is used where it is the very same chunk.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torpor.core.store.chunking import ProgressFn, merge_zeros, no_progress, over_mapping, plan_image
from torpor.core.store.lock import SHARED
from torpor.core.store.manifest import Extent, FileEntry, Manifest
from torpor.core.store.objects import KIND_MANIFEST
from torpor.core.store.prestore import Prestored, still_valid
from torpor.errors import StoreError

if TYPE_CHECKING:
    from torpor.core.store.repository import Repository


def write_image(
    repo: Repository,
    checkpoint_id: str,
    job: str,
    image_dir: Path,
    meta: Mapping[str, Any],
    progress: ProgressFn = no_progress,
    skip: Callable[[str], bool] = lambda _: False,
    prestored: Prestored | None = None,
    cache: bool = True,
) -> Manifest:
    """Store the image in ``image_dir`` as checkpoint ``checkpoint_id``; the manifest goes last.

    ``prestored``: what :meth:`~torpor.core.store.repository.Repository.prestore` did while CRIU wrote
    this image. ``cache=False``: nothing will read the chunks back soon (the image stays in RAM), so
    they may be written around the backend's cache (:meth:`Backend.writer`). A file of the image that
    vanished raises FileNotFoundError (the image was deleted meanwhile).
    """
    prestored = still_valid(prestored or Prestored(), image_dir)
    try:
        repo.open()
        started = time.monotonic()
        plans = plan_image(image_dir, repo.chunk_size, skip)
        total = sum(plan.size for plan in plans)
        guard = threading.Lock()
        counters = {"done": 0, "zero": 0, "new_chunks": 0, "new_bytes": 0, "prestored": 0, "from_memory": 0}
        from_memory = dict(prestored.memory)

        with repo.lock.hold(SHARED, timeout=600) as held:
            storer = repo.storer(cache)

            def one(view: memoryview, name: str, offset: int, length: int) -> Extent:
                data = view[offset : offset + length]
                if len(data) != length:
                    raise StoreError(f"{image_dir} changed while it was being stored")
                ahead = prestored.pieces.get((name, offset, length))
                if ahead is not None and (ahead[0] is None or ahead[0] in storer.known):
                    chunk, new = ahead  # the same bytes, hashed (and stored) while CRIU wrote them
                else:
                    ahead = None
                    chunk, new = storer.store(data)
                with guard:
                    if not new and chunk in from_memory:  # stored from the stopped process ahead of it
                        new = from_memory.pop(chunk)  # new for this checkpoint all the same
                        counters["from_memory"] += length
                    if ahead is not None:
                        counters["prestored"] += length
                    counters["done"] += length
                    if chunk is None:
                        counters["zero"] += length
                    if new:
                        counters["new_chunks"] += 1
                        counters["new_bytes"] += new
                return (offset, length, chunk)

            files: list[FileEntry] = []
            last_report = 0.0
            with storer, ThreadPoolExecutor(repo.workers, thread_name_prefix="destage") as pool:
                for plan in plans:
                    # mapped, not read: the chunks are hashed, compressed and written from the hot tier's
                    # pages without a copy
                    extents: list[Extent] = []
                    calls = [(plan.name, offset, length) for offset, length in plan.pieces]
                    results = over_mapping(pool, image_dir / plan.name, plan.size, one, calls)
                    with contextlib.closing(results):
                        for extent in results:
                            extents.append(extent)
                            now = time.monotonic()
                            if now - last_report > 0.2:
                                last_report = now
                                progress(counters["done"], total)
                                held.refresh()
                    files.append(FileEntry(plan.name, plan.size, tuple(merge_zeros(extents))))
            syncing = time.monotonic()
            repo.backend.sync()  # every chunk durable before the manifest names it
            sync_s = time.monotonic() - syncing
            chunks = [c for f in files for _, _, c in f.extents if c is not None]
            manifest = Manifest(
                id=checkpoint_id,
                job=job,
                created_at=float(meta.get("created_at") or time.time()),
                files=tuple(files),
                chunk_size=repo.chunk_size,
                kernel=os.uname().release,
                meta=dict(meta),
                sizes={
                    "logical": total,
                    "zero": counters["zero"],
                    "chunks": len(chunks),
                    "unique_chunks": len(set(chunks)),
                    "new_chunks": counters["new_chunks"],
                    "new_bytes": counters["new_bytes"],
                    "prestored": counters["prestored"],
                    "from_memory": counters["from_memory"],
                    "destage_s": round(time.monotonic() - started, 4),
                    "sync_s": round(sync_s, 4),
                },
            )
            repo.backend.store(
                f"manifests/{checkpoint_id}", repo.codec.encode(KIND_MANIFEST, manifest.to_bytes())
            )
            repo.backend.sync()
        progress(total, total)
        return manifest
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StoreError(f"cannot read the image in {image_dir}: {exc.strerror or exc}") from exc
