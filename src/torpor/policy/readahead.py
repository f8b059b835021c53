"""Reading ahead in restores: how far a lazy restore fetches memory ahead of what CRIU asked for (along a
stream only), and whether a streamed restore loads its chunks ahead at all (only when they are not in memory).

``criu lazy-pages`` asks torpor's page server for two kinds of memory: the page a process faulted on
(4 KiB here, there, anywhere), and, in the background, all the rest, in address order (1 MiB requests,
each beginning where the last one ended). Fetching the chunks that follow pays off for the second: they
are read and verified on other cores before the daemon asks. After a fault it does not: the next fault is
somewhere else, and its own chunk then waits behind the fetches ahead. Measured here (2 cores, 1 GiB
image, cold tier): a fault on a chunk not yet fetched took 5-16 ms with 8 chunks fetched ahead after
every request, 1-3 ms with none. Fetching, verifying and caching are the store's (:mod:`torpor.core.store.lazy`).
"""

from __future__ import annotations

from collections.abc import Sequence


def chunks_ahead(previous_end: int | None, vaddr: int, window: int) -> int:
    """Chunks to fetch ahead after a request for memory at ``vaddr``: ``window`` when the request begins
    where the same process's previous one ended (``previous_end``, None before its first), else none."""
    return window if previous_end is not None and vaddr == previous_end else 0


#: the share of a pages file in memory from which a streamed restore reads it without a thread ahead
#: (right after a hibernation, 0-15 % of the chunks here missed a page or three at their ends)
IN_MEMORY = 0.9


def loads_ahead(share_in_memory: float) -> bool:
    """Whether a streamed restore has a thread load the chunks ahead of the one it writes into CRIU's
    pipe, given the share of them in memory already (a local folder's page cache; 0 for S3).

    In memory, a chunk is CPU work only (a copy and its hash) and the writer does it itself, in turn: a
    thread loading ahead and handing the chunks over cost ~25 % more CPU, which CRIU, on the other core
    of two, paid for: by hand, the medians of a 1 GiB resume were 1.16-1.56 s in turn against
    1.50-1.76 s with the thread (four runs of alternated samples). From a disk or a network, a thread
    ahead lets the wait overlap with the rest.
    """
    return share_in_memory < IN_MEMORY


#: a lazy restore fetches up to this much of the job's lazy memory while ``criu restore`` runs ...
WARM_BYTES = 32 << 20
#: ... from its regions smaller than this: a larger one is the job's bulk data (arrays, weights), which
#: the daemon copies in the background anyway, and which would push the rest out of the budget
WARM_REGION_LIMIT = 64 << 20


def warm_first(sizes: Sequence[int], budget: int = WARM_BYTES, limit: int = WARM_REGION_LIMIT) -> list[int]:
    """Which regions of lazy memory (their sizes in bytes, by index) a lazy restore fetches and verifies
    before the job runs, so that its first page faults find them in memory: the smallest first, none of
    ``limit`` bytes or more, until ``budget`` is spent.

    Right after a restore a job touches its stack, its heap, its interpreter's objects, its libraries'
    data: small regions, spread over the address space, each a fault that waited 1-2 ms for its chunk to
    be fetched and verified here (a Python process faulted ~47 times before its first line after the
    restore of a 4 GiB image, 2 cores). The fetches run on other cores while ``criu restore`` runs.
    """
    chosen: list[int] = []
    spent = 0
    for index in sorted(range(len(sizes)), key=sizes.__getitem__):
        size = sizes[index]
        if size >= limit or spent + size > budget:
            break  # the rest are no smaller
        chosen.append(index)
        spent += size
    return chosen
