"""The destager: a detached process that moves staged images from the hot tier into the cold tier.

A checkpoint starts one as its dump begins, so that its start-up is not on the way to durable; while
CRIU still writes the image, it stores the chunks CRIU has written (``Repository.prestore``), on one
idle-priority thread, and destages the rest once the dump is committed. ``put`` starts another
destager (``wait_durable`` too, if none runs); it survives the CLI and the job's launcher. At most one
works per hot tier: it holds ``destager.lock`` (flock), and a newly started one waits for it, then
looks again — so no staged image is ever left behind by a race.

Crash recovery is the normal path: a destager killed mid-way leaves its image staged in the hot tier and
some chunks in the cold tier, but no manifest, so the image is never listed as durable there. The next
destager stores it again (chunks already stored are skipped) and removes leftovers of dead dumps.

Which RAM copies go once an image is durable, and which go to make room, is decided by
:mod:`torpor.policy.hot`; the destager removes them and says so in its log.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

from torpor.adapters.system import private
from torpor.core.store.base import DESTAGING, DURABLE, STAGED
from torpor.core.store.hot import HotRecord, as_copy, dumped_kind, dumped_pids, owner_alive, tier_error
from torpor.core.store.prestore import Prestored
from torpor.core.store.tiered import LOCK_FILE, TieredStore
from torpor.errors import TorporError
from torpor.policy import hot as hot_policy
from torpor.settings import Settings

#: how long a destager waits for a dump in progress before it leaves the image to the one ``put`` starts
LINGER_S = 30.0


def _log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} destager {os.getpid()}: {text}", flush=True)


def destage(store: TieredStore, record: HotRecord, prestored: Prestored | None = None) -> None:
    hot, repo = store.hot, store.repo
    total = record.size
    hot.update(record.id, state=DESTAGING, done_bytes=0, error=None)
    started = time.monotonic()
    if repo.has(record.id):  # stored before a crash, only the hot record was not updated
        manifest = repo.manifest(record.id)
    else:
        last = [0.0]

        def progress(done: int, _total: int) -> None:
            if time.monotonic() - last[0] > 0.25:
                last[0] = time.monotonic()
                hot.update(record.id, done_bytes=done)

        manifest = repo.write(
            record.id,
            record.job,
            hot.image_dir(record.id),
            record.meta,
            progress=progress,
            skip=lambda name: name not in record.files,
            prestored=prestored,
            cache=hot_policy.read_back_soon(as_copy(record).kind),
        )
    if hot.record(record.id) is None:  # deleted while we stored it
        repo.delete(record.id)
        return
    hot.update(
        record.id,
        state=DURABLE,
        done_bytes=total,
        stored_bytes=int(manifest.sizes.get("new_bytes", 0)),
        error=None,
    )
    seconds = time.monotonic() - started
    _log(
        f"{record.id} ({record.job}) durable: {total / 2**20:.1f} MiB in {seconds:.2f} s, "
        f"{int(manifest.sizes.get('new_bytes', 0)) / 2**20:.1f} MiB new"
    )
    # which RAM copies go is the policy's (a restore already linking one keeps its links; a later one
    # reads the cold tier)
    others = [as_copy(other) for other in hot.records()]
    for checkpoint_id in hot_policy.after_durable(as_copy(record), others):
        hot.remove(checkpoint_id)
        if checkpoint_id == record.id:
            _log(f"{record.id} ({record.job}) hibernated: dropped its RAM copy")
        else:  # an older copy of the same job
            _log(f"{checkpoint_id} ({record.job}) dropped its RAM copy: {record.id} is newer and durable")


def _dump_over(partial: Path, deadline: float) -> bool:
    """Whether a dump into ``partial`` is complete (renamed), failed (gone, or its owner died) or too long."""
    try:
        return not owner_alive(partial) or time.monotonic() > deadline
    except OSError:
        return True


def run(store: TieredStore) -> int:
    try:
        if not store.hot.exists():  # checked to be torpor's own before anything is written there
            return 0
        fd = private.open_private(store.hot.root / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    except FileNotFoundError:
        return 0  # the hot tier was removed (and with it anything to destage)
    except OSError as exc:
        raise tier_error(exc, store.hot.root) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        for leftover in [*store.hot.leftovers(), *store.cold_leftovers()]:
            _log(f"removing leftover {leftover.name}")
            shutil.rmtree(leftover, ignore_errors=True)
        failed: set[str] = set()
        ahead: dict[str, Prestored] = {}  # by checkpoint id
        # waiting for a dump longer than this is not worth a process: ``put`` starts another destager
        linger_until = time.monotonic() + LINGER_S
        while True:
            pending = [r for r in store.hot.records() if r.state != DURABLE and r.id not in failed]
            if not pending:
                dumps = store.hot.dumps_in_progress() if time.monotonic() < linger_until else []
                if not dumps:
                    break
                # started by a checkpoint whose dump is still being written: store what CRIU wrote so far
                fresh = [d for d in dumps if d.name.removesuffix(".partial") not in ahead]
                if not fresh:
                    time.sleep(0.02)  # done with these: wait for their commits (or another dump)
                    continue
                partial = fresh[0]
                checkpoint_id = partial.name.removesuffix(".partial")
                prestored = ahead[checkpoint_id] = Prestored()
                try:
                    store.repo.prestore(
                        partial,
                        prestored,
                        finished=functools.partial(_dump_over, partial, linger_until),
                        memory_of=dumped_pids(partial),
                        cache=hot_policy.read_back_soon(dumped_kind(partial)),
                    )
                    memory = prestored.memory_read / 2**20
                    image = sum(piece[2] for piece in prestored.pieces) / 2**20
                    _log(
                        f"{checkpoint_id}: stored while it was dumped: {memory:.0f} MiB of memory, "
                        f"{image:.0f} MiB of its image"
                    )
                except (TorporError, OSError) as exc:  # only a head start: destaging says what is wrong
                    _log(f"{checkpoint_id}: storing while it is dumped failed: {exc}")
                continue
            record = pending[0]
            try:
                destage(store, record, ahead.pop(record.id, None))
            except FileNotFoundError:
                _log(f"{record.id} vanished from the hot tier while it was stored (deleted)")
                failed.add(record.id)
            except TorporError as exc:
                _log(f"{record.id} not durable: {exc.message}")
                store.hot.update(record.id, state=STAGED, error=exc.message)
                failed.add(record.id)
            except OSError as exc:
                _log(f"{record.id} not durable: {exc}")
                store.hot.update(record.id, state=STAGED, error=f"destaging failed: {exc}")
                failed.add(record.id)
        store.hot.make_room(0)
    finally:
        os.close(fd)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    os.umask(private.PRIVATE_UMASK)  # as its starter's already: what it writes is private
    # the store configuration is not in these settings: TieredStore reads the state directory's
    settings = Settings.from_dict(json.loads(args[0]))
    try:
        return run(TieredStore(settings))
    except TorporError as exc:
        _log(f"stopped: {exc.message}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
