"""Starting a new job from a template: a copy of a process tree that was ready, restored under a new name.

Order of a start from a template (:meth:`Cloner.start`)::

    the template's files checked against their stamps     stale: the caller starts the command cold
    a job record made (restoring), its origin noted       the name is the new job's
    a launcher started; the image fetched, each byte verified, as for any restore
    criu restore: the copy writes to its own log (--inherit-fd), closes the original's TCP
      connections instead of taking them over (--tcp-close), joins its own network if it has one
    job → running; its processes that handle SIGCONT get one (they were restored)

It is a restore like :meth:`torpor.core.engine.Engine.restore`, with three differences: nothing of the
template's files is rewound (the template's source job may still run and own them), the copy's log is
its own, and a failure leaves nothing behind: the job never ran, so it is forgotten again.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from torpor.adapters.system import private, procfs
from torpor.core.context import Progress, quiet
from torpor.core.engine import Engine
from torpor.core.jobnetworks import Networks
from torpor.core.launcher.protocol import LaunchMode, LaunchSpec, PendingLauncher
from torpor.core.launcher.release import fetch_and_release
from torpor.core.launcher.spawn import start_launcher
from torpor.core.naming import check_name, free_name
from torpor.core.recordtypes import Job, JobState, Origin, Template
from torpor.core.restore import recreate_socket_folders
from torpor.core.templates import (
    Templates,
    check_template_name,
    program_of,
    refuse_taken_ports,
    stamps_now,
)
from torpor.errors import TorporError, UsageError, WrongState
from torpor.policy.warmstart import stale_reasons, stale_summary


@dataclass(frozen=True)
class Started:
    """A job started from a template: the job as it runs, and how long the start took."""

    job: Job
    template: Template
    seconds: float


class Cloner:
    """Saves, removes and starts from the templates of one state directory (through its :class:`Engine`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ctx = engine.ctx
        self.templates = Templates(engine.records)

    def save(self, name: str, job_name: str, progress: Progress = quiet, warn: Progress = quiet) -> Template:
        """Checkpoint running job ``job_name`` (it runs on) and keep the checkpoint as template ``name``."""
        name = check_template_name(name)
        if self.templates.find(name) is not None:
            raise UsageError(f"a template named '{name}' exists: 'torpor template rm {name}' first")
        job = self.engine.reconcile(self.engine.records.job(job_name))
        if job.state != JobState.RUNNING or not job.pid:
            raise WrongState(f"cannot save a template of job '{job_name}': it is {job.state}, not running")
        pids = procfs.namespace_members(job.pid)
        files, listens = program_of(job, pids)
        checkpoint = self.engine.checkpoint(job.name, progress=progress, warn=warn, for_copies=True)
        template, _ = self.templates.adopt(name, checkpoint, job, files, listens)
        return template

    def remove(self, name: str) -> Template:
        """Forget template ``name`` and delete its image; the jobs started from it are not touched."""
        template = self.templates.get(name)
        self.templates.delete(name, template.checkpoint)
        self.ctx.store.delete(template.checkpoint)
        return template

    def stale(self, template: Template) -> str | None:
        """Why a start from ``template`` would not be the program it was (one line), or None."""
        return stale_summary(stale_reasons(template.files, stamps_now(template))) or None

    def start(
        self,
        template: Template,
        name: str | None = None,
        *,
        lazy: bool = False,
        warm: str | None = None,
        ready_when: str | None = None,
        own_network: bool = False,
        progress: Progress = quiet,
    ) -> Started:
        """Start a new job from ``template``; returns once it runs (with ``lazy``, its memory may still be
        coming in: :meth:`Engine.wait_lazy`). ``warm``, ``ready_when``: it is a ``--warm-start`` of that
        template (noted in its origin); ``own_network``: it gets a network namespace of its own, with an
        address on torpor's bridge (:class:`~torpor.core.jobnetworks.Networks`).

        The caller has checked :meth:`stale`. A failure leaves no job and raises its error under this
        start's name: a refusal (a taken port) as :class:`~torpor.errors.UsageError`, a failed restore as
        :class:`~torpor.errors.RestoreFailed`.
        """
        engine = self.engine
        records = engine.records
        engine.refuse_if_draining("start a job")
        self.ctx.criu.require()
        started = time.monotonic()
        if name is None:
            name = free_name(template.name, {job.name for job in records.jobs()})
        job_name = check_name(name)
        job_dir = engine.settings.job_dir(job_name)
        private.make_private_dirs(job_dir)
        records.create_job(job_name, template.command, template.cwd, str(job_dir / "output.log"))
        # while restoring, the launcher pid on record is this process: if it dies, `ps` marks the job failed
        records.transition(job_name, {JobState.STARTING}, JobState.RESTORING, launcher_pid=os.getpid())
        image_dir = self.ctx.store.restore_dir(template.checkpoint)
        launcher: PendingLauncher | None = None
        networks = Networks(engine.settings) if own_network else None
        net_namespace: str | None = None
        try:
            address = None
            if networks is not None:
                path, made = networks.create(job_name)
                net_namespace, address = str(path), str(made)
                progress(f"its own network: {address} on bridge {networks.bridge.name}")
            self.templates.set_origin(Origin(job_name, template.name, warm, ready_when, address))
            launcher = start_launcher(
                LaunchSpec(engine.settings.to_dict(), job_name, LaunchMode.RESTORE), job_dir / "launcher.log"
            )

            def prepare() -> None:
                if net_namespace is None:
                    refuse_taken_ports(image_dir, template)
                recreated = recreate_socket_folders(image_dir)
                if recreated:
                    progress(f"recreated {len(recreated)} missing folder(s) of the template's unix sockets")

            fetch_and_release(
                self.ctx,
                launcher,
                template.checkpoint,
                template.size_bytes,
                image_dir,
                progress,
                prepare,
                lazy=lazy,
                copy_of=template.log_path,
                net_namespace=net_namespace,
                net_external=template.own_network,
            )
        except TorporError as exc:
            if launcher is not None:
                launcher.abort()
            if networks is not None:
                networks.remove(job_name)
            shutil.rmtree(image_dir, ignore_errors=True)
            records.delete_job(job_name)
            shutil.rmtree(job_dir, ignore_errors=True)
            # a refusal stays one (exit 2), a failed restore one (exit 5)
            raise type(exc)(
                f"cannot start '{job_name}' from template '{template.name}': "
                f"{_why(exc, template, net_namespace)}",
                details=exc.details,
            ) from exc
        return Started(records.job(job_name), template, time.monotonic() - started)


def _why(exc: TorporError, template: Template, net_namespace: str | None) -> str:
    """The failure in the words of a start from a template: a taken port is the usual one."""
    if net_namespace is None and any("Address already in use" in line for line in exc.details):
        ports = sorted({port for _, port in template.listens})
        named = ", ".join(str(port) for port in ports) or "a port it listens on"
        return (
            f"port {named} is already taken here (by the template's own job or another copy of it?): "
            "start it with --own-network to give it an address of its own, or have the server set "
            "SO_REUSEPORT so that its copies share the port"
        )
    return exc.message
