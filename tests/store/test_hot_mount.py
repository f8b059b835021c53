"""The default RAM hot tier is a tmpfs of torpor's own, mounted with huge pages (CRIU dumps into it
faster than into /dev/shm itself); it is mounted once, and never over a folder already in use.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Torpor, python_job
from torpor.adapters.system import mounts
from torpor.core.store import remove_hot_tier
from torpor.core.store.hot import HotTier
from torpor.settings import Settings

pytestmark = pytest.mark.timeout(120)


def mount_options(path: Path) -> str | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[1] == str(path):
            return fields[3]
    return None


@pytest.mark.criu
def test_default_hot_tier_is_a_huge_page_tmpfs(torpor: Torpor) -> None:
    del torpor.env["TORPOR_HOT_DIR"]
    hot = Settings(home=torpor.home).hot_path
    try:
        torpor.run("run", "--name", "m", *python_job("counter.py"))
        torpor.wait_log("m", "step 2")
        checkpoint = torpor.json("checkpoint", "m")
        options = mount_options(hot)
        # 4 KiB pages: large folios made dumps slow and erratic once memory was fragmented (hotfolder.py)
        assert options is not None and "mode=700" in options and "huge=within_size" not in options
        assert (hot / checkpoint["id"]).is_dir()
        torpor.run("stop", "m", "--timeout", "0")
        torpor.run("resume", "m")
        torpor.wait_state("m", "running")
    finally:
        torpor.run("rm", "--force", "m", check=False)
        remove_hot_tier(Settings(home=torpor.home))
    assert mount_options(hot) is None and not hot.exists()


@pytest.mark.root("mounting a tmpfs")
def test_mounts_once_and_never_over_a_folder_in_use(tmp_path: Path) -> None:
    root = tmp_path / "hot"
    try:
        HotTier(root, own_mount=True).ensure()
        assert mount_options(root) is not None
        (root / "marker").write_text("x")
        HotTier(root, own_mount=True).ensure()  # already mounted: nothing stacked on top
        assert (root / "marker").exists()
    finally:
        mounts.unmount(root)
    used = tmp_path / "used"
    used.mkdir(mode=0o700)  # as torpor makes it
    (used / "image").write_text("x")
    HotTier(used, own_mount=True).ensure()
    assert mount_options(used) is None and (used / "image").exists()
