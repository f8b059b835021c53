"""A deleted state directory's hot tier, left in RAM: ``torpor doctor`` lists it, ``torpor cleanup``
removes it, and nothing in use goes.

The hot tier lives outside the state directory (``/dev/shm/torpor-<hash of home>``, a tmpfs of torpor's
own as root) and names its home in ``.home``. The tests make tiers the way torpor makes them (HotTier
with a home), in their own TORPOR_HOT_DIR, and one real tmpfs in /dev/shm as root. ``cleanup`` also looks
at /dev/shm, so the tests that run it for real share one xdist group: one would take the other's leftover.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import Torpor
from torpor.core.store.hot import HotTier
from torpor.core.store.hotfolder import HOME_MARKER
from torpor.settings import Settings

pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("hot-tier-cleanup")]


def tier_of(torpor: Torpor, home: Path, own_mount: bool = False) -> Path:
    """The hot tier torpor makes for state directory ``home`` (in the test's TORPOR_HOT_DIR)."""
    hot_dir = None if own_mount else Path(torpor.env["TORPOR_HOT_DIR"])
    tier = HotTier(Settings(home=home, hot_dir=hot_dir).hot_path, own_mount=own_mount, home=home)
    tier.ensure()
    return tier.root


def old(path: Path) -> None:
    """As if made long ago (a folder without a marker is spared for a minute after it is made)."""
    os.utime(path, (1_000_000_000, 1_000_000_000))


def test_cleanup_removes_the_tiers_of_deleted_state_directories_and_leaves_the_rest(
    torpor: Torpor, tmp_path: Path
) -> None:
    torpor.home.mkdir()
    own = tier_of(torpor, torpor.home)
    alive = tier_of(torpor, tmp_path / "alive")
    (tmp_path / "alive").mkdir()
    empty = tier_of(torpor, tmp_path / "deleted")
    holding = tier_of(torpor, tmp_path / "deleted-with-images")
    (holding / "0123456789abcdef").mkdir()  # an image folder
    unmarked = Path(torpor.env["TORPOR_HOT_DIR"]) / "torpor-00000000000a"  # an older torpor's
    unmarked.mkdir(mode=0o700)
    old(unmarked)
    assert (empty / HOME_MARKER).read_text() == f"{tmp_path / 'deleted'}\n"
    assert (own / HOME_MARKER).stat().st_mode & 0o777 == 0o600

    listed = {t["path"]: t for t in torpor.json("cleanup", "--dry-run")["removed"]}
    assert {str(empty), str(unmarked)} <= set(listed) and not {str(own), str(alive), str(holding)} & set(
        listed
    )
    assert empty.exists() and unmarked.exists()  # a dry run removes nothing

    result = torpor.run("cleanup")
    assert f"removed {empty}" in result.stdout and f"removed {unmarked}" in result.stdout
    assert f"left {holding}" in result.stdout and "--force" in result.stdout
    assert not empty.exists() and not unmarked.exists()
    assert own.exists() and alive.exists() and (holding / "0123456789abcdef").exists()

    forced = torpor.json("cleanup", "--force")
    assert str(holding) in {t["path"] for t in forced["removed"]} and not holding.exists()
    assert own.exists() and alive.exists()


def test_a_marker_that_is_a_link_or_names_another_tier_protects_nothing_and_removes_nothing(
    torpor: Torpor, tmp_path: Path
) -> None:
    torpor.home.mkdir()
    moved = tier_of(torpor, tmp_path / "a")
    (moved / HOME_MARKER).write_text(f"{tmp_path / 'b'}\n")  # names a home whose tier has another name
    linked = tier_of(torpor, tmp_path / "c")
    (linked / HOME_MARKER).unlink()
    (linked / HOME_MARKER).symlink_to(tmp_path / "somewhere")
    (linked / "image").mkdir()  # a markerless tier holding something: torpor cannot tell whose
    forced = torpor.json("cleanup", "--force")
    assert not {str(moved), str(linked)} & {t["path"] for t in forced["removed"]}
    assert moved.exists() and linked.exists()


@pytest.mark.root("mounts a tmpfs in /dev/shm")
def test_doctor_lists_a_mounted_leftover_and_cleanup_unmounts_it_unless_a_file_is_open_in_it(
    torpor: Torpor, tmp_path: Path
) -> None:
    home = tmp_path / "gone"
    home.mkdir()
    tier = tier_of(torpor, home, own_mount=True)
    try:
        assert os.path.ismount(tier)
        shutil.rmtree(home)  # the user deletes the state directory; the tier stays mounted
        doctor = torpor.run("doctor", "--json", check=False)
        listed = [t for t in json.loads(doctor.stdout)["hot_tiers"] if t["path"] == str(tier)]
        assert listed and listed[0]["stale"] and listed[0]["mounted"], listed
        said = torpor.run("doctor", check=False).stdout
        assert str(tier) in said, (said, os.path.ismount(tier), tier.exists() and os.listdir(tier))

        busy = os.open(tier, os.O_RDONLY | os.O_DIRECTORY)  # a process using it: not unmounted from under it
        try:
            result = torpor.run("cleanup", check=False)
            assert result.returncode == 1 and f"could not remove {tier}" in result.stdout, result.stdout
            assert "file open" in result.stdout and os.path.ismount(tier)
        finally:
            os.close(busy)
        result = torpor.run("cleanup")
        assert f"removed {tier} (a tmpfs" in result.stdout
        assert not os.path.ismount(tier) and not tier.exists()
    finally:
        HotTier(tier, own_mount=True).remove_all()
