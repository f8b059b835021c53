"""A checkpoint, as it runs inside the job's launcher: the dump, the commit, retention, the rollback.

The launcher is the one process that can tell a job killed by a hibernating dump from a crash, so the
whole checkpoint runs there (:func:`checkpoint_in_launcher`), asked by the CLI over the control socket.
Order of a checkpoint::

    claim the job (running → checkpointing/hibernating)
    refuse what CRIU cannot dump before anything is frozen (io_uring)
    GPU stage: device state to host            ← adapters.gpu (no-op for CPU jobs)
    memory set aside in the staging folder     (its last copy's in RAM, or a checkpoint's zeros, written now)
    criu dump --stream, torpor writing it      (job frozen only here; retried as policy.retry says)
      into the store's staging folder
    GPU stage: give the device back (if the job keeps running)
    store.put (commit: the checkpoint becomes visible)
    record the checkpoint, apply retention; job → running / hibernated

Any failure before the commit leaves the job running: CRIU resumes it, we SIGCONT anything left stopped,
and a hibernation whose image cannot be committed is restored from its staging folder at once. Which
checkpoints retention deletes and whether a dump is tried again are decisions of :mod:`torpor.policy`.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from torpor.adapters import gpu
from torpor.adapters.criu import Criu, StreamedDump
from torpor.adapters.criuimage import DumpStats
from torpor.adapters.criulog import log_excerpt
from torpor.adapters.imagestreamer import ImageCapture
from torpor.adapters.system import ownprocess, procfs, sockets
from torpor.core import jobnetworks, precopy, rewind
from torpor.core.context import Context, Progress, quiet
from torpor.core.control import CheckpointReply
from torpor.core.recordtypes import Checkpoint, CheckpointId, CheckpointKind, JobName, JobState
from torpor.core.store.pagemap import PAGE_SIZE
from torpor.errors import (
    CheckpointFailed,
    JobExited,
    NotTrackable,
    PreCopyIncomplete,
    StorageFull,
    TorporError,
)
from torpor.policy import retention, retry
from torpor.policy.scheduler.sizes import format_size
from torpor.settings import GPU_UNVERIFIED


class Supervisor(Protocol):
    """What a checkpoint needs of the launcher that runs it."""

    @property
    def pid(self) -> int | None:
        """The job's root, while it has one."""

    def adopt(self, pid: int) -> None:
        """Supervise the tree rooted at ``pid`` instead (a failed hibernation restored it)."""


def checkpoint_in_launcher(
    ctx: Context,
    name: JobName,
    pid: int,
    hibernate: bool,
    launcher: Supervisor,
    progress: Progress,
    *,
    ext_unix_sk: bool = False,
    for_copies: bool = False,
) -> CheckpointReply:
    """Dump job ``name`` (root ``pid``) into the store; the launcher holds its operation lock.

    ``ext_unix_sk``: the job's unix sockets connected to processes outside it are saved without their
    outside end (a restore gives them a closed one); otherwise such a socket fails the dump.

    An image the cold tier cannot take now stays in RAM only, and the reply's ``not_durable`` says why.

    ``for_copies``: the image is a template's (copies start from it): connections still waiting to be
    accepted are left out of it (``--skip-in-flight``) instead of failing the dump; they are the running
    job's, and a readiness probe may just have made one.
    """
    if ctx.lazy_pages is not None and ctx.lazy_pages.poll() is None:
        # memory not yet copied in is absent from /proc/PID/pagemap: a dump now would silently lose it
        progress("waiting for the lazy restore to bring in the rest of the job's memory")
        ctx.lazy_pages.wait()
    records = ctx.records
    info = ctx.criu.require()
    kind = CheckpointKind.HIBERNATE if hibernate else CheckpointKind.CHECKPOINT
    job = records.transition(
        name, {JobState.RUNNING}, JobState.HIBERNATING if hibernate else JobState.CHECKPOINTING
    )
    parent = records.latest_checkpoint(name)
    checkpoint_id = CheckpointId(uuid.uuid4().hex[:12])
    started = time.monotonic()
    pids = procfs.namespace_members(pid)
    staging: Path | None = None
    committed = False
    try:
        refuse_io_uring(pids)
        memory = procfs.memory_use(pids)
        rss = sum(use.proportional for use in memory)
        staging = ctx.store.staging_dir(checkpoint_id, size_hint=rss, pids=pids, kind=kind.value)
        on_gpu = procfs.uses_device(pids, gpu.NVIDIA_DEVICE_PREFIX)
        if on_gpu and ctx.settings.gpu == GPU_UNVERIFIED:
            progress("GPU stage: NVIDIA's checkpoint API, not verified on a GPU yet (TORPOR_GPU=unverified)")
        progress(f"dumping {len(pids)} process(es), {rss / 2**20:.0f} MiB resident")
        # memory set aside for the pages, so that the host's faults on fresh memory are not paid while
        # the job is frozen: the memory of the job's older copy in RAM, taken over, or else (for a job
        # that runs on) a file of zeros written now. Not on a disk (a write as large as the image); and a
        # hibernation writes no zeros: that job stops anyway, and what counts is how soon its memory is
        # free, which writing memory first would only delay
        in_ram = ctx.settings.stream_dump and ctx.store.in_memory(staging)
        images = staging
        pre = _precopy(ctx, pids, images, hibernate, on_gpu, progress)
        dump_started = time.monotonic()
        whole = reservations(memory) if in_ram and not hibernate else None

        def dump_once(pre: precopy.PreCopy | None) -> DumpStats:
            return dump(
                ctx.criu,
                pid,
                images,
                ctx.criu_log(name, "dump", checkpoint_id),
                leave_running=not hibernate,
                extra=ctx.settings.criu_extra
                + jobnetworks.dump_options(pid)
                + (("--skip-in-flight",) if for_copies else ()),
                external_unix=sockets.unix_socket_inodes(pids) if ext_unix_sk else (),
                # no TCP socket: no network lock to hold (~0.4 s less frozen); one that appears meanwhile
                # fails the dump, which is tried again with it (policy.retry)
                tcp=sockets.has_tcp_sockets(pids),
                hold_cpu_wakeups=ctx.settings.hold_cpu_wakeups,
                capture_script=ctx.capture_script() if ctx.settings.stream_dump else None,
                # a pre-copy's dump holds only what was written since its last round
                reserve=pre.reservations(whole) if pre is not None and whole is not None else whole,
                taken=ctx.store.take_over_memory(name, images) if in_ram and pre is None else None,
                env=pre.env() if pre is not None else None,
            )

        rounds: tuple[tuple[int, float], ...] = ()
        dumped = False
        try:
            done = ctx.gpu.before_dump(pids)  # a failure here has given the GPU back already
            if done is not None:
                progress(done)
            stats = dump_once(pre)
            if pre is not None:
                stats, summary = _complete(pre, images, stats, lambda: dump_once(None), progress)
                if summary is not None:
                    rounds = tuple((r.copied, r.seconds) for r in summary.rounds)
            dumped = True
        finally:
            if pre is not None:
                pre.close()
                precopy.remove(images)
            # the job runs on unless a hibernation's dump went through (a failed one leaves it running)
            ctx.gpu.after_dump(pids, not (hibernate and dumped), images if dumped else None)
        dump_s = time.monotonic() - dump_started
        if hibernate:  # the job is gone: what its files are now is what it left; anything later is not its
            rewind.record_stopped(ctx.settings.job_dir(name), checkpoint_id, staging)
        freeze_s = stats.frozen_s or dump_s
        progress(f"dumped in {dump_s:.2f} s (frozen {freeze_s:.2f} s); storing")
        try:
            stored = ctx.store.put(
                checkpoint_id,
                name,
                staging,
                {
                    "kind": kind.value,
                    "parent": parent.id if parent else job.restored_from,
                    "criu_version": info.version,
                    "command": job.command,
                    "cwd": job.cwd,
                    "freeze_s": freeze_s,
                    "dump_s": dump_s,
                },
            )
        except TorporError as exc:
            if hibernate:
                try:
                    _restore_after_failed_hibernation(ctx, name, checkpoint_id, staging, launcher, exc)
                except TorporError:
                    staging = None  # the only copy of the job now: keep it for the user
                    raise
            raise
        committed = True
        not_durable = stored.error
        total_s = time.monotonic() - started
        checkpoint = Checkpoint(
            id=checkpoint_id,
            job=name,
            kind=kind,
            created_at=time.time(),
            freeze_s=freeze_s,
            total_s=total_s,
            size_bytes=stored.size_bytes,
            criu_version=info.version,
            parent=parent.id if parent else job.restored_from,
            rounds=rounds,
        )
        records.add_checkpoint(checkpoint)
        if not for_copies:  # a template's leaves the job's list at once: it must not push one out
            apply_retention(ctx, name, progress)
    except TorporError as exc:
        if staging is not None and not committed:
            ctx.store.discard(staging)
        woken = procfs.resume_stopped(procfs.namespace_members(launcher.pid or pid))
        alive = launcher.pid is not None and procfs.is_alive(launcher.pid)
        if alive:
            records.transition(name, {JobState.CHECKPOINTING, JobState.HIBERNATING}, JobState.RUNNING)
            if woken:
                exc.details.append(f"torpor resumed {len(woken)} process(es) left stopped")
            exc.details.append("the job is still running")
        elif not isinstance(exc, JobExited):
            raise JobExited(
                f"the job ended during its checkpoint: {exc.message}", details=exc.details
            ) from exc
        raise
    if hibernate:
        records.set_fields(name, pid=None, ended_at=time.time(), message=f"hibernated as {checkpoint_id}")
        records.transition(name, {JobState.HIBERNATING}, JobState.HIBERNATED)
    else:
        records.transition(name, {JobState.CHECKPOINTING}, JobState.RUNNING)
    return CheckpointReply(checkpoint, not_durable)


def _precopy(
    ctx: Context, pids: list[int], staging: Path, hibernate: bool, on_gpu: bool, progress: Progress
) -> precopy.PreCopy | None:
    """Copy the job's memory while it runs (:mod:`torpor.core.precopy`), where it can be; else None,
    the progress saying why (the dump is then whole, as always)."""
    if not ctx.settings.precopy:
        return None
    why = None
    if hibernate:
        why = "a hibernation dumps the job whole"
    elif not ctx.store.in_memory(staging):
        why = "the image is not staged in RAM"
    elif on_gpu:
        why = "a GPU's writes into host memory cannot be tracked"
    if why is not None:
        if not hibernate:
            progress(f"not pre-copied ({why}): the whole memory is dumped while frozen")
        return None
    try:
        pre = precopy.start(staging, pids, progress)
    except NotTrackable as exc:
        progress(f"not pre-copied ({exc.message}): the whole memory is dumped while frozen")
        return None
    try:
        pre.copy_rounds(progress)
    except (NotTrackable, OSError) as exc:  # a scan refused, the RAM for the copy ran out: dump whole
        pre.close()
        precopy.remove(staging)
        progress(f"pre-copy stopped ({exc}): the whole memory is dumped while frozen")
        return None
    except BaseException:
        pre.close()
        precopy.remove(staging)
        raise
    return pre


def _complete(
    pre: precopy.PreCopy,
    staging: Path,
    stats: DumpStats,
    dump_whole: Callable[[], DumpStats],
    progress: Progress,
) -> tuple[DumpStats, precopy.Summary | None]:
    """Make a pre-copied dump's image whole, and say what the pre-copy did; where the image cannot be
    made whole, dump the job again, whole (no summary then: it was not pre-copied)."""
    try:
        summary = pre.complete(staging)
    except (PreCopyIncomplete, OSError) as exc:
        progress(f"the pre-copied image cannot be made whole ({exc}): dumping again, whole")
        _empty_folder(staging)
        return dump_whole(), None
    progress(
        f"{summary.line()}; the freeze dumped {format_size(summary.dumped_pages * PAGE_SIZE)}, "
        f"{format_size(summary.copied_pages * PAGE_SIZE)} came from the copy; made whole in "
        f"{summary.complete_s:.2f} s, moving {format_size(summary.moved)}"
    )
    return stats, summary


def reservations(memory: list[procfs.MemoryUse]) -> dict[int, int]:
    """The memory to set aside for each process's pages before a streamed dump: its anonymous memory,
    by its PID in the job's namespace (as CRIU names its images)."""
    found = {}
    for use in memory:
        inner = procfs.namespace_pid(use.pid)
        if inner is not None:
            found[inner] = use.anonymous
    return found


def refuse_io_uring(pids: list[int]) -> None:
    """Refuse a job that holds an io_uring instance: CRIU cannot dump one, and would fail mid-dump."""
    users = procfs.io_uring_users(pids)
    if not users:
        return
    others = f" and {len(users) - 1} other process(es)" if len(users) > 1 else ""
    raise CheckpointFailed(
        f"process {users[0]} ({procfs.command_line(users[0], 80)}){others} uses io_uring, which CRIU cannot "
        "checkpoint; PyTorch's TCPStore does through libuv: create it with use_libuv=False, or set "
        "USE_LIBUV=0 for init_process_group ('torpor run -- torchrun …' does both itself)",
        details=[f"io_uring in process {pid}: {procfs.command_line(pid)}" for pid in users],
    )


def dump(
    criu: Criu,
    pid: int,
    images_dir: Path,
    log_path: Path,
    *,
    tcp: bool = True,
    hold_cpu_wakeups: bool = False,
    capture_script: Path | None = None,
    reserve: Mapping[int, int] | None = None,
    taken: Mapping[int, Path] | None = None,
    **options: Any,
) -> DumpStats:
    """:meth:`Criu.dump` (same arguments), tried again as long as :mod:`torpor.policy.retry` says.

    A dump that met a process of the tree in the middle of exiting (e.g. a DataLoader worker at the end
    of an epoch), or another dump in the job's working directory, is tried again, a few times, from an
    empty folder. ``hold_cpu_wakeups``: keep the CPUs quick to wake while CRIU runs
    (:func:`torpor.adapters.system.ownprocess.cpu_wakeups_held`: a shorter freeze).

    ``capture_script`` (:data:`~torpor.adapters.imagestreamer.CAPTURE_SCRIPT`, installed): CRIU streams
    the image to torpor, which writes it into ``images_dir``
    (:class:`~torpor.adapters.imagestreamer.ImageCapture`), the pages of each process into the memory
    ``reserve`` says (bytes by PID in the job's namespace), allocated before the freeze, or over the
    file ``taken`` names for it in ``images_dir`` (memory an older copy of the job's image held).
    """
    attempt = 1
    while True:
        try:
            with ownprocess.cpu_wakeups_held(hold_cpu_wakeups):
                if capture_script is None:
                    return criu.dump(pid, images_dir, log_path, tcp=tcp, **options)
                return _dump_streamed(
                    criu, pid, images_dir, log_path, capture_script, reserve, taken, tcp, options
                )
        except (CheckpointFailed, StorageFull):
            errors = log_excerpt(log_path)
            decision = retry.after_failed_dump(attempt, errors, tcp, random.random())
            if not decision.again:
                raise
            if retry.met_busy_cwd(errors):
                _remove_stale_cwd_folder(pid)
        _empty_folder(images_dir)
        time.sleep(decision.delay_s)
        tcp = decision.tcp
        attempt += 1


def _dump_streamed(
    criu: Criu,
    pid: int,
    images_dir: Path,
    log_path: Path,
    script: Path,
    reserve: Mapping[int, int] | None,
    taken: Mapping[int, Path] | None,
    tcp: bool,
    options: dict[str, Any],
) -> DumpStats:
    """One streamed attempt of :func:`dump`: CRIU hands each image file to an image capture."""
    with ImageCapture(images_dir, reserve, taken) as capture:
        try:
            return criu.dump(
                pid, images_dir, log_path, tcp=tcp, stream=StreamedDump(script, capture.env()), **options
            )
        except (CheckpointFailed, StorageFull) as exc:
            problem = capture.problem
            if problem is not None:
                exc.details.append(f"torpor's capture of the image: {problem}")
            raise


def _remove_stale_cwd_folder(pid: int) -> None:
    """Remove the ``proc.crtools`` in the working directory of process ``pid`` if
    :func:`torpor.policy.retry.stale_cwd_folder` says it is a dead CRIU's (only if empty: ``rmdir``);
    for a young one, first wait as :func:`torpor.policy.retry.cwd_folder_wait` says."""
    try:
        cwd = os.open(f"/proc/{pid}/cwd", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for _ in range(2):
            found = os.stat(retry.CWD_FOLDER, dir_fd=cwd, follow_symlinks=False)
            if not stat.S_ISDIR(found.st_mode):
                return
            age = time.time() - found.st_mtime
            if retry.stale_cwd_folder(age, found.st_uid):
                os.rmdir(retry.CWD_FOLDER, dir_fd=cwd)
                return
            time.sleep(retry.cwd_folder_wait(age, found.st_uid))
    except OSError:
        pass  # gone already, not empty, or not ours to remove: the next attempt (or its error) says
    finally:
        os.close(cwd)


def _empty_folder(images_dir: Path) -> None:
    """Remove what a failed dump wrote into ``images_dir``; torpor's own dot files stay."""
    for entry in images_dir.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def apply_retention(ctx: Context, name: JobName, progress: Progress = quiet) -> list[CheckpointId]:
    """Delete the job's checkpoints beyond the newest ``keep_last`` (pinned ones stay); their ids.

    ``keep_last`` is the job's own (``--keep`` of its policy) when it has one, else the state directory's.
    """
    own = ctx.records.care(name).policy.keep
    keep = own if own is not None else ctx.store.config.keep_last  # the state directory's, as it is now
    if keep <= 0:
        return []
    checkpoints = ctx.records.checkpoints(name)
    if len(checkpoints) <= keep:
        return []
    kept = [retention.Kept(c.id, c.created_at) for c in checkpoints]
    removed = [CheckpointId(i) for i in retention.to_delete(kept, ctx.store.pinned(), keep)]
    for checkpoint_id in removed:
        ctx.store.delete(checkpoint_id)
        ctx.records.delete_checkpoint(checkpoint_id)
    if removed:
        progress(f"retention (keep the last {keep}): deleted {len(removed)} older checkpoint(s)")
    return removed


def _restore_after_failed_hibernation(
    ctx: Context,
    name: JobName,
    checkpoint_id: CheckpointId,
    staging: Path,
    launcher: Supervisor,
    cause: TorporError,
) -> None:
    """The dump killed the job but its image could not be stored: bring the job back from the image."""
    try:
        pid = ctx.criu.restore(
            staging,
            ctx.criu_log(name, "rollback", checkpoint_id),
            staging / "restored.pid",
            extra=ctx.settings.criu_extra,
        )
    except TorporError as exc:
        cause.details.append(f"restoring the job from its unsaved image failed too: {exc.message}")
        cause.details.extend(exc.details)
        cause.details.append(f"the unsaved image is kept in {staging}")
        raise cause from exc
    launcher.adopt(pid)
