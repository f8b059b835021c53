"""Which hot tiers deleted state directories left in RAM, and which ``torpor cleanup`` removes
(torpor.policy.leftovers): every case of the decision, on plain data."""

from __future__ import annotations

from dataclasses import replace

from torpor.policy.leftovers import UNMARKED_GRACE_S, HotTierSeen, judge

GONE = HotTierSeen(
    path="/dev/shm/torpor-0123456789ab",
    home="/srv/gone",
    home_exists=False,
    named_for_home=True,
    current=False,
    entries=0,
    age_s=3600.0,
)


def test_an_empty_tier_of_a_deleted_state_directory_is_removed() -> None:
    verdict = judge(GONE)
    assert verdict.stale and verdict.remove and "/srv/gone is gone" in verdict.reason


def test_one_still_holding_images_is_removed_only_with_force_and_says_why() -> None:
    holding = replace(GONE, entries=2)
    verdict = judge(holding)
    assert verdict.stale and not verdict.remove
    assert "holds 2 entries" in verdict.reason and "--force" in verdict.reason
    assert "not mounted now" in verdict.reason  # the home may only be on a file system not mounted now
    forced = judge(holding, force=True)
    assert forced.stale and forced.remove and "--force" not in forced.reason


def test_a_tier_in_use_is_never_removed_even_with_force() -> None:
    for seen in (
        replace(GONE, home_exists=True),
        replace(GONE, current=True, home_exists=False),  # the caller's own, its home not made yet
        replace(GONE, named_for_home=False),  # a marker torpor did not write so
    ):
        for force in (False, True):
            verdict = judge(seen, force)
            assert not verdict.stale and not verdict.remove, (seen, force)


def test_a_tier_without_a_marker_goes_only_empty_and_not_just_made() -> None:
    unmarked = replace(GONE, home=None, named_for_home=False)
    assert judge(unmarked).remove and "older torpor" in judge(unmarked).reason
    young = replace(unmarked, age_s=UNMARKED_GRACE_S / 2)  # torpor writes the marker right after mkdir
    assert not judge(young).stale and not judge(young, force=True).remove
    holding = replace(unmarked, entries=1)
    assert not judge(holding).stale and not judge(holding, force=True).remove
    assert "by hand" in judge(holding).reason
