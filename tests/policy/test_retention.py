"""Retention as a pure decision: which checkpoints go, given their ages, the pinned ids and keep_last."""

from __future__ import annotations

from torpor.policy.retention import Kept, to_delete


def ages(*created: float) -> list[Kept]:
    return [Kept(f"c{t:g}", t) for t in created]


def test_off_or_not_over_the_limit_deletes_nothing() -> None:
    assert to_delete(ages(1, 2, 3), set(), keep_last=0) == []
    assert to_delete(ages(1, 2, 3), set(), keep_last=-1) == []
    assert to_delete(ages(1, 2, 3), set(), keep_last=3) == []
    assert to_delete([], set(), keep_last=1) == []


def test_the_oldest_beyond_keep_last_go_newest_first() -> None:
    assert to_delete(ages(1, 2, 3, 4), set(), keep_last=2) == ["c2", "c1"]


def test_order_given_does_not_matter_only_created_at() -> None:
    assert to_delete(ages(4, 1, 3, 2), set(), keep_last=1) == ["c3", "c2", "c1"]


def test_pinned_ones_beyond_the_limit_stay() -> None:
    assert to_delete(ages(1, 2, 3, 4), {"c1"}, keep_last=2) == ["c2"]


def test_a_pinned_one_among_the_newest_counts_towards_keep_last() -> None:
    assert to_delete(ages(1, 2, 3), {"c3"}, keep_last=1) == ["c2", "c1"]


def test_equal_times_keep_the_order_given() -> None:
    same = [Kept("a", 5.0), Kept("b", 5.0), Kept("c", 5.0)]
    assert to_delete(same, set(), keep_last=1) == ["b", "c"]
