"""Garbage collection of the cold tier: every chunk no manifest names goes, and the indexes merge into one.

It holds the store's lock exclusively (:mod:`.lock`): writers wait for it, and it waits for them. Which
checkpoints to delete before it runs (retention) is decided elsewhere; gc only removes what nothing
names any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torpor.core.store.backend import NO_BUFFER
from torpor.core.store.lock import EXCLUSIVE
from torpor.core.store.manifest import ChunkId
from torpor.core.store.packs import PackEntry, pack_name, read_index

if TYPE_CHECKING:
    from torpor.core.store.repository import Repository


@dataclass(frozen=True)
class GcReport:
    """What one :func:`gc` found: checkpoints, chunks kept and chunks deleted."""

    manifests: int
    chunks_kept: int
    chunks_deleted: int


def gc(repo: Repository, timeout: float = 120.0) -> GcReport:
    """Delete every chunk no manifest names; waits for writers, and writers wait for it.

    A pack whose chunks are all unreferenced is deleted; one holding some is rewritten with the
    others only. Then one index of every pack replaces all indexes. New packs and the new index are
    durable before anything is deleted, so a crash at any point loses no referenced chunk (it may
    leave duplicates or unindexed packs, which the next gc removes).
    """
    repo.open()
    with repo.lock.hold(EXCLUSIVE, timeout=timeout) as held:
        referenced: set[str] = set()
        ids = repo.ids()
        for checkpoint_id in ids:
            # a manifest that cannot be read aborts gc: its chunks must not be taken for garbage
            referenced.update(repo.manifest(checkpoint_id).chunk_ids())
            held.refresh()
        indexes = sorted(repo.backend.list("index"))
        present = {name.rsplit("/", 1)[-1] for name in repo.backend.list("packs")}
        kept_at: dict[ChunkId, tuple[str, int, int]] = {}  # referenced chunk -> (pack, offset, length)
        entries_of: dict[str, int] = {}  # pack -> its entries in all indexes
        for name in indexes:
            for chunk, pack, offset, length in read_index(repo.backend, repo.codec, name):
                entries_of[pack] = entries_of.get(pack, 0) + 1
                if chunk in referenced and chunk not in kept_at and pack in present:
                    kept_at[chunk] = (pack, offset, length)
            held.refresh()
        live: dict[str, list[PackEntry]] = {}
        for kept_chunk, (pack, offset, length) in kept_at.items():
            live.setdefault(pack, []).append((kept_chunk, offset, length))
        whole = {pack: entries for pack, entries in live.items() if len(entries) == entries_of[pack]}
        deleted = sum(entries_of.values()) - len(kept_at)
        if deleted or len(indexes) > 1 or present - set(whole):
            packs = repo.packs()
            try:
                for pack, entries in live.items():
                    if pack not in whole:  # some of its chunks are garbage: copy the others
                        for chunk, offset, length in entries:
                            packs.add(
                                chunk,
                                repo.backend.load_into(pack_name(pack), NO_BUFFER, offset, length),
                            )
                            held.refresh()
                index = packs.finish(also=whole)
            except BaseException:
                packs.abort()
                raise
            repo.backend.sync()
            for name in indexes:
                if name != index:
                    repo.backend.delete(name)
            for pack in present - set(whole):
                repo.backend.delete(pack_name(pack))
                held.refresh()
        kept = len(kept_at)
        for name in list(repo.backend.list("chunks")):  # stores of format 1
            held.refresh()  # a long gc must not look stale to writers
            if name.rsplit("/", 1)[-1] in referenced:
                kept += 1
            else:
                repo.backend.delete(name)
                deleted += 1
        # writers of these hold the lock shared: none runs now
        repo.backend.remove_leftovers(idle=("packs", "index", "manifests", "chunks"))
        repo.backend.sync()
        repo.chunks.forget()
    return GcReport(len(ids), kept, deleted)
