"""The engine: the order of operations of run, checkpoint, hibernate, restore, stop and remove.

It owns the invariants of DESIGN.md. A checkpoint runs inside the job's launcher
(:func:`checkpoint_in_launcher`); everything else runs in the calling process (the CLI) and talks to the
launcher through :mod:`torpor.core.control`.

Order of a checkpoint::

    claim the job (running → checkpointing/hibernating)
    GPU stage: device state to host            ← adapters.gpu (no-op for CPU jobs)
    criu dump into the store's staging folder  (job frozen only here)
    GPU stage: give the device back (if the job keeps running)
    store.put (commit: the checkpoint becomes visible)
    record the checkpoint; job → running / hibernated

Any failure before the commit leaves the job running: CRIU resumes it, we SIGCONT anything left stopped,
and a hibernation whose image cannot be committed is restored from its staging folder at once.

Order of a restore: claim (hibernated/exited/failed → restoring), wait for the old processes to be gone,
store.get into a fresh folder (every byte verified), start a launcher that runs ``criu restore`` and
the GPU stage, job → running. On failure the job goes back to the state it had; the image stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torpor.adapters import gpu, system
from torpor.adapters.criu import Criu, OpenFile, RestoreGate, open_files, unix_socket_paths
from torpor.adapters.imagestreamer import ImageStreamer
from torpor.adapters.pageserver import PageServer
from torpor.core import control
from torpor.core.records import (
    LIVE_STATES,
    RESTORABLE_STATES,
    Checkpoint,
    CheckpointId,
    Job,
    JobName,
    JobState,
    Records,
)
from torpor.core.store import (
    DURABLE,
    Check,
    GcResult,
    ImageStore,
    PageSource,
    PageStream,
    StoreConfig,
    StoredImage,
    open_cold_tier,
    open_store,
)
from torpor.core.store import config as store_config
from torpor.errors import (
    CheckpointNotFound,
    EnvironmentProblem,
    JobExited,
    RestoreFailed,
    StoreError,
    TorporError,
    UnsafePath,
    UsageError,
    WrongState,
    from_dict,
)
from torpor.settings import Settings

if TYPE_CHECKING:
    from torpor.core.launcher import Launcher

Progress = Callable[[str], None]

#: launchers started as new interpreters (by a caller with threads), reaped as later ones start
_spawned: list[subprocess.Popen[bytes]] = []


def _quiet(_: str) -> None:
    return None


class Context:
    """What every operation needs, built from one :class:`Settings`.

    It writes the state directory's store configuration from ``settings.store_env`` if there is none
    yet, and refuses store variables that disagree with it unless ``check_store_env`` is off (for
    ``torpor store``, which shows and changes it).
    """

    def __init__(
        self, settings: Settings, gpu_stage: gpu.GpuStage | None = None, check_store_env: bool = True
    ) -> None:
        self.settings = settings
        self.gpu: gpu.GpuStage = gpu_stage or gpu.NoGpuStage()
        make_state_private(settings)
        if not os.access(settings.home, os.W_OK):
            raise EnvironmentProblem(
                f"{settings.home} is not writable; fix its permissions or set TORPOR_HOME"
            )
        store_config.establish(settings.home, settings.store_env, check=check_store_env)
        self.records = Records(settings.db_path)
        self.store: ImageStore = open_store(settings)
        #: in a launcher after a lazy restore: the ``criu lazy-pages`` still bringing memory in
        self.lazy_pages: subprocess.Popen[bytes] | None = None
        #: in a launcher: why torpor itself killed the job, for its record once it is gone
        self.killed_because: str | None = None

    @cached_property
    def criu(self) -> Criu:
        return Criu(self.settings.criu)

    def restore_gate(self, verdict: Path, writer_pid: int) -> RestoreGate:
        script = RestoreGate.install(self.settings.run_dir / "restore-gate.sh")
        return RestoreGate(script, verdict, writer_pid)

    def criu_log(self, job: str, action: str, checkpoint_id: str) -> Path:
        folder = self.settings.job_dir(job) / "criu"
        system.make_private_dirs(folder)
        return folder / f"{action}-{checkpoint_id}.log"


def make_state_private(settings: Settings) -> None:
    """Create the state directory's folders 0700, and tighten what an older torpor left open to all.

    Jobs' command lines, output and memory live here, so nobody but torpor's user may read any of it.
    A folder or file of torpor's (``jobs``, ``run``, ``tmp``, ``images``, ``staging``, the database) owned
    by this user loses its group and other bits; one owned by another user is refused: someone else made
    it, maybe to read what torpor puts there. What lies deeper keeps its mode, unreachable by others
    through these folders (opening every old image and log would cost each command a walk of the home).
    The home itself is tightened only when it holds torpor's database: a home the user made for more
    than torpor (or /tmp) is theirs to set.
    """
    problem = system.replaceable_by_others(settings.home)
    if problem is not None:
        raise UnsafePath(
            f"the state directory {settings.home} is not safe: {problem}; set TORPOR_HOME to a folder "
            "only torpor's user can change"
        )
    for folder in (settings.home, settings.jobs_dir, settings.run_dir, settings.tmp_dir):
        try:
            system.make_private_dirs(folder)
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot create {folder} ({exc.strerror}); make it writable or set TORPOR_HOME"
            ) from exc
    db = settings.db_path
    ours = [settings.jobs_dir, settings.run_dir, settings.tmp_dir, settings.images_dir, settings.staging_dir]
    ours += [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    if db.exists():
        ours.append(settings.home)
    uid = os.geteuid()
    for path in ours:
        try:
            found = path.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot look at {path} ({exc.strerror}); fix it or set TORPOR_HOME"
            ) from exc
        if found.st_uid != uid:
            raise UnsafePath(
                f"{path} is owned by uid {found.st_uid}, not by torpor's user (uid {uid}): another user may "
                "have made it to read torpor's state; remove it or set TORPOR_HOME"
            )
        if found.st_mode & 0o077:
            try:
                path.chmod(stat.S_IMODE(found.st_mode) & 0o700)
            except OSError as exc:
                raise EnvironmentProblem(f"cannot make {path} private ({exc.strerror})") from exc


# -- inside the launcher ---------------------------------------------------------------------------


def checkpoint_in_launcher(
    ctx: Context,
    name: str,
    pid: int,
    hibernate: bool,
    launcher: Launcher,
    send: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Dump job ``name`` (root ``pid``) into the store; the launcher holds its operation lock.

    Returns ``{"checkpoint": …, "not_durable": why or None}``: an image the cold tier cannot take now
    stays in RAM only, and the caller is told why.
    """

    def progress(text: str) -> None:
        send({"progress": text})

    if ctx.lazy_pages is not None and ctx.lazy_pages.poll() is None:
        # memory not yet copied in is absent from /proc/PID/pagemap: a dump now would silently lose it
        progress("waiting for the lazy restore to bring in the rest of the job's memory")
        ctx.lazy_pages.wait()
    records = ctx.records
    info = ctx.criu.require()
    job = records.transition(
        name, {JobState.RUNNING}, JobState.HIBERNATING if hibernate else JobState.CHECKPOINTING
    )
    parent = records.latest_checkpoint(name)
    checkpoint_id = CheckpointId(uuid.uuid4().hex[:12])
    started = time.monotonic()
    pids = system.namespace_members(pid)
    staging: Path | None = None
    committed = False
    try:
        rss = system.rss_bytes(pids)
        staging = ctx.store.staging_dir(checkpoint_id, size_hint=rss, pids=pids)
        ctx.gpu.before_dump(pids)
        progress(f"dumping {len(pids)} process(es), {rss / 2**20:.0f} MiB resident")
        dump_started = time.monotonic()
        try:
            stats = ctx.criu.dump(
                pid,
                staging,
                ctx.criu_log(name, "dump", checkpoint_id),
                leave_running=not hibernate,
                extra=ctx.settings.criu_extra,
            )
        finally:
            if not hibernate:
                ctx.gpu.after_dump(pids, leave_running=True)
        dump_s = time.monotonic() - dump_started
        freeze_s = stats.frozen_s or dump_s
        progress(f"dumped in {dump_s:.2f} s (frozen {freeze_s:.2f} s); storing")
        try:
            stored = ctx.store.put(
                checkpoint_id,
                name,
                staging,
                {
                    "kind": "hibernate" if hibernate else "checkpoint",
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
            job=JobName(name),
            kind="hibernate" if hibernate else "checkpoint",
            created_at=time.time(),
            freeze_s=freeze_s,
            total_s=total_s,
            size_bytes=stored.size_bytes,
            criu_version=info.version,
            parent=parent.id if parent else job.restored_from,
        )
        records.add_checkpoint(checkpoint)
        apply_retention(ctx, name, progress)
    except TorporError as exc:
        if staging is not None and not committed:
            ctx.store.discard(staging)
        woken = system.resume_stopped(system.namespace_members(launcher.pid or pid))
        alive = launcher.pid is not None and system.is_alive(launcher.pid)
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
    return {"checkpoint": asdict(checkpoint), "not_durable": not_durable}


def apply_retention(ctx: Context, name: str, progress: Progress = _quiet) -> list[str]:
    """Delete the job's checkpoints beyond the newest ``keep_last`` (pinned ones stay); their ids."""
    keep = ctx.store.config.keep_last  # the state directory's, as it is now
    if keep <= 0:
        return []
    checkpoints = sorted(ctx.records.checkpoints(name), key=lambda c: c.created_at, reverse=True)
    if len(checkpoints) <= keep:
        return []
    pinned = ctx.store.pinned()
    removed: list[str] = []
    for checkpoint in checkpoints[keep:]:
        if checkpoint.id in pinned:
            continue
        ctx.store.delete(checkpoint.id)
        ctx.records.delete_checkpoint(checkpoint.id)
        removed.append(checkpoint.id)
    if removed:
        progress(f"retention (keep the last {keep}): deleted {len(removed)} older checkpoint(s)")
    return removed


def _restore_after_failed_hibernation(
    ctx: Context, name: str, checkpoint_id: str, staging: Path, launcher: Launcher, cause: TorporError
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


def restore_into_launcher(
    ctx: Context,
    job: Job,
    image_dir: Path,
    checkpoint_id: str,
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
        ctx.killed_because = f"lazy restore failed, the job was killed: {message}"
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


# -- from the CLI ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobStatus:
    """A job as ``torpor ps`` shows it: the record plus what /proc says now."""

    job: Job
    rss_bytes: int | None
    last_checkpoint: Checkpoint | None


class Engine:
    def __init__(
        self, settings: Settings, gpu_stage: gpu.GpuStage | None = None, check_store_env: bool = True
    ) -> None:
        self.ctx = Context(settings, gpu_stage, check_store_env)
        self.settings = settings
        self.records = self.ctx.records

    # -- run ------------------------------------------------------------------------------------------

    def run(self, name: str | None, command: list[str], cwd: str) -> Job:
        if not command:
            raise UsageError("no command given: torpor run [--name NAME] -- COMMAND [ARGS...]")
        if shutil.which(command[0], path=os.environ.get("PATH") if "/" not in command[0] else None) is None:
            raise UsageError(f"command not found: {command[0]}")
        if name is None:
            name = self._free_name(_name_from_command(command))
        _check_name(name)
        job_dir = self.settings.job_dir(name)
        system.make_private_dirs(job_dir)
        job = self.records.create_job(JobName(name), command, cwd, str(job_dir / "output.log"))
        try:
            self._spawn_launcher({"mode": "start", "job": name})
        except TorporError:
            if self.records.job(name).state == JobState.STARTING:
                self.records.transition(name, {JobState.STARTING}, JobState.FAILED, ended_at=time.time())
            raise
        return self.records.job(job.name)

    def _free_name(self, base: str) -> str:
        taken = {job.name for job in self.records.jobs()}
        base = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in base).strip(".-") or "job"
        if base not in taken:
            return base
        n = 2
        while f"{base}-{n}" in taken:
            n += 1
        return f"{base}-{n}"

    def _spawn_launcher(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Start a detached launcher and wait for its one-line report (started / restored / failed)."""
        return self._start_launcher(spec).release({})

    def _start_launcher(self, spec: dict[str, Any]) -> PendingLauncher:
        """Start a detached launcher that opens its state, then waits for :meth:`release`.

        A restore starts it before fetching the image, so the launcher's start-up overlaps the fetch.
        It is forked from this process, which has imported all it needs already; a caller with other
        threads running gets a new interpreter instead (forking a threaded process can deadlock).
        """
        spec = {"settings_dict": self.settings.to_dict(), **spec}
        log = self.settings.job_dir(spec["job"]) / "launcher.log"
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        life_r, life_w = os.pipe()  # the launcher holds life_w until it exits: EOF here says it did
        try:
            if threading.active_count() == 1:
                self._fork_launcher(spec, log, ready_w, go_r, life_w)
            else:
                global _spawned
                _spawned = [child for child in _spawned if child.poll() is None]  # reaps exited ones
                with os.fdopen(
                    system.open_private(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab"
                ) as log_file:
                    child = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "torpor.core.launcher",
                            json.dumps(spec),
                            str(ready_w),
                            str(go_r),
                            str(life_w),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        pass_fds=(ready_w, go_r, life_w),
                        close_fds=True,
                    )
                _spawned.append(child)
        except BaseException:
            for fd in (ready_r, go_w, life_r):
                os.close(fd)
            raise
        finally:
            for fd in (ready_w, go_r, life_w):
                os.close(fd)
        return PendingLauncher(str(spec["job"]), log, ready_r, go_w, life_r)

    @staticmethod
    def _fork_launcher(spec: dict[str, Any], log: Path, ready_w: int, go_r: int, life_w: int) -> None:
        """Fork twice (the launcher is nobody's child here, so it never lingers as a zombie of ours)."""
        from torpor.core import launcher as launcher_module

        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        middle = os.fork()
        if middle == 0:  # pragma: no cover - child side
            code = 1
            try:
                os.setsid()
                code = launcher_module.forked(spec, log, ready_w, go_r, life_w) if os.fork() == 0 else 0
            except BaseException:
                traceback.print_exc()  # into the launcher's log, once forked() redirected stderr
            finally:
                os._exit(code)
        os.waitpid(middle, 0)

    # -- inspect ---------------------------------------------------------------------------------------

    def reconcile(self, job: Job) -> Job:
        """Mark a job whose launcher vanished (killed, machine rebooted) as failed, and say why.

        Its processes may still run, unsupervised (the launcher was killed, not the job): the record
        keeps their pid, so that ``stop``, ``resume --force`` and ``rm --force`` can end them.
        """
        if (
            job.state in LIVE_STATES | {JobState.RESTORING}
            and job.launcher_pid
            and not system.is_alive(job.launcher_pid)
        ):
            if _tree_alive(job):
                message = (
                    f"its launcher died; its processes still run unsupervised (pid {job.pid}): "
                    f"'torpor stop {job.name}' ends them, 'torpor resume --force {job.name}' restores "
                    "its latest checkpoint"
                )
            else:
                message = "its launcher died"
            self.records.set_fields(job.name, message=message, ended_at=time.time())
            self.records.transition(job.name, {job.state}, JobState.FAILED)
            return self.records.job(job.name)
        return job

    def status(self, name: str) -> JobStatus:
        job = self.reconcile(self.records.job(name))
        rss = None
        if job.pid and (job.state in LIVE_STATES or unsupervised(job)):
            rss = system.rss_bytes(system.namespace_members(job.pid))
        return JobStatus(job, rss, self.records.latest_checkpoint(name))

    def statuses(self) -> list[JobStatus]:
        return [self.status(job.name) for job in self.records.jobs()]

    def checkpoints(self, name: str | None = None) -> list[Checkpoint]:
        if name is not None:
            self.records.job(name)
        return self.records.checkpoints(name)

    # -- the image store -------------------------------------------------------------------------------

    def image_states(self, checkpoints: list[Checkpoint]) -> dict[str, StoredImage | None]:
        """Where each checkpoint's image is (staged, destaging, durable); ``None``: its image is gone.

        A store that cannot be read (e.g. S3 unreachable) gives state ``unknown`` with the error.
        """
        try:
            pinned = self.ctx.store.pinned()
        except TorporError:
            pinned = set()
        states: dict[str, StoredImage | None] = {}
        for checkpoint in checkpoints:
            try:
                image = self.ctx.store.state(checkpoint.id)
            except CheckpointNotFound:
                states[checkpoint.id] = None
                continue
            except TorporError as exc:
                image = StoredImage(
                    checkpoint.id, checkpoint.job, checkpoint.size_bytes, 0, "unknown", error=exc.message
                )
            states[checkpoint.id] = replace(image, pinned=checkpoint.id in pinned)
        return states

    def wait_durable(self, checkpoint_id: str, progress: Progress = _quiet) -> StoredImage:
        """Return once the checkpoint's image is in the cold tier; raises the destager's error."""
        shown = [""]

        def show(image: StoredImage) -> None:
            if image.state_text != shown[0]:
                shown[0] = image.state_text
                progress(image.state_text)

        return self.ctx.store.wait_durable(checkpoint_id, show)

    # -- the store configuration ------------------------------------------------------------------------

    @property
    def store_config(self) -> StoreConfig:
        return self.ctx.store.config

    def set_store(self, changes: dict[str, Any], force: bool = False) -> StoreConfig:
        """Change the state directory's store configuration; the new one is checked before it is written.

        A new cold tier (or key) is opened for real first (created if new; the key checked against the
        store). Moving to another cold tier leaves the checkpoints stored in the old one there: refused
        while the records hold some the new one lacks, unless ``force``. Images still waiting in RAM
        are stored into the new one.
        """
        home = self.settings.home
        old = self.store_config
        new = old.replace(**changes)
        if new == old:
            return old
        if new.replace(keep_last=0) != old.replace(keep_last=0):
            try:
                repo = open_cold_tier(new, home, self.settings.store_workers)
            except TorporError as exc:
                raise type(exc)(
                    f"cannot use the new store: {exc.message}; the store configuration is unchanged",
                    details=exc.details,
                ) from exc
            if new.place(home) != old.place(home) and not force:
                checkpoints = self.records.checkpoints()
                images = self.image_states(checkpoints)
                left = [
                    c.id
                    for c in checkpoints
                    if (image := images.get(c.id)) is not None
                    and image.state in (DURABLE, "unknown")
                    and not repo.has(c.id)
                ]
                if left:
                    raise UsageError(
                        f"{len(left)} checkpoint(s) are stored in {old.cold_url(home)} and not in "
                        f"{new.cold_url(home)}: they would stay behind, out of reach until the store is set "
                        "back; pass --force to change it anyway, or 'torpor rm' their jobs first"
                    )
        store_config.save(home, new)
        self.ctx.store.retry()
        return new

    def pin(self, name: str, ref: str, pinned: bool = True) -> Checkpoint:
        checkpoint = self.records.find_checkpoint(name, ref)
        self.ctx.store.set_pinned(checkpoint.id, pinned)
        return checkpoint

    def gc(self, progress: Progress = _quiet) -> tuple[list[str], GcResult]:
        """Apply retention to every job, then delete the chunks no checkpoint needs any more."""
        removed: list[str] = []
        for job in self.records.jobs():
            removed.extend(apply_retention(self.ctx, job.name, progress))
        progress("collecting unreferenced chunks")
        return removed, self.ctx.store.gc()

    # -- checkpoint and hibernate ---------------------------------------------------------------------

    def checkpoint(
        self, name: str, hibernate: bool = False, progress: Progress = _quiet, warn: Progress = _quiet
    ) -> Checkpoint:
        """Checkpoint (or hibernate) a running job; ``warn`` is told if its image is only in RAM, and why."""
        job = self.reconcile(self.records.job(name))
        if job.state != JobState.RUNNING:
            verb = "hibernate" if hibernate else "checkpoint"
            hint = ""
            if job.state == JobState.HIBERNATED:
                hint = f"; resume it first with 'torpor resume {name}'"
            elif unsupervised(job):
                hint = " and runs unsupervised (its launcher died): see 'torpor ps'"
            raise WrongState(f"cannot {verb} job '{name}': it is {job.state}{hint}")
        self.ctx.criu.require()
        reply = control.call(
            self.settings.socket_path(name),
            {"op": "checkpoint", "hibernate": hibernate},
            on_progress=progress,
        )
        checkpoint = Checkpoint(**reply["checkpoint"])
        if reply.get("not_durable"):
            warn(f"checkpoint {checkpoint.id} is only in RAM: {reply['not_durable']}")
        return checkpoint

    # -- restore ---------------------------------------------------------------------------------------

    def restore(
        self,
        name: str,
        ref: str | None = None,
        force: bool = False,
        progress: Progress = _quiet,
        lazy: bool = False,
    ) -> tuple[Job, Checkpoint, float]:
        """Restore ``name`` from checkpoint ``ref`` (default: its latest); returns (job, checkpoint, seconds)."""
        job = self.reconcile(self.records.job(name))
        checkpoint = (
            self.records.find_checkpoint(name, ref)
            if ref is not None
            else self.records.latest_checkpoint(name)
        )
        if checkpoint is None:
            raise CheckpointNotFound(
                f"job '{name}' has no checkpoint to restore (make one with 'torpor checkpoint')"
            )
        if job.state in LIVE_STATES or job.state == JobState.RESTORING or unsupervised(job):
            if not force or job.state == JobState.RESTORING:
                raise WrongState(
                    f"job '{name}' is {_describe(job)}; stop it first or pass --force to stop it and restore"
                )
            # stopping is what cannot be undone: first make sure there is something to restore
            progress(f"checking checkpoint {checkpoint.id} before stopping the running job")
            try:
                self.ctx.store.precheck(checkpoint.id)
            except TorporError as exc:
                exc.details.append(f"job '{name}' was not stopped; it is still {job.state}")
                raise
            progress(f"stopping the running job '{name}'")
            self.stop(name)
            job = self.records.job(name)
        self.ctx.criu.require()
        started = time.monotonic()
        # while restoring, the launcher pid on record is this process: if it dies, `ps` marks the job failed
        previous = self.records.transition(
            name, RESTORABLE_STATES, JobState.RESTORING, launcher_pid=os.getpid()
        )
        image_dir = self.ctx.store.restore_dir(checkpoint.id)
        launcher: PendingLauncher | None = None
        pages: PageStream | None = None
        try:
            launcher = self._start_launcher({"mode": "restore", "job": name})
            if previous.pid and not system.wait_gone(
                previous.pid, previous.pid_ticks, self.settings.pid_wait_s
            ):
                raise RestoreFailed(
                    f"the previous processes of '{name}' (pid {previous.pid}) are still running"
                )
            progress(
                f"fetching checkpoint {checkpoint.id} ({checkpoint.size_bytes / 2**20:.0f} MiB), verifying"
            )
            served = False
            check: Check | None = None
            if lazy:
                # from the cold tier, memory comes in page by page (each chunk verified as it is
                # fetched); an image in RAM is verified whole first, then CRIU's own daemon serves it
                served = self.ctx.store.prepare_lazy(checkpoint.id, image_dir)
                if not served:
                    self.ctx.store.get(checkpoint.id, image_dir)
            else:
                if self.settings.stream_restore:
                    pages = self.ctx.store.stream_pages(checkpoint.id, image_dir)
                if pages is None:
                    check = self.ctx.store.fetch(checkpoint.id, image_dir)
            rewound = rewind_written_files(
                image_dir, self.settings.job_dir(name) / "rewound" / checkpoint.id, keep={Path(job.log_path)}
            )
            if rewound:
                progress(
                    f"rewound {len(rewound)} file(s) the job writes to their size at the checkpoint "
                    f"(later bytes saved under {self.settings.job_dir(name) / 'rewound'})"
                )
            recreated = recreate_socket_folders(image_dir)
            if recreated:
                progress(f"recreated {len(recreated)} missing folder(s) of the job's unix sockets")
            spec = {
                "image_dir": str(image_dir),
                "checkpoint_id": checkpoint.id,
                "lazy": lazy,
                "served": served,
                "stream": pages is not None,
            }
            if pages is not None:
                progress("restoring with criu; memory streams in from the store, each chunk verified first")
                self._release_streamed(launcher, spec, image_dir, pages)
            elif check is None:
                progress("restoring with criu")
                launcher.release(spec)
            else:
                progress("restoring with criu; the job runs once its memory pages are verified")
                self._release_gated(launcher, spec, image_dir, check)
        except TorporError as exc:
            if launcher is not None:
                launcher.abort()
            shutil.rmtree(image_dir, ignore_errors=True)
            self.records.transition(name, {JobState.RESTORING}, previous.state)
            if not isinstance(exc, RestoreFailed):
                exc.details.append(f"job '{name}' stays {previous.state}; its checkpoints are untouched")
                raise
            raise RestoreFailed(
                f"{exc.message}; job '{name}' stays {previous.state} and checkpoint {checkpoint.id} is kept",
                details=exc.details,
            ) from exc
        finally:
            if pages is not None:
                pages.close()
        return self.records.job(name), checkpoint, time.monotonic() - started

    def wait_lazy(self, name: str, progress: Progress = _quiet) -> None:
        """After a lazy restore, return once all of the job's memory is in; raise if that killed it.

        A damaged chunk is met only when the job touches its pages, after ``restore`` returned: torpor
        kills the job then (it must not run on memory it cannot get) and this says why.
        """
        reply = control.call(self.settings.socket_path(name), {"op": "wait_lazy"}, on_progress=progress)
        if reply.get("killed"):
            raise RestoreFailed(
                f"the lazily restored job '{name}' was killed: {reply['killed']}",
                details=["its checkpoints are kept; 'torpor ps' shows it failed"],
            )

    def _release_streamed(
        self, launcher: PendingLauncher, spec: dict[str, Any], image_dir: Path, pages: PageStream
    ) -> None:
        """Let the launcher run ``criu restore --stream`` while this process hands CRIU the image.

        The files in ``image_dir`` (verified already) go to CRIU as they are; the memory pages come from
        the store straight into CRIU's pipe, with no copy in RAM first, each chunk verified before it is
        written. A damaged chunk cuts its file short, so CRIU fails before the job runs.
        """
        streamer = ImageStreamer(image_dir, {name: partial(pages.write, name) for name in pages.names})
        streamer.start()
        try:
            launcher.release(spec)
        except TorporError as exc:
            streamer.stop()
            if isinstance(streamer.error, TorporError):  # says more than "criu restore failed"
                raise streamer.error from exc
            raise
        finally:
            streamer.stop()

    def _release_gated(
        self, launcher: PendingLauncher, spec: dict[str, Any], image_dir: Path, check: Check
    ) -> None:
        """Let the launcher restore while this process runs ``check``; the job runs only if it passes.

        CRIU reads the pages while they are verified (two cores at work instead of one after the
        other) and holds the restored tree at its post-restore step until the verdict (RestoreGate).
        """
        gate = self.ctx.restore_gate(image_dir / ".torpor-verdict", os.getpid())
        failed: list[TorporError] = []

        def verify() -> None:
            try:
                check()
            except TorporError as exc:
                failed.append(exc)
                gate.shut(exc.message)
            except BaseException as exc:  # whatever went wrong, unverified memory must not run
                failed.append(StoreError(f"verifying the image failed: {exc}"))
                gate.shut(str(exc))
                raise
            else:
                gate.open()

        verifier = threading.Thread(target=verify, name="verify", daemon=True)
        verifier.start()
        try:
            launcher.release({**spec, "gate": str(gate.verdict), "gate_pid": os.getpid()})
        finally:
            verifier.join()
            if failed:  # the image's own error says more than "criu restore failed"
                raise failed[0]

    # -- stop and remove --------------------------------------------------------------------------------

    def stop(self, name: str, grace_s: float | None = None) -> Job:
        """SIGTERM the job (PID 1 of its namespace ignores it unless it handles it), then SIGKILL.

        A job whose launcher died is stopped the same way: killing PID 1 of its namespace ends all of it.
        """
        job = self.reconcile(self.records.job(name))
        orphaned = unsupervised(job)
        if not job.pid or (job.state not in LIVE_STATES and not orphaned):
            raise WrongState(f"job '{name}' is {job.state}, not running")
        grace = self.settings.stop_grace_s if grace_s is None else grace_s
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if wait <= 0 and sig == signal.SIGTERM:
                continue
            try:
                os.kill(job.pid, sig)
            except ProcessLookupError:
                break
            if system.wait_gone(job.pid, job.pid_ticks, wait):
                break
        if orphaned:  # no launcher to record it
            self.records.set_fields(
                name,
                pid=None,
                ended_at=time.time(),
                message="its launcher had died; torpor stopped its unsupervised processes",
            )
            return self.records.job(name)
        # the launcher records the exit; wait for it so the next command sees a settled state
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            job = self.reconcile(self.records.job(name))
            if job.state not in LIVE_STATES:
                break
            time.sleep(0.05)
        return job

    def remove(self, name: str, force: bool = False) -> list[str]:
        job = self.reconcile(self.records.job(name))
        if job.state in LIVE_STATES or job.state == JobState.RESTORING or unsupervised(job):
            if not force or job.state == JobState.RESTORING:
                raise WrongState(f"job '{name}' is {_describe(job)}; stop it first or pass --force")
            launcher = job.launcher_pid
            self.stop(name, grace_s=0)
            if launcher and launcher != os.getpid():  # let it finish with the record before it goes
                system.wait_gone(launcher, None, 10)
        removed: list[str] = []
        for checkpoint in self.records.checkpoints(name):
            self.ctx.store.delete(checkpoint.id)
            removed.append(checkpoint.id)
        self.records.delete_job(name)
        self.settings.socket_path(name).unlink(missing_ok=True)
        shutil.rmtree(self.settings.job_dir(name), ignore_errors=True)
        return removed

    def log_path(self, name: str) -> Path:
        return Path(self.records.job(name).log_path)


def _tree_alive(job: Job) -> bool:
    """Whether the process on record as the job's root is still that process, and alive."""
    return (
        job.pid is not None
        and job.pid_ticks is not None
        and system.is_alive(job.pid)
        and system.start_ticks(job.pid) == job.pid_ticks
    )


def unsupervised(job: Job) -> bool:
    """Whether the job's processes still run though its launcher died (the record keeps their pid)."""
    return job.state not in LIVE_STATES and _tree_alive(job)


def _describe(job: Job) -> str:
    return "running unsupervised (its launcher died)" if unsupervised(job) else str(job.state)


_INTERPRETERS = (
    "python",
    "python3",
    "bash",
    "sh",
    "node",
    "ruby",
    "perl",
    "Rscript",
    "julia",
    "uv",
    "torchrun",
)


def _name_from_command(command: list[str]) -> str:
    """``python -u train.py`` → ``train``; ``./serve`` → ``serve``."""
    program = Path(command[0]).name
    if program.rstrip("0123456789.") in _INTERPRETERS:
        for arg in command[1:]:
            if not arg.startswith("-"):
                return Path(arg).stem or program
    return program


class PendingLauncher:
    """A launcher that has started and waits for the rest of its spec on a pipe (or for EOF: abort)."""

    def __init__(self, job: str, log: Path, ready_fd: int, go_fd: int, life_fd: int) -> None:
        self.job = job
        self.log = log
        self.ready_fd = ready_fd
        self.go_fd: int | None = go_fd
        self.life_fd = life_fd

    def release(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Send the rest of the spec and wait for the launcher's report; raise its error if it failed."""
        assert self.go_fd is not None
        try:
            os.write(self.go_fd, json.dumps(extra).encode() + b"\n")
        except BrokenPipeError:
            pass  # it died already: its report (or its silence) says why
        finally:
            os.close(self.go_fd)
            self.go_fd = None
        with os.fdopen(self.ready_fd) as pipe:
            line = pipe.readline()
        if not line:
            self._wait_gone()
            tail = self.log.read_text(errors="replace").splitlines()[-8:]
            raise TorporError(f"the launcher for '{self.job}' died before reporting", details=tail)
        report: dict[str, Any] = json.loads(line)
        if not report.get("ok"):
            self._wait_gone()
            raise from_dict(report)
        os.close(self.life_fd)
        return report

    def abort(self) -> None:
        """Tell a launcher still waiting for :meth:`release` to exit without doing anything."""
        if self.go_fd is not None:
            os.close(self.go_fd)
            self.go_fd = None
            os.close(self.ready_fd)
            self._wait_gone()

    def _wait_gone(self, timeout: float = 60) -> None:
        """Wait for the launcher to exit (so the next command sees what it left), at most ``timeout``."""
        try:
            ready, _, _ = select.select([self.life_fd], [], [], timeout)
            if ready:
                os.read(self.life_fd, 1)  # EOF: its end closed as it exited
        finally:
            os.close(self.life_fd)


def _check_name(name: str) -> None:
    if not name or len(name) > 64 or not all(ch.isalnum() or ch in "-_." for ch in name) or name[0] in ".-":
        raise UsageError(
            f"bad job name {name!r}: use up to 64 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )
