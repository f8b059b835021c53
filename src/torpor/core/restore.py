"""A restore, as it runs inside the job's new launcher, and the fix-ups of the job's world before it.

Order of a restore (driven by :meth:`torpor.core.engine.Engine.restore`): claim (hibernated/exited/failed
→ restoring), wait for the old processes to be gone, fetch the image from the one restore source the
store chose (every byte verified), :func:`rewind_written_files` and :func:`recreate_socket_folders`, then
a launcher runs :func:`restore_into_launcher` (``criu restore`` and the GPU stage), job → running. On
failure the job goes back to the state it had; the image stays.

Fetching and verifying images is the store's; reading CRIU's image files is the adapters'.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import threading
from collections.abc import Collection
from pathlib import Path

from torpor.adapters import system
from torpor.adapters.criu import RestoreGate
from torpor.adapters.criuimage import OpenFile, open_files, unix_socket_paths
from torpor.adapters.pageserver import PageServer
from torpor.core.context import Context, Progress
from torpor.core.records import CheckpointId, Job
from torpor.core.store import PageSource
from torpor.errors import RestoreFailed, TorporError

#: how the record of a job torpor killed because a lazy restore could not bring its memory in begins
LAZY_KILL = "lazy restore failed, the job was killed"


def restore_into_launcher(
    ctx: Context,
    job: Job,
    image_dir: Path,
    checkpoint_id: CheckpointId,
    lazy: bool = False,
    gate: RestoreGate | None = None,
    served: bool = False,
    stream: bool = False,
) -> int:
    """Run ``criu restore`` from ``image_dir`` (the launcher becomes the tree's parent); return its pid.

    ``lazy``: the job starts before its memory is in; ``criu lazy-pages`` serves it from ``image_dir``,
    or, when ``served``, from the store through torpor's page server (the store's ``page_source``);
    ``image_dir`` is deleted once that daemon is done. ``gate``: the image's pages are still being
    verified; CRIU restores the tree meanwhile and lets it run only on a good verdict. ``stream``: CRIU
    reads every file from the image streamer the caller runs on ``image_dir`` (``criu restore --stream``).
    """
    daemon = None
    server: PageServer | None = None
    source: PageSource | None = None
    restored = threading.Event()
    root: list[int] = []

    def kill_tree(exc: BaseException) -> None:
        # memory the daemon can no longer get would read as zeros: the job must not run on
        restored.wait(60)
        message = exc.message if isinstance(exc, TorporError) else str(exc)
        ctx.killed_because = f"{LAZY_KILL}: {message}"
        for pid in root:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    try:
        if lazy:
            log = ctx.criu_log(job.name, "lazy-pages", checkpoint_id)
            if served:
                source = ctx.store.page_source(checkpoint_id, image_dir)
                server, criu_end = PageServer.pair(source.read_pages, on_failure=kill_tree)
                server.start()
                try:
                    daemon = ctx.criu.start_lazy_pages(image_dir, log, page_server_fd=criu_end.fileno())
                finally:
                    criu_end.close()
            else:
                daemon = ctx.criu.start_lazy_pages(image_dir, log)
        pid = ctx.criu.restore(
            image_dir,
            ctx.criu_log(job.name, "restore", checkpoint_id),
            image_dir / "restored.pid",
            extra=ctx.settings.criu_extra,
            lazy=lazy,
            gate=gate,
            stream=stream,
        )
        root.append(pid)
        restored.set()
        ctx.gpu.after_restore(system.namespace_members(pid))
    except BaseException:
        restored.set()
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        if server is not None:
            server.stop()
        if source is not None:
            source.close()
        shutil.rmtree(image_dir, ignore_errors=True)
        raise
    if daemon is None:
        shutil.rmtree(image_dir, ignore_errors=True)
    else:
        lazy_daemon = ctx.lazy_pages = daemon

        def clean_up() -> None:
            lazy_daemon.wait()
            if server is not None:
                server.wait(10)
                server.stop()
            if source is not None:
                source.close()
            shutil.rmtree(image_dir, ignore_errors=True)

        threading.Thread(target=clean_up, name="lazy-pages", daemon=True).start()
    return pid


def written_sizes(files: list[OpenFile]) -> dict[Path, tuple[int, bool]]:
    """Each regular file the job had open for writing: (its size at the checkpoint, CRIU checks it).

    CRIU records the size of a file open for writing, and refuses to restore when it changed ("bad
    size") — except for files opened with O_APPEND (logs, CSV files), whose size it does not record.
    For those, the offset of a descriptor that appended is where the file ended after its last write,
    which is its size at the checkpoint when the job is its only writer; a descriptor that never wrote
    (offset 0) says nothing.
    """
    checked: dict[Path, int] = {}
    appended: dict[Path, int] = {}
    for entry in files:
        if not entry.writable:
            continue
        path = Path(entry.path if entry.path.startswith("/") else "/" + entry.path)
        if entry.size is not None:
            checked[path] = entry.size
        elif entry.append and entry.pos > 0:
            appended[path] = max(appended.get(path, 0), entry.pos)
    sizes = {path: (size, False) for path, size in appended.items()}
    sizes.update((path, (size, True)) for path, size in checked.items())
    return sizes


def rewind_written_files(image_dir: Path, keep_dir: Path, keep: Collection[Path] = ()) -> list[str]:
    """Bring files the job had open for writing back to their size at the checkpoint.

    That is the normal case after rolling back, or resuming a job that kept running after its
    checkpoint: the job continues from the checkpoint and writes again what followed it. A file that
    grew is cut back to its checkpoint size (see :func:`written_sizes`), and the bytes cut off are saved
    under ``keep_dir``, so nothing is lost. A file CRIU checks that shrank cannot be made consistent:
    that is an error. Files in ``keep`` (the job's own output log, a record of all that happened) are
    left as they are.
    """
    rewound = []
    for path, (size, checked) in written_sizes(open_files(image_dir)).items():
        if path in keep:
            continue
        try:
            current = path.lstat()
        except FileNotFoundError:
            continue  # CRIU explains a missing file itself
        if stat.S_ISLNK(current.st_mode) or os.path.realpath(path) != str(path):
            # CRIU recorded where the file really was: a link there now was put there since, maybe by
            # someone who wants root to cut another file
            raise RestoreFailed(
                f"{path} is now reached through a symbolic link ({os.path.realpath(path)}); torpor does "
                "not rewind a file through a link: put the job's file back at that path"
            )
        if not stat.S_ISREG(current.st_mode) or current.st_size == size:
            continue
        if current.st_size < size:
            if not checked:
                continue  # the job appends at the end wherever it is (e.g. after a log rotation)
            raise RestoreFailed(
                f"{path} is shorter than when the checkpoint was taken ({current.st_size} < {size} "
                "bytes): it was truncated or replaced, so the job cannot be restored consistently"
            )
        system.make_private_dirs(keep_dir)
        saved = keep_dir / (str(path).strip("/").replace("/", "%") + f".after-{size}")
        with open(system.open_private(path, os.O_RDWR | os.O_NOCTTY), "r+b") as handle:
            handle.seek(size)
            with os.fdopen(system.open_private(saved, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as out:
                shutil.copyfileobj(handle, out)
            handle.truncate(size)
        rewound.append(str(path))
    return rewound


def recreate_socket_folders(image_dir: Path) -> list[str]:
    """Create the missing folders of unix sockets the job had bound, so CRIU can bind them again.

    A program that was killed (rather than hibernated) often removed them on its way out — Python's
    multiprocessing deletes its ``/tmp/pymp-*`` folder — and CRIU cannot bind a socket in a missing folder.
    """
    created = []
    for socket_path in unix_socket_paths(image_dir):
        folder = Path(socket_path).parent
        if not folder.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            created.append(str(folder))
    return created


# -- in the CLI, around the launcher's restore -------------------------------------------------------


def prepare_world(
    ctx: Context, job: Job, checkpoint_id: CheckpointId, image_dir: Path, progress: Progress
) -> None:
    """Make the job's written files and socket folders what its image in ``image_dir`` expects."""
    rewound_dir = ctx.settings.job_dir(job.name) / "rewound"
    rewound = rewind_written_files(image_dir, rewound_dir / checkpoint_id, keep={Path(job.log_path)})
    if rewound:
        progress(
            f"rewound {len(rewound)} file(s) the job writes to their size at the checkpoint "
            f"(later bytes saved under {rewound_dir})"
        )
    recreated = recreate_socket_folders(image_dir)
    if recreated:
        progress(f"recreated {len(recreated)} missing folder(s) of the job's unix sockets")
