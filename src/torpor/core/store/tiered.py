"""The store torpor uses: a hot tier in RAM in front of a content-addressed cold tier.

``staging_dir`` hands CRIU a folder in the hot tier; ``put`` only hashes the files and renames the
folder, so the job is back to work as soon as the dump ends. A detached destager process
(:mod:`torpor.core.store.destager`) then chunks, compresses and stores the image in the cold tier and
marks it durable. A dump that would not fit in the hot tier goes to a folder on disk and ``put`` stores
it into the cold tier at once.

``get`` prefers the hot copy (linked, not copied) and otherwise rebuilds the image from the cold tier;
either way every byte is checked against its hash. ``fetch`` does the same but leaves the memory pages
to a check that the restore runs while CRIU already reads them (see ``restore_into_launcher``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torpor.adapters.system import private
from torpor.core.store.backend import open_backend
from torpor.core.store.base import (
    DESTAGING,
    DURABLE,
    STAGED,
    Check,
    GcResult,
    PageSource,
    PageStream,
    RestoreSource,
    StoredImage,
    is_bulk,
)
from torpor.core.store.config import ConfigFile, StoreConfig
from torpor.core.store.hot import (
    HotRecord,
    HotTier,
    as_copy,
    hash_file,
    owner_alive,
    tier_error,
    write_owner,
)
from torpor.core.store.lazy import LazyImage
from torpor.core.store.manifest import Manifest
from torpor.core.store.objects import KIND_CHUNK, read_key_file
from torpor.core.store.repository import Repository
from torpor.core.store.verify import verify_extents
from torpor.errors import CheckpointNotFound, CorruptImage, StoreError, TorporError
from torpor.policy import hot as hot_policy
from torpor.policy import readahead
from torpor.settings import Settings

LOCK_FILE = "destager.lock"
LOG_FILE = "destager.log"

_children: list[subprocess.Popen[bytes]] = []


class _HotCopyCorrupt(CorruptImage):
    """The hot copy of a durable image is damaged (and was dropped); the checkpoint itself is fine."""


def open_cold_tier(config: StoreConfig, home: Path, workers: int) -> Repository:
    """The cold tier ``config`` names, opened: created if new, the key checked against it."""
    key = read_key_file(config.key_file) if config.key_file else None
    backend = open_backend(config.cold_url(home), s3_endpoint=config.s3_endpoint, workers=workers)
    return Repository(backend, key, workers).open()


class TieredStore:
    """The ImageStore torpor uses: the hot tier in RAM in front of the cold tier, a destager between."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.hot = HotTier(
            settings.hot_path,
            settings.hot_capacity_bytes,
            own_mount=settings.hot_dir is None,
            home=settings.home,
        )
        self.cold_staging = settings.staging_dir
        self.config_file = ConfigFile(settings.home)
        self._repo: Repository | None = None
        self._repo_config: StoreConfig | None = None
        self._kicked = 0.0

    @property
    def config(self) -> StoreConfig:
        """The state directory's store configuration as it is now (``torpor store set`` may change it)."""
        return self.config_file.current()

    @property
    def repo(self) -> Repository:
        """The cold tier, opened on first use (the key is checked against the store here).

        Opened again when the store configuration changed since: a launcher lives as long as its job,
        and its next checkpoint goes where the configuration says now.
        """
        config = self.config.replace(keep_last=0)  # retention does not change where images are
        if self._repo is None or config != self._repo_config:
            self._repo = open_cold_tier(config, self.settings.home, self.settings.store_workers)
            self._repo_config = config
        return self._repo

    def cold_problem(self) -> str | None:
        """Why the cold tier cannot take an image now (cannot be opened, wrong key, no writes); else None."""
        try:
            self.repo.probe()
        except TorporError as exc:
            return exc.message
        return None

    # -- writing --------------------------------------------------------------------------------------

    def staging_dir(
        self,
        checkpoint_id: str,
        size_hint: int | None = None,
        pids: Sequence[int] = (),
        kind: str | None = None,
    ) -> Path:
        hot = self.hot.staging_dir(checkpoint_id, size_hint, pids, kind)
        if hot is not None:
            self.kick()  # a destager starting now is ready when the dump ends
            return hot
        partial = self.cold_staging / f"{checkpoint_id}.partial"
        try:
            private.make_private_dirs(self.cold_staging)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(mode=0o700)
            write_owner(partial, pids, kind)
        except OSError as exc:
            raise StoreError(
                f"cannot create a staging folder in {self.cold_staging}: {exc.strerror}"
            ) from exc
        return partial

    def hot_copy(self, checkpoint_id: str) -> Path | None:
        """The folder of ``checkpoint_id``'s copy in the hot tier (in RAM), if it has one."""
        return self.hot.image_dir(checkpoint_id) if self.hot.record(checkpoint_id) is not None else None

    def in_memory(self, image_dir: Path) -> bool:
        return self.hot.owns(image_dir)

    def take_over_memory(self, job: str, image_dir: Path) -> dict[int, Path]:
        if not self.hot.owns(image_dir):
            return {}
        chosen = hot_policy.to_take_over(job, [as_copy(record) for record in self.hot.records()])
        return {} if chosen is None else self.hot.take_over(chosen, image_dir)

    def discard(self, image_dir: Path) -> None:
        shutil.rmtree(image_dir, ignore_errors=True)

    def cold_leftovers(self) -> list[Path]:
        """Dumps on disk whose process died before ``put`` stored them (a crashed launcher)."""
        if not self.cold_staging.is_dir():
            return []
        return [p for p in self.cold_staging.iterdir() if p.name.endswith(".partial") and not owner_alive(p)]

    def put(
        self, checkpoint_id: str, job: str, image_dir: Path, meta: Mapping[str, Any] | None = None
    ) -> StoredImage:
        full_meta = {**(meta or {}), "created_at": float((meta or {}).get("created_at") or time.time())}
        if self.hot.owns(image_dir):
            record = self.hot.commit(checkpoint_id, job, image_dir, full_meta)
            self.kick()
            # the destager stores it later: say now if the cold tier cannot take it (the caller warns)
            problem = self.cold_problem()
            if problem is not None:
                record = self.hot.update(checkpoint_id, error=problem) or record
                return dataclasses.replace(self._from_record(record), error=problem)
            return self._from_record(record)
        manifest = self.repo.write(checkpoint_id, job, image_dir, full_meta)
        shutil.rmtree(image_dir, ignore_errors=True)
        return StoredImage(
            checkpoint_id,
            job,
            manifest.size,
            int(manifest.sizes.get("new_bytes", 0)),
            DURABLE,
            created_at=manifest.created_at,
        )

    # -- the destager ---------------------------------------------------------------------------------

    @property
    def lock_path(self) -> Path:
        return self.hot.root / LOCK_FILE

    def destager_running(self) -> bool:
        try:
            if not self.hot.exists():
                return False
            fd = private.open_private(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def kick(self) -> None:
        """Start a destager in the background; it outlives this process and waits for any running one."""
        global _children
        _children = [child for child in _children if child.poll() is None]
        self.hot.ensure()
        try:
            log = private.open_private(self.hot.root / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            raise tier_error(exc, self.hot.root) from exc
        try:
            _children.append(
                subprocess.Popen(
                    [sys.executable, "-m", "torpor.core.store.destager", json.dumps(self.settings.to_dict())],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
            )
        finally:
            os.close(log)

    # -- reading --------------------------------------------------------------------------------------

    def restore_dir(self, checkpoint_id: str) -> Path:
        """In the hot tier when the image is there (links, no copy) or what a restore writes fits; else on disk."""
        if self.hot.record(checkpoint_id) is None:
            streamed = is_bulk if self.settings.stream_restore else lambda _: False
            try:
                # a streamed restore writes only the small files here: the pages go straight to CRIU
                need = sum(e.size for e in self.repo.manifest(checkpoint_id).files if not streamed(e.name))
            except StoreError:
                need = 0  # get() will say what is wrong
            if not self.hot.make_room(need):
                return self.settings.tmp_dir / f"restore-{checkpoint_id}-{os.urandom(3).hex()}"
        return self.hot.restore_dir(checkpoint_id)

    def get(self, checkpoint_id: str, dest: Path) -> None:
        self.fetch(checkpoint_id, dest)()

    def fetch(self, checkpoint_id: str, dest: Path) -> Check:
        """Write the image into ``dest``; every file but the memory pages is verified on return.

        The pages (nearly all of the bytes) are verified by the returned check, which a restore runs
        while CRIU already reads them and which must pass before the job runs again.
        """
        try:
            check = self._fetch_hot(checkpoint_id, dest)
        except OSError as exc:
            raise StoreError(
                f"cannot copy checkpoint {checkpoint_id} from the hot tier into {dest}: {exc.strerror or exc}"
            ) from exc
        if check is None:
            with self._explained(checkpoint_id):
                check = self._fetch_cold(checkpoint_id, dest)

        def hinted() -> None:
            try:
                check()
            except _HotCopyCorrupt:
                raise
            except CorruptImage as exc:
                raise self._with_hint(exc, checkpoint_id) from exc

        return hinted

    def precheck(self, checkpoint_id: str) -> None:
        scratch = self.restore_dir(checkpoint_id)
        try:
            if self._fetch_hot(checkpoint_id, scratch) is not None:
                return  # linked, and all but the pages verified
            with self._explained(checkpoint_id):
                self.repo.read(checkpoint_id, scratch, skip=is_bulk)
            if not self.repo.intact(checkpoint_id):
                raise self._with_hint(
                    CorruptImage(
                        f"checkpoint {checkpoint_id} is damaged: chunks of its memory are missing from "
                        f"the store {self.repo.backend.url}"
                    ),
                    checkpoint_id,
                )
        except OSError as exc:
            raise StoreError(f"cannot check checkpoint {checkpoint_id}: {exc.strerror or exc}") from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def restore_source(self, checkpoint_id: str, lazy: bool, stream: bool) -> RestoreSource:
        """An image in RAM is linked (or, lazily, served by CRIU's daemon from the links); else the cold tier.

        One with no image anywhere gets a cold source too: reading it raises :meth:`_no_image`.
        """
        in_ram = self.hot.record(checkpoint_id) is not None
        if lazy:
            return RestoreSource.LAZY_LOCAL if in_ram else RestoreSource.LAZY_SERVED
        if in_ram:
            return RestoreSource.HOT_LINKED
        return RestoreSource.COLD_STREAMED if stream else RestoreSource.COLD_WHOLE

    def stream_pages(self, checkpoint_id: str, dest: Path) -> PageStream:
        with self._explained(checkpoint_id):
            manifest = self.repo.read(checkpoint_id, dest, skip=is_bulk)
        return _ColdPages(self, manifest)

    def prepare_lazy(self, checkpoint_id: str, dest: Path) -> None:
        with self._explained(checkpoint_id), LazyImage.open(self.repo, checkpoint_id) as image:
            image.prepare(dest)

    def page_source(self, checkpoint_id: str, dest: Path) -> PageSource:
        with self._explained(checkpoint_id):
            image = LazyImage.open(self.repo, checkpoint_id)
            try:
                image.attach(dest)
                image.warm()
            except BaseException:
                image.close()
                raise
        return image

    def _fetch_hot(self, checkpoint_id: str, dest: Path) -> Check | None:
        record = self.hot.record(checkpoint_id)
        if record is None:
            return None
        manifest = None
        if record.state == DURABLE:
            # not found: stored in a cold tier the configuration no longer names (torpor store set --force)
            with contextlib.suppress(StoreError, CheckpointNotFound):
                manifest = self.repo.manifest(checkpoint_id)
        hashed_now = False
        try:
            if manifest is None and not all(digest for _, digest in record.files.values()):
                # not destaged yet, so no manifest: the first restore takes the hashes later ones check
                record = self.hot.hash_files(checkpoint_id)
                hashed_now = True
            if record is None or not self.hot.link_out(record, dest):
                return None
        except FileNotFoundError:
            return None  # dropped from the hot tier meanwhile (it is durable): read the cold copy
        workers = self.settings.store_workers
        if manifest is not None:
            entries = {entry.name: entry for entry in manifest.files}
            missing = sorted(set(record.files) - set(entries))
            if missing:
                raise CorruptImage(f"checkpoint {checkpoint_id}: its manifest lacks {', '.join(missing)}")
            codec = self.repo.codec

            def by_manifest(bulk: bool) -> None:
                chosen = [e for name, e in entries.items() if name in record.files and is_bulk(name) == bulk]
                try:
                    verify_extents(codec, dest, chosen, checkpoint_id, workers)
                except CorruptImage as exc:
                    # the hot copy is only a cache of a durable image: drop it, the store's copy remains
                    self.hot.remove(checkpoint_id)
                    raise _HotCopyCorrupt(
                        f"{exc.message} (its copy in the hot tier {self.hot.root}); that copy was dropped: "
                        "restore again to read the checkpoint from the store"
                    ) from exc

            by_manifest(False)
            return lambda: by_manifest(True)
        if hashed_now:
            return lambda: None  # hashed from these very files a moment ago

        def by_hash(bulk: bool) -> None:
            for name, (_size, digest) in record.files.items():
                if is_bulk(name) == bulk and hash_file(dest / name) != digest:
                    raise CorruptImage(
                        f"checkpoint {checkpoint_id} is corrupt in the hot tier: {name} does not match its hash"
                    )

        by_hash(False)
        return lambda: by_hash(True)

    def _fetch_cold(self, checkpoint_id: str, dest: Path) -> Check:
        manifest = self.repo.read(checkpoint_id, dest, defer=is_bulk)
        later = [entry for entry in manifest.files if is_bulk(entry.name)]
        codec, workers = self.repo.codec, self.settings.store_workers
        return lambda: verify_extents(codec, dest, later, checkpoint_id, workers, zeros=False)

    @contextlib.contextmanager
    def _explained(self, checkpoint_id: str) -> Iterator[None]:
        """Reading ``checkpoint_id`` from the cold tier: a missing image said as :meth:`_no_image`, a
        damaged one with :meth:`_with_hint`."""
        try:
            yield
        except CheckpointNotFound as exc:
            raise self._no_image(checkpoint_id) from exc
        except CorruptImage as exc:
            raise self._with_hint(exc, checkpoint_id) from exc

    def _no_image(self, checkpoint_id: str) -> CheckpointNotFound:
        return CheckpointNotFound(
            f"checkpoint {checkpoint_id} has no image: it is not in the hot tier {self.hot.root} nor "
            f"in the store {self.repo.backend.url} (a checkpoint that was not yet durable is lost "
            "when the machine restarts)"
        )

    def _with_hint(self, exc: CorruptImage, checkpoint_id: str) -> CorruptImage:
        good = self._newest_good(checkpoint_id)
        hint = (
            f"; the newest intact checkpoint of this job is {good} (torpor restore JOB --from {good})"
            if good
            else "; no intact older checkpoint of this job was found"
        )
        return CorruptImage(exc.message + hint, details=exc.details)

    def _newest_good(self, bad_id: str) -> str | None:
        bad_record = self.hot.record(bad_id)
        try:
            job = bad_record.job if bad_record is not None else self.repo.manifest(bad_id).job
        except (StoreError, CheckpointNotFound):
            return None
        candidates: list[tuple[float, str]] = []
        for record in self.hot.records():
            if record.job == job and record.id != bad_id:
                candidates.append((record.created_at, record.id))
        chunks = self.repo.stored_chunks()
        for checkpoint_id in self.repo.ids():
            if checkpoint_id == bad_id:
                continue
            with contextlib.suppress(StoreError):
                manifest = self.repo.manifest(checkpoint_id)
                if manifest.job == job and self.repo.intact(checkpoint_id, chunks):
                    candidates.append((manifest.created_at, checkpoint_id))
        bad_chunks = set()
        with contextlib.suppress(StoreError, CheckpointNotFound):
            for chunk in set(self.repo.manifest(bad_id).chunk_ids()):
                if not self._chunk_ok(chunk):
                    bad_chunks.add(chunk)
        for _, checkpoint_id in sorted(candidates, reverse=True):
            if self.hot.record(checkpoint_id) is not None:
                return checkpoint_id
            with contextlib.suppress(StoreError):
                if not bad_chunks & set(self.repo.manifest(checkpoint_id).chunk_ids()):
                    return checkpoint_id
        return None

    def _chunk_ok(self, chunk: str) -> bool:
        try:
            self.repo.codec.decode(KIND_CHUNK, self.repo.load_chunk(chunk), chunk, bytes.fromhex(chunk))
        except StoreError:
            return False
        return True

    def _from_record(self, record: HotRecord) -> StoredImage:
        progress = None
        if record.state == DESTAGING and record.size:
            progress = min(1.0, record.done_bytes / record.size)
        return StoredImage(
            record.id,
            record.job,
            record.size,
            record.stored_bytes or 0,
            record.state,
            progress,
            record.error,
            created_at=record.created_at,
        )

    def state(self, checkpoint_id: str) -> StoredImage:
        record = self.hot.record(checkpoint_id)
        if record is not None:
            image = self._from_record(record)
            if record.state != DURABLE and not record.error and not self.destager_running():
                # a destager died (killed, machine busy, crash): looking is enough to start another
                image = dataclasses.replace(image, state=STAGED, progress=None)
                if time.monotonic() - self._kicked > 5:
                    self._kicked = time.monotonic()
                    self.kick()
            return image
        manifest = self.repo.manifest(checkpoint_id)
        return StoredImage(
            checkpoint_id,
            manifest.job,
            manifest.size,
            int(manifest.sizes.get("new_bytes", 0)),
            DURABLE,
            created_at=manifest.created_at,
        )

    def wait_durable(
        self,
        checkpoint_id: str,
        progress: Callable[[StoredImage], None] | None = None,
        timeout: float | None = None,
    ) -> StoredImage:
        deadline = None if timeout is None else time.monotonic() + timeout
        record = self.hot.record(checkpoint_id)
        if record is not None and record.error:  # a retry: the user may have made room since
            self.hot.update(checkpoint_id, error=None)
        kicked = 0.0
        seen_running = False
        while True:
            image = self.state(checkpoint_id)
            if image.state == DURABLE:
                return image
            running = self.destager_running()
            seen_running = seen_running or running
            if image.error and (seen_running or not running):
                raise StoreError(
                    f"checkpoint {checkpoint_id} is not durable: {image.error}; it stays in the hot tier "
                    f"{self.hot.root} (lost if the machine restarts); once the cause is fixed, the next "
                    "checkpoint or 'torpor gc' stores it"
                )
            if not running and time.monotonic() - kicked > 5:
                self.kick()
                kicked = time.monotonic()
            if progress is not None:
                progress(image)
            if deadline is not None and time.monotonic() > deadline:
                raise StoreError(f"checkpoint {checkpoint_id} did not become durable in {timeout:.0f} s")
            time.sleep(0.02)

    def list(self) -> list[StoredImage]:
        images = {record.id: self.state(record.id) for record in self.hot.records()}
        pinned = self.pinned()
        for checkpoint_id in self.repo.ids():
            if checkpoint_id not in images:
                with contextlib.suppress(StoreError):
                    images[checkpoint_id] = self.state(checkpoint_id)
        return sorted(
            (dataclasses.replace(image, pinned=image.checkpoint_id in pinned) for image in images.values()),
            key=lambda image: image.created_at,
        )

    # -- deleting -------------------------------------------------------------------------------------

    def delete(self, checkpoint_id: str) -> None:
        self.hot.remove(checkpoint_id)
        self.repo.delete(checkpoint_id)

    def set_pinned(self, checkpoint_id: str, pinned: bool) -> None:
        self.repo.set_pinned(checkpoint_id, pinned)

    def pinned(self) -> set[str]:
        return self.repo.pinned()

    def retry(self) -> None:
        """Start a destager for images a failure left staged (e.g. the cold tier was full or misset)."""
        if not self.destager_running() and any(r.state != DURABLE for r in self.hot.records()):
            self.kick()

    def gc(self) -> GcResult:
        self.retry()
        report = self.repo.gc()
        return GcResult(report.manifests, report.chunks_kept, report.chunks_deleted)


class _ColdPages:
    """The memory pages of a checkpoint in the cold tier, fetched and verified chunk by chunk as written.

    Each chunk is read into a buffer of the pipe and verified there (:meth:`Repository.pipe_file`);
    CRIU copies it out once, straight into the process. Chunks already in memory (the page cache of a
    local folder, as right after a hibernation) are read and verified by the writer itself, in turn;
    chunks on disk are loaded ahead by one thread, a remote backend's by ``store_workers`` at once
    (:func:`torpor.policy.readahead.loads_ahead` says which).
    """

    def __init__(self, store: TieredStore, manifest: Manifest) -> None:
        self._store = store
        self._repo = store.repo  # the store it was read from, even if the configuration changes meanwhile
        self._manifest = manifest
        self._entries = {entry.name: entry for entry in manifest.files if is_bulk(entry.name)}
        self.names = frozenset(self._entries)
        workers = max(1, store.settings.store_workers) if self._repo.backend.remote else 1
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="stream")  # its threads start on use
        self._ahead = max(4, 2 * workers)

    def write(self, name: str, fd: int) -> None:
        entry = self._entries[name]
        in_memory = self._repo.in_memory([chunk for _, _, chunk in entry.extents if chunk is not None])
        pool = self._pool if readahead.loads_ahead(in_memory) else None
        try:
            self._repo.pipe_file(self._manifest.id, entry, fd, pool, self._ahead)
        except CorruptImage as exc:
            raise self._store._with_hint(exc, self._manifest.id) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
