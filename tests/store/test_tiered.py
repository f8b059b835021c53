"""The hot tier and the destager: states, capacity, verification, and the faults of issue 3 —
a destager killed mid-way, a cold tier that is full, a flipped byte — on synthetic CRIU images."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.adapters.system import private
from torpor.core.store import DURABLE, STAGED, TieredStore, config
from torpor.core.store.hot import dumped_kind, dumped_pids
from torpor.core.store.tiered import LOG_FILE
from torpor.errors import CorruptImage, StorageFull, StoreError
from torpor.settings import Settings

from .conftest import flip_chunk_bit, same_files, write_image

MiB = 1 << 20
BASE = 0x7F0000000000


def _stage(store: TieredStore, checkpoint_id: str, data: bytes, size_hint: int | None = None) -> Path:
    staging = store.staging_dir(checkpoint_id, size_hint=size_hint)
    write_image(staging, {BASE: data})
    return staging


def _wait(predicate: object, timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_put_stages_in_ram_and_the_destager_makes_it_durable(settings: Settings, tmp_path: Path) -> None:
    store = TieredStore(settings)
    staging = _stage(store, "c1", os.urandom(4 * MiB))
    assert staging.parent == settings.hot_path
    original = tmp_path / "original"
    write_image(original, {BASE: (staging / "pages-1.img").read_bytes()})
    image = store.put("c1", "job", staging, {"criu_version": "4.2.1"})
    assert image.state == STAGED and image.size_bytes > 4 * MiB
    durable = store.wait_durable("c1", timeout=60)
    assert durable.state == DURABLE and durable.stored_bytes > 4 * MiB
    assert store.repo.manifest("c1").meta["criu_version"] == "4.2.1"
    assert [i.checkpoint_id for i in store.list()] == ["c1"]
    # restore from the hot copy, then from the cold tier alone
    store.get("c1", store.restore_dir("c1"))
    store.hot.remove("c1")
    dest = store.restore_dir("c1")
    store.get("c1", dest)
    assert same_files(original, dest)


def test_a_dump_that_does_not_fit_goes_straight_to_the_cold_tier(settings: Settings) -> None:
    store = TieredStore(dataclasses.replace(settings, hot_capacity_bytes=2 * MiB))
    staging = _stage(store, "big", os.urandom(3 * MiB), size_hint=3 * MiB)
    assert staging.parent != settings.hot_path
    image = store.put("big", "job", staging, {})
    assert image.state == DURABLE and not staging.exists()
    assert store.hot.record("big") is None
    # nor is it restored through RAM, unless only its small files go there (a streamed restore)
    assert store.restore_dir("big").parent == settings.hot_path
    whole = TieredStore(dataclasses.replace(store.settings, stream_restore=False))
    dest = whole.restore_dir("big")
    assert dest.parent == settings.tmp_dir
    whole.get("big", dest)
    assert (dest / "pages-1.img").stat().st_size == 3 * MiB


def test_durable_copies_leave_ram_oldest_first_when_over_capacity(settings: Settings) -> None:
    store = TieredStore(dataclasses.replace(settings, hot_capacity_bytes=7 * MiB))
    for n in range(3):
        store.put(f"c{n}", "job", _stage(store, f"c{n}", os.urandom(2 * MiB), size_hint=2 * MiB), {})
        store.wait_durable(f"c{n}", timeout=60)
    # a fourth that needs room: the oldest durable copy is dropped from RAM, not from the store
    staging = _stage(store, "c3", os.urandom(2 * MiB), size_hint=2 * MiB)
    assert staging.parent == settings.hot_path
    assert store.hot.record("c0") is None and store.hot.record("c2") is not None
    assert store.state("c0").state == DURABLE
    store.discard(staging)


def _destager_pid(store: TieredStore) -> int | None:
    try:
        text = store.lock_path.read_text().strip()
    except OSError:
        return None
    return int(text) if text else None


@pytest.mark.slow  # 320 MiB of random bytes, so that it is still destaging when killed
def test_a_destager_killed_mid_way_is_finished_by_the_next(settings: Settings, tmp_path: Path) -> None:
    store = TieredStore(dataclasses.replace(settings, store_workers=1))
    data = os.urandom(320 * MiB)
    # the destager the staging starts would store the image while it is written, and then destage it
    # in an instant, between two looks: it waits on the lock until the image is committed
    store.hot.ensure()
    with private.locked(store.lock_path):
        store.put("c1", "job", _stage(store, "c1", data), {})

    def destaging() -> bool:
        record = store.hot.record("c1")
        return record is not None and record.state == "destaging"

    _wait(destaging, what="destaging to start")
    pid = _destager_pid(store)
    assert pid
    # step the destager 5 ms at a time until its first pack is in the cold tier: held mid-way whatever the
    # speed of this machine (a look between two steps cannot miss the end, as one while it runs can)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while not list(store.repo.backend.list("packs")):
            assert time.monotonic() < deadline, "the destager stored no pack in 60 s"
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.005)
            os.kill(pid, signal.SIGSTOP)
        # no half checkpoint is listed: not durable, no manifest in the cold tier, some chunks already there
        assert not store.repo.has("c1")
    finally:
        os.kill(pid, signal.SIGKILL)  # stopped or not
    # the destager put started waits on the lock, and stores it from the start (a new one would too)
    assert store.wait_durable("c1", timeout=120).state == DURABLE
    log = (store.hot.root / LOG_FILE).read_text()
    assert re.search(rf"destager (?!{pid}:)\d+: c1 \(job\) durable", log), log
    store.hot.remove("c1")
    store.get("c1", tmp_path / "out")
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == data


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "cold"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.root("mounting a tmpfs")
def test_a_full_cold_tier_keeps_the_checkpoint_in_ram_and_says_why(
    settings: Settings, small_tmpfs: Path
) -> None:
    settings.home.mkdir(parents=True)
    config.save(settings.home, config.StoreConfig(url=str(small_tmpfs)))
    store = TieredStore(settings)
    data = os.urandom(16 * MiB)
    store.put("c1", "job", _stage(store, "c1", data), {})
    with pytest.raises(StoreError, match="no space left") as caught:
        store.wait_durable("c1", timeout=60)
    assert "stays in the hot tier" in caught.value.message
    image = store.state("c1")
    assert image.state == STAGED and image.error and "no space" in image.error
    assert not store.repo.has("c1")
    dest = store.restore_dir("c1")
    store.get("c1", dest)  # still restorable from RAM
    assert (dest / "pages-1.img").read_bytes() == data
    # straight to the cold tier (no room in RAM): the error comes at once and the dump is left intact
    tight = TieredStore(dataclasses.replace(settings, hot_capacity_bytes=MiB))
    staging = _stage(tight, "c2", os.urandom(16 * MiB), size_hint=16 * MiB)
    with pytest.raises(StorageFull):
        tight.put("c2", "job", staging, {})
    assert (staging / "pages-1.img").stat().st_size == 16 * MiB


def test_a_flipped_byte_is_refused_and_the_newest_good_checkpoint_named(settings: Settings) -> None:
    store = TieredStore(settings)
    stable = os.urandom(MiB)
    for n in range(3):
        store.put(f"c{n}", "job", _stage(store, f"c{n}", stable + os.urandom(MiB)), {})
        store.wait_durable(f"c{n}", timeout=60)
        store.hot.remove(f"c{n}")
    manifest = store.repo.manifest("c2")
    pages = next(f for f in manifest.files if f.name == "pages-1.img")
    own = pages.extents[-1][2]  # a chunk only c2 has
    assert own is not None
    flip_chunk_bit(store.repo, own, 100, 0x04)
    with pytest.raises(CorruptImage) as caught:
        store.get("c2", store.restore_dir("c2"))
    assert "checkpoint c2 is damaged" in caught.value.message
    assert "newest intact checkpoint of this job is c1" in caught.value.message


def test_a_corrupt_hot_copy_is_refused_then_dropped_for_the_stores_copy(settings: Settings) -> None:
    store = TieredStore(settings)
    data = os.urandom(MiB)
    store.put("c1", "job", _stage(store, "c1", data), {})
    store.wait_durable("c1", timeout=60)
    pages = store.hot.image_dir("c1") / "pages-1.img"
    blob = bytearray(pages.read_bytes())
    blob[7] ^= 1
    pages.write_bytes(bytes(blob))
    with pytest.raises(CorruptImage, match=r"hot tier .*restore again"):
        store.get("c1", store.restore_dir("c1"))
    assert store.hot.record("c1") is None
    dest = store.restore_dir("c1")
    store.get("c1", dest)  # from the cold tier, intact
    assert (dest / "pages-1.img").read_bytes() == data


def test_fetch_leaves_only_the_pages_to_its_check(settings: Settings) -> None:
    store = TieredStore(settings)
    store.put("c1", "job", _stage(store, "c1", os.urandom(MiB)), {})
    store.wait_durable("c1", timeout=60)
    store.hot.remove("c1")
    pages = next(e for e in store.repo.manifest("c1").files if e.name == "pages-1.img")
    flip_chunk_bit(store.repo, str(pages.extents[0][2]), -1)  # stored raw: the payload's last byte
    check = store.fetch("c1", store.restore_dir("c1"))  # the pages' chunks are not hashed yet
    with pytest.raises(CorruptImage, match="damaged"):
        check()


def test_the_destager_removes_what_dead_dumps_left_behind(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torpor.core.store import destager

    # leftovers go first; then it would linger for the live dump to finish (30 s): make that no time
    monkeypatch.setattr(destager, "LINGER_S", 0.0)
    store = TieredStore(dataclasses.replace(settings, hot_capacity_bytes=4 * MiB))
    hot_partial = store.staging_dir("deadhot")
    cold_partial = store.staging_dir("deadcold", size_hint=64 * MiB)
    live_partial = store.staging_dir("live")  # ours: a dump in progress, kept
    assert cold_partial.parent == store.cold_staging
    for partial in (hot_partial, cold_partial):
        (partial / ".owner").write_text("999999999")  # no such process
    destager.run(store)
    assert not hot_partial.exists() and not cold_partial.exists()
    assert live_partial.exists()


def test_a_dump_in_progress_says_its_kind_until_it_is_committed(settings: Settings) -> None:
    """The destager stores a dump before it ends as its kind's are stored (policy.hot.read_back_soon)."""
    store = TieredStore(settings)
    for size_hint in (None, 64 * MiB):  # in RAM, and on a disk for a dump too large for RAM
        staging = store.staging_dir(
            f"h{size_hint}", size_hint=size_hint, pids=[os.getpid()], kind="hibernate"
        )
        assert dumped_kind(staging) == "hibernate" and dumped_pids(staging) == [os.getpid()]
    assert dumped_kind(store.staging_dir("unsaid")) is None
    staging = store.staging_dir("c", kind="checkpoint")
    write_image(staging, {BASE: os.urandom(MiB)})
    store.put("c", "job", staging, {"kind": "checkpoint"})
    assert ".kind" not in {path.name for path in store.hot.image_dir("c").iterdir()}  # the record says


@pytest.mark.root("mounting a tmpfs")
def test_a_dump_goes_to_disk_when_the_hot_file_system_is_short_of_room(
    settings: Settings, small_tmpfs: Path
) -> None:
    # capacity says yes, but the tmpfs (6 MiB, shared with others in real life) has no room for 16 MiB
    store = TieredStore(
        dataclasses.replace(settings, hot_dir=small_tmpfs / "hot", hot_capacity_bytes=1 << 30)
    )
    assert store.staging_dir("big", size_hint=16 * MiB).parent == store.cold_staging
    assert store.staging_dir("small", size_hint=MiB).parent == store.hot.root
    assert store.hot.root.parent == small_tmpfs / "hot"


def test_a_hot_image_is_hashed_once_then_verified_on_every_read(settings: Settings) -> None:
    store = TieredStore(settings)
    staging = _stage(store, "c1", os.urandom(MiB))
    record = store.hot.commit("c1", "job", staging, {})  # as put does, without starting a destager
    assert all(digest is None for _, digest in record.files.values())  # put costs only a rename
    store.get("c1", store.restore_dir("c1"))  # the first read records the hashes ...
    hashed = store.hot.record("c1")
    assert hashed is not None and all(digest for _, digest in hashed.files.values())
    pages = store.hot.image_dir("c1") / "pages-1.img"
    blob = bytearray(pages.read_bytes())
    blob[3] ^= 1
    pages.write_bytes(bytes(blob))
    with pytest.raises(CorruptImage, match="hot tier"):  # ... and every later read checks them
        store.get("c1", store.restore_dir("c1"))


def test_the_store_follows_its_configuration_file_and_keeps_ram_copies_restorable(
    settings: Settings, tmp_path: Path
) -> None:
    settings.home.mkdir(parents=True)
    store = TieredStore(settings)  # no configuration file yet: the default, HOME/images
    data = os.urandom(2 * MiB)
    store.put("c1", "job", _stage(store, "c1", data), {})
    store.wait_durable("c1", timeout=60)
    assert store.repo.backend.url == f"file://{settings.images_dir}"
    # what `torpor store set --url … --force` writes: the same store object opens the new cold tier
    config.save(settings.home, config.StoreConfig(url=str(tmp_path / "elsewhere")))
    assert store.repo.backend.url == f"file://{tmp_path / 'elsewhere'}" and not store.repo.has("c1")
    dest = store.restore_dir("c1")
    store.get("c1", dest)  # its RAM copy, verified by its own hashes
    assert (dest / "pages-1.img").read_bytes() == data
