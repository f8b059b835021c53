"""Reading ahead: a lazy restore along a stream of requests, never after a fault elsewhere, and the small
regions of memory before the job runs; a streamed one only what is not in memory."""

from __future__ import annotations

from torpor.policy.readahead import (
    IN_MEMORY,
    WARM_BYTES,
    WARM_REGION_LIMIT,
    chunks_ahead,
    loads_ahead,
    warm_first,
)

MiB = 1 << 20
BASE = 0x7F0000000000


def test_a_request_that_goes_on_from_the_last_one_is_fetched_ahead() -> None:
    assert chunks_ahead(BASE + MiB, BASE + MiB, 8) == 8
    assert chunks_ahead(BASE + MiB, BASE + MiB, 0) == 0  # fetching ahead turned off


def test_a_first_request_or_a_fault_elsewhere_is_not() -> None:
    assert chunks_ahead(None, BASE, 8) == 0
    assert chunks_ahead(BASE + MiB, BASE + 5 * MiB, 8) == 0
    assert chunks_ahead(BASE + MiB, BASE + MiB - 4096, 8) == 0  # overlaps the last one: a fault


def test_a_streamed_restore_loads_ahead_only_what_is_not_in_memory() -> None:
    assert not loads_ahead(1.0)  # right after a hibernation: all in the page cache
    assert not loads_ahead(IN_MEMORY)  # a page or two at chunk ends gone
    assert loads_ahead(0.5)
    assert loads_ahead(0.0)  # on disk, or S3


def test_a_lazy_restore_warms_the_small_regions_smallest_first_within_its_budget() -> None:
    # a heap, a stack, interpreter arenas, one big array
    sizes = [8 * MiB, 132 * 1024, 4096 << 20, 1 * MiB, 20 * MiB]
    assert warm_first(sizes, budget=32 * MiB, limit=64 * MiB) == [1, 3, 0, 4]
    assert warm_first(sizes, budget=10 * MiB, limit=64 * MiB) == [1, 3, 0]  # 20 MiB more does not fit


def test_a_region_at_the_limit_is_bulk_data_and_left_to_the_daemon() -> None:
    assert warm_first([WARM_REGION_LIMIT, MiB]) == [1]
    assert warm_first([WARM_BYTES + MiB]) == []  # small enough, but over the budget
    assert warm_first([]) == []
    assert warm_first([MiB, MiB], budget=0) == []
