"""Reading ahead: a lazy restore along a stream of requests, never after a fault elsewhere; a streamed one only
what is not in memory."""

from __future__ import annotations

from torpor.policy.readahead import IN_MEMORY, chunks_ahead, loads_ahead

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
