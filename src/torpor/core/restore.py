"""A restore, as it runs inside the job's new launcher, and the fix-ups of the job's world before it.

Order of a restore (driven by :meth:`torpor.core.engine.Engine.restore`): claim (hibernated/exited/failed
→ restoring), wait for the old processes to be gone, fetch the image from the one restore source the
store chose (every byte verified), :func:`prepare_world` (the written files rewound as
:mod:`torpor.core.rewind` says, socket folders), then a launcher runs :func:`restore_into_launcher`
(``criu restore`` and the GPU stage), job → running. On failure the job goes back to the state it had,
the rewound files are put back as they were, and the image stays.

Fetching and verifying images is the store's; reading CRIU's image files is the adapters'.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from torpor.adapters.criu import RestoreGate, restored_root
from torpor.adapters.criuimage import has_ghost_files, shared_file_mappings, unix_socket_paths
from torpor.adapters.pageserver import PageServer
from torpor.adapters.system import ownprocess, private, procfs
from torpor.core.context import Context, Progress, quiet
from torpor.core.jobnetworks import NET_KEY
from torpor.core.moves import Moves
from torpor.core.recordtypes import CheckpointId, Job, JobState
from torpor.core.rewind import Rewound, load_stopped, rewind_written_files
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
    copy_of: str | None = None,
    net_namespace: str | None = None,
    net_external: bool = False,
) -> int:
    """Run ``criu restore`` from ``image_dir`` (the launcher becomes the tree's parent); return its pid.

    ``lazy``: the job starts before its memory is in; ``criu lazy-pages`` serves it from ``image_dir``,
    or, when ``served``, from the store through torpor's page server (the store's ``page_source``);
    ``image_dir`` is deleted once that daemon is done. ``gate``: the image's pages are still being
    verified; CRIU restores the tree meanwhile and lets it run only on a good verdict. ``stream``: CRIU
    reads every file from the image streamer the caller runs on ``image_dir`` (``criu restore --stream``).
    ``copy_of``: the image is a template's, whose job wrote to the log ``copy_of``: this job is a new
    copy, which writes to its own log and leaves the original's TCP connections alone.
    ``net_namespace``: the tree joins that network namespace (its own network, ``--own-network``);
    ``net_external``: the image was dumped in a job network, named external to it
    (:mod:`torpor.core.jobnetworks`): it is handed ``net_namespace``, or the machine's own when None.

    Once the tree runs, each of its processes that handles ``SIGCONT`` gets one: :data:`RESTORED_SIGNAL`.
    """
    daemon = None
    server: PageServer | None = None
    source: PageSource | None = None
    restored = threading.Event()
    root: list[int] = []

    def kill_tree(exc: BaseException) -> None:
        # memory the daemon can no longer get would read as zeros: the job must not run on. Its root is
        # known from CRIU's pidfile before the tree runs: waiting for criu restore to return instead
        # could wait for ever, when CRIU's own last steps wait on the very page that failed
        message = exc.message if isinstance(exc, TorporError) else str(exc)
        ctx.killed_because = f"{LAZY_KILL}: {message}"
        written = restored_root(image_dir / "restored.pid", restored)
        # a restore that returned without a root failed, and CRIU killed the tree itself
        targets = root or ([written] if written is not None and not restored.is_set() else [])
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    try:
        gpus = ctx.gpu.before_restore(image_dir)  # refused here, before anything runs
        if lazy:
            log = ctx.criu_log(job.name, "lazy-pages", checkpoint_id)
            if served:
                # criu lazy-pages starts while the store reads the image's pagemaps and writes the memory
                # criu restore reads itself (the daemon needs neither until criu restore runs, after both)
                attached: list[PageSource] = []
                server, criu_end = PageServer.pair(
                    lambda pid, vaddr, nr_pages: attached[0].read_pages(pid, vaddr, nr_pages),
                    on_failure=kill_tree,
                )
                server.start()
                try:
                    daemon = ctx.criu.start_lazy_pages(
                        image_dir, log, page_server_fd=criu_end.fileno(), wait=False
                    )
                finally:
                    criu_end.close()
                source = ctx.store.page_source(checkpoint_id, image_dir)
                attached.append(source)
                ctx.criu.wait_lazy_pages(daemon, image_dir, log)
            else:
                daemon = ctx.criu.start_lazy_pages(image_dir, log)
        # the CPUs kept quick to wake while CRIU restores (ownprocess.cpu_wakeups_held)
        with (
            _one_at_a_time(ctx, image_dir),
            ownprocess.cpu_wakeups_held(ctx.settings.hold_cpu_wakeups),
            _handed_over(job, copy_of, net_namespace if net_external else None, net_external) as files,
        ):
            pid = ctx.criu.restore(
                image_dir,
                ctx.criu_log(job.name, "restore", checkpoint_id),
                image_dir / "restored.pid",
                extra=ctx.settings.criu_extra,
                lazy=lazy,
                gate=gate,
                stream=stream,
                files=files,
                fresh_copy=copy_of is not None,
                net_namespace=None if net_external else net_namespace,
            )
        root.append(pid)
        restored.set()
        members = procfs.namespace_members(pid)
        ctx.gpu.after_restore(members, gpus)
        tell_restored(members)
    except BaseException as exc:
        restored.set()
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        if server is not None:
            server.stop()
        if source is not None:
            source.close()
        shutil.rmtree(image_dir, ignore_errors=True)
        if server is not None and isinstance(server.error, TorporError) and isinstance(exc, RestoreFailed):
            # the tree was killed because the store could not give one of its pages: that is the cause
            raise server.error from exc
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


#: the signal a restored job's processes get once they run again, if they handle it (and only then: it
#: is harmless to a process that does not, and means "you were stopped, go on", which a restore is)
RESTORED_SIGNAL = signal.SIGCONT


def tell_restored(pids: list[int]) -> list[int]:
    """Send :data:`RESTORED_SIGNAL` to those of ``pids`` that handle it; the ones told."""
    told = []
    for pid in pids:
        if procfs.catches(pid, RESTORED_SIGNAL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, RESTORED_SIGNAL)
                told.append(pid)
    return told


@contextlib.contextmanager
def _one_at_a_time(ctx: Context, image_dir: Path) -> Iterator[None]:
    """Restores of one image with ghost files (files deleted while open, e.g. a POSIX semaphore in
    /dev/shm) one after the other: CRIU makes each ghost again at the same path of its own making while
    it restores, so two copies of a template started at once would collide ("Can't create ghost
    regfile: File exists"). Other restores run side by side; those of other state directories are not
    held (their images are other images)."""
    if not has_ghost_files(image_dir):
        yield
        return
    private.make_private_dirs(ctx.settings.run_dir)
    with private.locked(ctx.settings.run_dir / "restore-ghosts.lock"):
        yield


@contextlib.contextmanager
def _handed_over(
    job: Job, copy_of: str | None, net_namespace: str | None, net_external: bool
) -> Iterator[dict[str, int]]:
    """The descriptors CRIU restores in place of what the image names (``--inherit-fd``): for a copy of a
    template's job, this job's log in place of ``copy_of``; for an image dumped in a job network, the
    network namespace ``net_namespace`` (the machine's own when None)."""
    handed: dict[str, int] = {}
    try:
        if copy_of is not None:
            log = private.open_private(Path(job.log_path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            handed[log_key(copy_of)] = log
        if net_external:
            handed[NET_KEY] = os.open(net_namespace or "/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        yield handed
    finally:
        for fd in handed.values():
            os.close(fd)


def log_key(log_path: str) -> str:
    """How ``criu restore --inherit-fd`` names a regular file of the image: its path without the '/'."""
    return os.path.normpath(log_path).lstrip("/")


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
    ctx: Context,
    job: Job,
    checkpoint_id: CheckpointId,
    image_dir: Path,
    progress: Progress,
    rewind: bool = False,
    warn: Progress = quiet,
) -> Rewound:
    """Make the job's written files and socket folders what its image in ``image_dir`` expects.

    ``job`` is the record as it was before the restore claimed it (how and when the job stopped);
    ``rewind``: cut files someone else changed since then too. The caller undoes the cuts
    (:meth:`Rewound.undo`) if the restore does not go through. ``warn`` is told of the files the job
    maps shared when it ran on after this checkpoint: they are not rolled back.
    """
    job_dir = ctx.settings.job_dir(job.name)
    rewound_dir = job_dir / "rewound"
    latest = ctx.records.latest_checkpoint(job.name)
    checkpoint = ctx.records.find_checkpoint(job.name, checkpoint_id)
    stopped_here = job.state == JobState.HIBERNATED and latest is not None and latest.id == checkpoint_id
    at_stop = {}
    if job.state == JobState.HIBERNATED:
        at_stop = load_stopped(job_dir, latest.id if latest else None)
    if not stopped_here:
        mapped = [path for path in shared_file_mappings(image_dir) if os.path.exists(path)]
        if mapped:
            warn(
                f"{len(mapped)} file(s) the job maps shared (MAP_SHARED) are not rolled back: the restored "
                f"job sees what was written to them after checkpoint {checkpoint_id}: {', '.join(mapped)}"
            )
    rewound = rewind_written_files(
        image_dir,
        rewound_dir / checkpoint_id,
        keep=frozenset(
            {Path(job.log_path), *(Path(p) for p in [Moves(ctx.records).image_log(checkpoint_id)] if p)}
        ),
        at_stop=at_stop,
        stopped_ns=int(job.ended_at * 1e9) if job.ended_at else None,
        rewind=rewind,
        checkpoint_ns=None if stopped_here else int(checkpoint.created_at * 1e9),
    )
    if rewound.paths:
        progress(
            f"rewound {len(rewound.paths)} file(s) the job writes to their size at the checkpoint "
            f"(later bytes saved under {rewound_dir})"
        )
    if rewound.changed_inside:
        warn(
            f"{len(rewound.changed_inside)} file(s) the job opened read-write were modified after checkpoint "
            f"{checkpoint_id}: torpor cut back what was added to them, but what was rewritten inside them "
            "stays, so the restored job may find them ahead of its memory (a database's files: restore it "
            f"with them only if the program recovers from that): {', '.join(rewound.changed_inside)}"
        )
    if rewound.changed_elsewhere:
        progress(
            f"--rewind: {len(rewound.changed_elsewhere)} file(s) changed by someone else since the job "
            f"stopped, restored on anyway: {', '.join(rewound.changed_elsewhere)}"
        )
    recreated = recreate_socket_folders(image_dir)
    if recreated:
        progress(f"recreated {len(recreated)} missing folder(s) of the job's unix sockets")
    return rewound
