"""The engine: the operations the CLI drives — run, checkpoint, hibernate, restore, stop, remove, inspect.

It owns the order of operations and the invariants of DESIGN.md from the caller's side: it claims the
job's record, starts launchers (:mod:`torpor.core.launcher`) and asks them over the control socket
(:mod:`torpor.core.control`). What runs inside a launcher is elsewhere: the checkpoint in
:mod:`torpor.core.checkpoint`, ``criu restore`` in :mod:`torpor.core.restore`; the decisions (retention,
the stop escalation, dump retries) are :mod:`torpor.policy`'s; where an image is read from is the
store's (:meth:`~torpor.core.store.ImageStore.restore_source`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torpor.adapters import gpu, netlock
from torpor.adapters.system import private, procfs
from torpor.core import control
from torpor.core.checkpoint import apply_retention
from torpor.core.context import Context, Progress, quiet
from torpor.core.jobnetworks import Networks
from torpor.core.launcher.protocol import LaunchMode, LaunchSpec, PendingLauncher
from torpor.core.launcher.release import fetch_and_release
from torpor.core.launcher.spawn import start_launcher
from torpor.core.moves import Moves
from torpor.core.naming import check_name, free_name, name_from_command
from torpor.core.recordtypes import (
    LIVE_STATES,
    RESTORABLE_STATES,
    SUPERVISED_STATES,
    Checkpoint,
    CheckpointId,
    Job,
    JobName,
    JobState,
    Origin,
)
from torpor.core.restore import LAZY_KILL, prepare_world, recreate_socket_folders
from torpor.core.rewind import Rewound
from torpor.core.starting import PreparedRun
from torpor.core.store import (
    DURABLE,
    GcResult,
    StoreConfig,
    StoredImage,
    open_cold_tier,
)
from torpor.core.store import config as store_config
from torpor.core.templates import Templates, refuse_taken_ports, restart_template
from torpor.errors import (
    CheckpointNotFound,
    JobNotFound,
    LauncherUnreachable,
    RestoreFailed,
    TorporError,
    UsageError,
    WrongState,
)
from torpor.policy import stop as stop_policy
from torpor.policy import torchrun
from torpor.settings import Settings


@dataclass(frozen=True)
class JobStatus:
    """A job as ``torpor ps`` shows it: the record plus what /proc says now."""

    job: Job
    #: memory the whole tree has resident, pages its processes share counted once (the sum of their PSS)
    rss_bytes: int | None
    last_checkpoint: Checkpoint | None


class Engine:
    """The operations a user asks for, on one state directory; the CLI, Slurm and the demo drive it.

    Names come as the user typed them (``str``) and are looked up in the records first; from there on
    they are the record's :data:`~torpor.core.recordtypes.JobName`.
    """

    def __init__(
        self, settings: Settings, gpu_stage: gpu.GpuStage | None = None, check_store_env: bool = True
    ) -> None:
        self.ctx = Context(settings, gpu_stage, check_store_env)
        self.settings = settings
        self.records = self.ctx.records

    # -- run ------------------------------------------------------------------------------------------

    def run(
        self,
        name: str | None,
        command: list[str],
        cwd: str,
        *,
        env: dict[str, str] | None = None,
        umask: int | None = None,
        cgroup: Path | None = None,
        warm: str | None = None,
        ready_when: str | None = None,
    ) -> Job:
        """Start ``command`` as a new job; with ``env``/``umask``, in those instead of the caller's (the
        agent starting a submitted job), with ``cgroup``, in that cgroup folder. ``warm``: its launcher
        saves it as that template once it is ready by ``ready_when`` (``--warm-start``)."""
        return self.prepare_run(
            name, command, cwd, env=env, umask=umask, cgroup=cgroup, warm=warm, ready_when=ready_when
        ).go()

    def prepare_run(
        self,
        name: str | None,
        command: list[str],
        cwd: str,
        *,
        env: dict[str, str] | None = None,
        umask: int | None = None,
        cgroup: Path | None = None,
        warm: str | None = None,
        ready_when: str | None = None,
    ) -> PreparedRun:
        """Check a start and have its launcher start up (a new interpreter, ~0.3 s), waiting for
        :meth:`~torpor.core.starting.PreparedRun.go`: the scheduler prepares the job a victim makes room
        for while the victim is being hibernated. The job's record is made only at ``go``."""
        if not command:
            raise UsageError("no command given: torpor run [--name NAME] -- COMMAND [ARGS...]")
        self.refuse_if_draining("start a job")
        search = (env if env is not None else os.environ).get("PATH")
        program = shutil.which(command[0], path=search if "/" not in command[0] else None)
        if program is None:
            raise UsageError(f"command not found: {command[0]}")
        if name is None:
            name = free_name(name_from_command(command), {job.name for job in self.records.jobs()})
        job_name = check_name(name)
        job_dir = self.settings.job_dir(job_name)
        private.make_private_dirs(job_dir)
        # torchrun's store would hold an io_uring, which CRIU cannot dump: start it without (policy.torchrun)
        interpreter = procfs.script_interpreter(program) if torchrun.is_torchrun_script(command) else None
        command = torchrun.without_libuv(command, interpreter) or command
        spec = LaunchSpec(
            self.settings.to_dict(),
            job_name,
            LaunchMode.START,
            env,
            umask,
            None if cgroup is None else str(cgroup),
            warm,
            ready_when,
        )
        return PreparedRun(
            self.records,
            self.settings,
            job_name,
            command,
            cwd,
            start_launcher(spec, job_dir / "launcher.log"),
            None if warm is None else Origin(job_name, warm=warm, ready_when=ready_when),
        )

    def refuse_if_draining(self, what: str) -> None:
        """A draining node (``torpor drain``, a notice, the agent's shutdown) takes no new work."""
        draining = self.records.node_flag("draining")
        if draining is not None:
            why = json.loads(draining).get("why", "")
            raise WrongState(
                f"cannot {what}: this node is being evacuated ({why}); 'torpor drain --cancel' ends that"
            )

    def _start_launcher(self, name: JobName, mode: LaunchMode) -> PendingLauncher:
        """A detached launcher for job ``name``, waiting for :meth:`PendingLauncher.release`."""
        spec = LaunchSpec(self.settings.to_dict(), name, mode)
        return start_launcher(spec, self.settings.job_dir(name) / "launcher.log")

    # -- inspect ---------------------------------------------------------------------------------------

    def reconcile(self, job: Job) -> Job:
        """Mark a job whose launcher vanished (killed, machine rebooted) as failed, and say why.

        Its processes may still run, unsupervised (the launcher was killed, not the job): the record
        keeps their pid, so that ``stop``, ``resume --force`` and ``rm --force`` can end them.
        """
        if job.state in SUPERVISED_STATES and job.launcher_pid and not procfs.is_alive(job.launcher_pid):
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
            rss = procfs.resident_bytes(procfs.namespace_members(job.pid))
        return JobStatus(job, rss, self.records.latest_checkpoint(job.name))

    def statuses(self) -> list[JobStatus]:
        return [self.status(job.name) for job in self.records.jobs()]

    def checkpoints(self, name: str | None = None) -> list[Checkpoint]:
        if name is not None:
            self.records.job(name)
        return self.records.checkpoints(name)

    # -- the image store -------------------------------------------------------------------------------

    def image_states(self, checkpoints: list[Checkpoint]) -> dict[CheckpointId, StoredImage | None]:
        """Where each checkpoint's image is (staged, destaging, durable); ``None``: its image is gone.

        A store that cannot be read (e.g. S3 unreachable) gives state ``unknown`` with the error.
        """
        try:
            pinned = self.ctx.store.pinned()
        except TorporError:
            pinned = set()
        states: dict[CheckpointId, StoredImage | None] = {}
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

    def wait_durable(self, checkpoint_id: CheckpointId, progress: Progress = quiet) -> StoredImage:
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

    def gc(self, progress: Progress = quiet) -> tuple[list[CheckpointId], GcResult]:
        """Apply retention to every job, then delete the chunks no checkpoint needs any more."""
        removed: list[CheckpointId] = []
        for job in self.records.jobs():
            removed.extend(apply_retention(self.ctx, job.name, progress))
        progress("collecting unreferenced chunks")
        return removed, self.ctx.store.gc()

    # -- checkpoint and hibernate ---------------------------------------------------------------------

    def checkpoint(
        self,
        name: str,
        hibernate: bool = False,
        progress: Progress = quiet,
        warn: Progress = quiet,
        ext_unix_sk: bool = False,
        for_copies: bool = False,
    ) -> Checkpoint:
        """Checkpoint (or hibernate) a running job; ``warn`` is told if its image is only in RAM, and why.

        ``ext_unix_sk``: unix connections to processes outside the job do not fail the dump (see
        docs/architecture.md, "Outside clients on a job's unix sockets"). ``for_copies``: a template's
        (connections not yet accepted are left out of the image)."""
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
        reply = control.checkpoint(
            self.settings.socket_path(job.name),
            hibernate,
            on_progress=progress,
            ext_unix_sk=ext_unix_sk,
            for_copies=for_copies,
        )
        if reply.not_durable:
            warn(f"checkpoint {reply.checkpoint.id} is only in RAM: {reply.not_durable}")
        return reply.checkpoint

    # -- restore ---------------------------------------------------------------------------------------

    def restore(
        self,
        name: str,
        ref: str | None = None,
        force: bool = False,
        progress: Progress = quiet,
        lazy: bool = False,
        rewind: bool = False,
        warn: Progress = quiet,
    ) -> tuple[Job, Checkpoint, float]:
        """Restore ``name`` from checkpoint ``ref`` (default: its latest); returns (job, checkpoint, seconds).

        ``rewind``: cut back the files the job writes even where someone else changed them since the job
        stopped (:mod:`torpor.policy.rewind`); without it such a restore is refused, nothing changed.
        ``warn`` is told what a rollback cannot bring back (files the job maps shared).
        """
        job = self.reconcile(self.records.job(name))
        Moves(self.records).refuse_if_held(job.name)  # handed to a peer, or not handed here yet
        self.refuse_if_draining(f"restore '{name}'")
        checkpoint = (
            self.records.find_checkpoint(job.name, ref)
            if ref is not None
            else self.records.latest_checkpoint(job.name)
        )
        # a job started from a template (or --warm-start) that has none of its own starts from that again
        template = restart_template(self.records, job) if checkpoint is None and ref is None else None
        if template is not None:
            checkpoint = template.as_checkpoint(job.name)
        if checkpoint is None:
            raise CheckpointNotFound(
                f"job '{name}' has no checkpoint to restore (make one with 'torpor checkpoint')"
            )
        if job.state in SUPERVISED_STATES or unsupervised(job):
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
            self.stop(job.name)
            job = self.records.job(job.name)
        self.ctx.criu.require()
        started = time.monotonic()
        # while restoring, the launcher pid on record is this process: if it dies, `ps` marks the job failed
        previous = self.records.transition(
            job.name, RESTORABLE_STATES, JobState.RESTORING, launcher_pid=os.getpid()
        )
        image_dir = self.ctx.store.restore_dir(checkpoint.id)
        launcher: PendingLauncher | None = None
        rewound: Rewound | None = None
        net: Path | None = None

        def prepare() -> None:
            nonlocal rewound
            if template is None:
                rewound = prepare_world(self.ctx, previous, checkpoint.id, image_dir, progress, rewind, warn)
            else:  # the template's files are not this job's to rewind
                if net is None:
                    refuse_taken_ports(image_dir, template)
                recreate_socket_folders(image_dir)

        try:
            launcher = self._start_launcher(job.name, LaunchMode.RESTORE)
            if previous.pid and not procfs.wait_gone(
                previous.pid, previous.pid_ticks, self.settings.pid_wait_s
            ):
                raise RestoreFailed(
                    f"the previous processes of '{name}' (pid {previous.pid}) are still running"
                )
            # a job with a network of its own comes back into it (made again after a reboot)
            origin = Templates(self.records).origin(job.name)
            net = (
                Networks(self.settings).ensure(job.name, origin.address)
                if origin and origin.address
                else None
            )
            fetch_and_release(
                self.ctx,
                launcher,
                checkpoint.id,
                checkpoint.size_bytes,
                image_dir,
                progress,
                prepare,
                lazy=lazy,
                copy_of=template.log_path if template else Moves(self.records).image_log(checkpoint.id),
                net_namespace=None if net is None else str(net),
                net_external=net is not None if template is None else template.own_network,
            )
        except TorporError as exc:
            if launcher is not None:
                launcher.abort()
            shutil.rmtree(image_dir, ignore_errors=True)
            if rewound is not None and rewound.paths:
                count = len(rewound.paths)
                problems = rewound.undo()
                exc.details.extend(problems)
                if not problems:
                    exc.details.append(f"the {count} file(s) torpor had cut are back as they were")
                elif len(problems) < count:
                    exc.details.append(
                        f"{count - len(problems)} of the {count} file(s) torpor had cut are back"
                    )
            self.records.transition(job.name, {JobState.RESTORING}, previous.state)
            if not isinstance(exc, RestoreFailed):
                exc.details.append(f"job '{name}' stays {previous.state}; its checkpoints are untouched")
                raise
            raise RestoreFailed(
                f"{exc.message}; job '{name}' stays {previous.state} and checkpoint {checkpoint.id} is kept",
                details=exc.details,
            ) from exc
        hibernation = self.records.latest_checkpoint(job.name)
        if previous.state == JobState.HIBERNATED and hibernation and hibernation.id != checkpoint.id:
            self._release_network_lock(job.name, hibernation.id, progress)
        if self.records.stopped_dump(job.name) == checkpoint.id:
            # torpor stopped the tree for that dump (the scheduler, at a memory limit): CRIU restored it
            # stopped, and it goes on now, whoever restored it
            restored = self.records.job(job.name)
            if restored.pid:
                for pid in procfs.namespace_members(restored.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            self.records.mark_stopped_dump(job.name, None)
        return self.records.job(job.name), checkpoint, time.monotonic() - started

    def _release_network_lock(self, name: JobName, hibernation: CheckpointId, progress: Progress) -> None:
        """Drop the network lock the dump of ``hibernation`` left: no restore of that image will drop it.

        Called once the job is removed while hibernated, or restored from another checkpoint
        (:mod:`torpor.adapters.netlock`); the peers of its connections then get a reset, not silence.
        """
        run = netlock.run_id(self.ctx.criu_log(name, "dump", hibernation))
        released = netlock.release(run) if run else []
        if released:
            progress(f"released the network lock of hibernation {hibernation} (nftables table {released[0]})")

    def wait_lazy(self, name: str, progress: Progress = quiet) -> None:
        """After a lazy restore, return once all of the job's memory is in; raise if that killed it.

        A damaged chunk is met only when the job touches its pages, after ``restore`` returned: torpor
        kills the job then (it must not run on memory it cannot get) and this says why.
        """
        try:
            killed = control.wait_lazy(self.settings.socket_path(name), on_progress=progress).killed
        except LauncherUnreachable:
            # the job ended (and its launcher with it) before we asked: its record says how
            job = self.reconcile(self.records.job(name))
            if job.state in SUPERVISED_STATES:
                raise
            killed = job.message if job.message and job.message.startswith(LAZY_KILL) else None
        if killed:
            raise RestoreFailed(
                f"the lazily restored job '{name}' was killed: {killed}",
                details=["its checkpoints are kept; 'torpor ps' shows it failed"],
            )

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
        for step in stop_policy.escalation(grace):
            try:
                os.kill(job.pid, step.signal)
            except ProcessLookupError:
                break
            if procfs.wait_gone(job.pid, job.pid_ticks, step.wait_s):
                break
        if orphaned:  # no launcher to record it
            self.records.set_fields(
                job.name,
                pid=None,
                ended_at=time.time(),
                message="its launcher had died; torpor stopped its unsupervised processes",
            )
            return self.records.job(job.name)
        # the launcher records the exit; wait for it so the next command sees a settled state
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            job = self.reconcile(self.records.job(name))
            if job.state not in LIVE_STATES:
                break
            time.sleep(0.05)
        return job

    def remove(self, name: str, force: bool = False) -> list[CheckpointId]:
        try:
            job = self.reconcile(self.records.job(name))
        except JobNotFound:
            if not self.records.delete_submission(name):
                raise
            return []  # it waited in the queue: nothing ran, nothing was stored
        if job.state in SUPERVISED_STATES or unsupervised(job):
            if not force or job.state == JobState.RESTORING:
                raise WrongState(f"job '{name}' is {_describe(job)}; stop it first or pass --force")
            launcher = job.launcher_pid
            self.stop(job.name, grace_s=0)
            if launcher and launcher != os.getpid():  # let it finish with the record before it goes
                procfs.wait_gone(launcher, None, 10)
        hibernation = self.records.latest_checkpoint(job.name)
        if job.state == JobState.HIBERNATED and hibernation is not None:
            self._release_network_lock(job.name, hibernation.id, quiet)
        origin = Templates(self.records).origin(job.name)
        if origin is not None and origin.address is not None:
            Networks(self.settings).remove(job.name)
        removed: list[CheckpointId] = []
        for checkpoint in self.records.checkpoints(job.name):
            self.ctx.store.delete(checkpoint.id)
            removed.append(checkpoint.id)
        self.records.delete_job(job.name)
        self.settings.socket_path(job.name).unlink(missing_ok=True)
        shutil.rmtree(self.settings.job_dir(job.name), ignore_errors=True)
        return removed

    def log_path(self, name: str) -> Path:
        return Path(self.records.job(name).log_path)


def _tree_alive(job: Job) -> bool:
    """Whether the process on record as the job's root is still that process, and alive."""
    return (
        job.pid is not None
        and job.pid_ticks is not None
        and procfs.is_alive(job.pid)
        and procfs.start_ticks(job.pid) == job.pid_ticks
    )


def unsupervised(job: Job) -> bool:
    """Whether the job's processes still run though its launcher died (the record keeps their pid)."""
    return job.state not in LIVE_STATES and _tree_alive(job)


def _describe(job: Job) -> str:
    return "running unsupervised (its launcher died)" if unsupervised(job) else str(job.state)
