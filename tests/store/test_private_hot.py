"""The hot tier is torpor's own or it is not used (issue 11): a folder another user made, a link, a loose
mode or a parent where others can rename entries is refused with an error that says what to do; no
write goes through a link planted where torpor writes; staging folders and the cold store are private.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from torpor.adapters.system import mounts
from torpor.core.store import TieredStore
from torpor.core.store.hot import HotTier
from torpor.errors import UnsafePath
from torpor.settings import Settings

from .conftest import write_image

MiB = 1 << 20
BASE = 0x7F0000000000
NOBODY = 65534

needs_root = pytest.mark.root("giving a folder to another user")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@needs_root
def test_a_hot_tier_another_user_made_first_is_refused_and_left_untouched(tmp_path: Path) -> None:
    root = tmp_path / "torpor-abc"
    root.mkdir()
    os.chown(root, NOBODY, NOBODY)
    root.chmod(0o777)
    tier = HotTier(root, own_mount=True)
    try:
        with pytest.raises(UnsafePath, match=rf"hot tier {root} is owned by uid {NOBODY}.*remove it"):
            tier.ensure()
        with pytest.raises(UnsafePath):  # readers refuse it too: its records are someone else's
            tier.records()
        assert list(root.iterdir()) == [] and not os.path.ismount(root)
    finally:
        mounts.unmount(root)  # had it been mounted over after all
    found = root.stat()
    assert (found.st_uid, stat.S_IMODE(found.st_mode)) == (NOBODY, 0o777)  # never chmod-ed or chown-ed


def test_a_hot_tier_that_is_a_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    root = tmp_path / "torpor-abc"
    root.symlink_to(real)
    with pytest.raises(UnsafePath, match="is a symbolic link"):
        HotTier(root).ensure()
    assert list(real.iterdir()) == []


def test_a_hot_tier_open_to_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "torpor-abc"
    root.mkdir()
    root.chmod(0o755)
    with pytest.raises(UnsafePath, match="has mode 0755"):
        HotTier(root).ensure()


def test_a_new_hot_tier_is_private_and_needs_a_parent_others_cannot_rename_in(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename torpor's folder away and put their own in its place
    with pytest.raises(UnsafePath, match="sticky bit"):
        HotTier(shared / "torpor-abc").ensure()
    shared.chmod(0o1777)  # as /dev/shm
    tier = HotTier(shared / "torpor-abc")
    tier.ensure()
    assert mode(tier.root) == 0o700 and tier.exists()


def test_a_replaced_hot_tier_is_checked_again(tmp_path: Path) -> None:
    tier = HotTier(tmp_path / "torpor-abc")
    tier.ensure()
    tier.root.rmdir()
    tier.root.mkdir()
    tier.root.chmod(0o777)
    with pytest.raises(UnsafePath, match="has mode 0777"):
        tier.records()


def test_no_write_follows_a_link_planted_in_the_hot_tier(settings: Settings, tmp_path: Path) -> None:
    store = TieredStore(settings)
    staging = store.staging_dir("c1")
    write_image(staging, {BASE: os.urandom(MiB)})
    store.hot.commit("c1", "job", staging, {})  # as put does, without starting a destager
    target = tmp_path / "made-through-a-link"
    (store.hot.root / "destager.log").unlink()  # the one staging_dir's destager logs to
    (store.hot.root / "destager.log").symlink_to(target)
    with pytest.raises(UnsafePath, match=r"destager\.log is a symbolic link"):
        store.kick()
    (store.hot.image_dir("c1") / ".lock").symlink_to(target)
    with pytest.raises(UnsafePath, match=r"\.lock is a symbolic link"):
        store.hot.update("c1", error="x")
    assert not target.exists()


def test_staging_folders_and_the_cold_store_are_private(settings: Settings) -> None:
    store = TieredStore(dataclasses.replace(settings, hot_capacity_bytes=0))  # straight to the cold tier
    staging = store.staging_dir("c1", size_hint=MiB)
    assert staging.parent == store.cold_staging
    assert mode(store.cold_staging) == 0o700 and mode(staging) == 0o700
    write_image(staging, {BASE: os.urandom(MiB)})
    store.put("c1", "job", staging)
    stored = list(settings.images_dir.rglob("*"))
    assert stored and mode(settings.images_dir) == 0o700
    assert {str(p): mode(p) for p in stored} == {str(p): 0o700 if p.is_dir() else 0o600 for p in stored}
    hot = TieredStore(settings)
    hot_staging = hot.staging_dir("c2", size_hint=MiB)
    assert hot_staging.parent == hot.hot.root and mode(hot.hot.root) == 0o700 and mode(hot_staging) == 0o700
    assert {mode(p) for p in hot_staging.iterdir()} == {0o600}  # .owner
