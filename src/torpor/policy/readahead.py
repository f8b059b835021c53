"""How far a lazy restore fetches memory ahead of what CRIU asked for: along a stream only.

``criu lazy-pages`` asks torpor's page server for two kinds of memory: the page a process faulted on
(4 KiB here, there, anywhere), and, in the background, all the rest, in address order (1 MiB requests,
each beginning where the last one ended). Fetching the chunks that follow pays off for the second: they
are read and verified on other cores before the daemon asks. After a fault it does not: the next fault is
somewhere else, and its own chunk then waits behind the fetches ahead. Measured here (2 cores, 1 GiB
image, cold tier): a fault on a chunk not yet fetched took 5-16 ms with 8 chunks fetched ahead after
every request, 1-3 ms with none. Fetching, verifying and caching are the store's (:mod:`torpor.core.store.lazy`).
"""

from __future__ import annotations


def chunks_ahead(previous_end: int | None, vaddr: int, window: int) -> int:
    """Chunks to fetch ahead after a request for memory at ``vaddr``: ``window`` when the request begins
    where the same process's previous one ended (``previous_end``, None before its first), else none."""
    return window if previous_end is not None and vaddr == previous_end else 0
