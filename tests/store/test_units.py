"""Small pieces of the store: the pagemap reader and chunk cuts, key files, the lock, settings."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torpor.adapters.folder import FolderBackend
from torpor.core.store.backend import open_backend
from torpor.core.store.lock import EXCLUSIVE, SHARED, RepositoryLock
from torpor.core.store.objects import read_key_file
from torpor.core.store.pagemap import PAGE_SIZE, cuts, read_pagemaps
from torpor.errors import KeyProblem, StoreBusy, UsageError
from torpor.settings import Settings, parse_bytes

from .conftest import write_image

BASE = 0x7F0000000000


def test_pagemap_cuts_follow_addresses(tmp_path: Path) -> None:
    regions = {BASE + 3 * PAGE_SIZE: bytes(5 * PAGE_SIZE), BASE + (1 << 20): bytes(2 * (1 << 20))}
    write_image(tmp_path, regions)
    pagemap = read_pagemaps(tmp_path)["pages-1.img"]
    assert pagemap.size == 5 * PAGE_SIZE + 2 * (1 << 20)
    pieces = cuts(pagemap, 1 << 20)
    # first window: the 5 pages; then the 2 MiB region in two aligned windows
    assert pieces == [(0, 5 * PAGE_SIZE), (5 * PAGE_SIZE, 1 << 20), (5 * PAGE_SIZE + (1 << 20), 1 << 20)]


def test_a_pagemap_that_does_not_add_up_is_ignored(tmp_path: Path) -> None:
    write_image(tmp_path, {BASE: bytes(2 * PAGE_SIZE)})
    with open(tmp_path / "pages-1.img", "ab") as pages:
        pages.write(b"x")
    assert read_pagemaps(tmp_path) == {}


def test_key_files(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.write_bytes(os.urandom(32))
    assert len(read_key_file(raw)) == 32
    hexed = tmp_path / "hex"
    hexed.write_text(os.urandom(32).hex() + "\n")
    assert len(read_key_file(hexed)) == 32
    short = tmp_path / "short"
    short.write_bytes(b"secret")
    with pytest.raises(KeyProblem, match="32 bytes"):
        read_key_file(short)
    with pytest.raises(KeyProblem, match="does not exist"):
        read_key_file(tmp_path / "missing")


def test_gc_waits_for_writers_and_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    lock = RepositoryLock(FolderBackend(tmp_path))
    with (
        lock.hold(SHARED, timeout=1),
        lock.hold(SHARED, timeout=1),  # writers share
        pytest.raises(StoreBusy, match="being written"),
        lock.hold(EXCLUSIVE, timeout=0.5),
    ):
        pass
    with lock.hold(EXCLUSIVE, timeout=1):
        pass


def test_a_lock_left_by_a_dead_process_is_stale(tmp_path: Path) -> None:
    backend = FolderBackend(tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    record = {"host": RepositoryLock(backend).host, "pid": int(dead.stdout), "time": 0}
    backend.store("locks/s-dead", json.dumps(record).encode())
    with RepositoryLock(backend).hold(EXCLUSIVE, timeout=1):
        assert not backend.exists("locks/s-dead")


def test_store_urls() -> None:
    assert isinstance(open_backend("/srv/torpor"), FolderBackend)
    assert isinstance(open_backend("file:///srv/torpor"), FolderBackend)
    with pytest.raises(UsageError, match="unsupported store URL"):
        open_backend("ftp://host/x")


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORPOR_HOT_DIR", str(tmp_path / "hot"))
    monkeypatch.setenv("TORPOR_HOT_CAPACITY", "1.5G")
    monkeypatch.setenv("TORPOR_STORE", "s3://bucket/prefix")
    monkeypatch.setenv("TORPOR_KEEP_LAST", "3")
    assert Settings.from_environment(home=str(tmp_path)).stream_restore
    monkeypatch.setenv("TORPOR_STREAM_RESTORE", "off")
    settings = Settings.from_environment(home=str(tmp_path))
    assert not settings.stream_restore
    assert settings.hot_path.parent == tmp_path / "hot"  # torpor's own folder in the one named
    assert settings.hot_path.name.startswith("torpor-")
    assert settings.hot_capacity_bytes == int(1.5 * (1 << 30))
    # the store variables are kept as given, for the state directory's store configuration only
    assert settings.store_env == {"TORPOR_STORE": "s3://bucket/prefix", "TORPOR_KEEP_LAST": "3"}
    handed = Settings.from_dict(json.loads(json.dumps(settings.to_dict())))
    assert handed == dataclasses.replace(settings, store_env={})
    monkeypatch.setenv("TORPOR_STORE_WORKERS", "many")
    with pytest.raises(UsageError, match="whole number"):
        Settings.from_environment(home=str(tmp_path))
    monkeypatch.setenv("TORPOR_STORE_WORKERS", "0")
    with pytest.raises(UsageError, match="TORPOR_STORE_WORKERS='0': must be at least 1"):
        Settings.from_environment(home=str(tmp_path))
    monkeypatch.delenv("TORPOR_STORE_WORKERS")
    monkeypatch.setenv("TORPOR_STREAM_RESTORE", "maybe")
    with pytest.raises(UsageError, match="TORPOR_STREAM_RESTORE='maybe' must be 1 or 0"):
        Settings.from_environment(home=str(tmp_path))
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("4096") == 4096
    with pytest.raises(UsageError):
        parse_bytes("lots")


def test_a_partial_folder_that_vanishes_while_leftovers_are_listed_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torpor.core.store import hot as hot_module

    tier = hot_module.HotTier(tmp_path / "hot")
    tier.ensure()
    (tmp_path / "hot" / "abc.partial").mkdir()  # no .owner: its age decides
    (tmp_path / "hot" / ".x.deleting").mkdir()
    real = hot_module.owner_alive

    def renamed_meanwhile(partial: Path) -> bool:
        partial.rmdir()  # the dump committed (renamed) between the listing and this look
        return real(partial)

    monkeypatch.setattr(hot_module, "owner_alive", renamed_meanwhile)
    assert [p.name for p in tier.leftovers()] == [".x.deleting"]


def test_taking_over_a_durable_copy_moves_its_pages_files_out_by_pid_and_drops_the_rest(
    tmp_path: Path,
) -> None:
    from torpor.core.store import hot as hot_module

    from .conftest import write_image

    tier = hot_module.HotTier(tmp_path / "hot")
    tier.ensure()
    partial = tmp_path / "hot" / "old.partial"
    write_image(partial, {0x10000: b"a" * 8192}, pages_id=1)
    (partial / "pagemap-7.img").write_bytes((partial / "pagemap-1.img").read_bytes())  # pages-1 is pid 7's
    (partial / "pagemap-1.img").unlink()
    write_image(partial, {0x20000: b"b" * 4096}, pages_id=2)  # pid 2's, linked into a restore below
    tier.commit("old", "job", partial, {"created_at": 1.0, "kind": "checkpoint"})
    tier.update("old", state="durable")
    restore = tmp_path / "restore"
    restore.mkdir()
    os.link(tier.image_dir("old") / "pages-2.img", restore / "pages-2.img")
    staging = tmp_path / "hot" / "new.partial"
    staging.mkdir()
    taken = tier.take_over("old", staging)
    assert taken == {7: staging / ".memory-7"}
    assert taken[7].read_bytes() == b"a" * 8192
    assert (restore / "pages-2.img").read_bytes() == b"b" * 4096  # a restore's link stays its own
    assert tier.record("old") is None and not tier.image_dir("old").exists()
    assert not [p for p in (tmp_path / "hot").iterdir() if p.name.endswith(".deleting")]
    assert tier.take_over("old", staging) == {}  # gone: nothing to take
