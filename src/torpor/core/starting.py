"""A job's start held ready: its launcher up and waiting, the job's record made only when it goes.

:meth:`torpor.core.engine.Engine.prepare_run` checks the start and starts the launcher; the scheduler
holds what it returns while victims are hibernated to make room, and starts the job the moment the room
is there (:meth:`PreparedRun.go`) or calls it off (:meth:`PreparedRun.cancel`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from torpor.core.launcher.protocol import PendingLauncher
from torpor.core.records import Records
from torpor.core.recordtypes import Job, JobName, JobState, Origin
from torpor.core.templates import Templates
from torpor.errors import JobNotFound, TorporError
from torpor.settings import Settings


@dataclass
class PreparedRun:
    """A job's start checked and its launcher up, waiting: :meth:`go` starts it, :meth:`cancel` calls it off."""

    records: Records
    settings: Settings
    name: JobName
    command: list[str]
    cwd: str
    launcher: PendingLauncher
    #: where the job comes from, noted with its record (a ``--warm-start``)
    origin: Origin | None = None

    def go(self) -> Job:
        """Make the job's record and let its launcher start it; the job as it runs (or the start's error)."""
        records = self.records
        try:
            records.create_job(
                self.name, self.command, self.cwd, str(self.settings.job_dir(self.name) / "output.log")
            )
            if self.origin is not None:
                Templates(records).set_origin(self.origin)
        except BaseException:
            self.launcher.abort()
            raise
        try:
            self.launcher.release()
        except TorporError:
            if records.job(self.name).state == JobState.STARTING:
                records.transition(self.name, {JobState.STARTING}, JobState.FAILED, ended_at=time.time())
            raise
        return records.job(self.name)

    def cancel(self) -> None:
        """The launcher exits without starting anything; the job's folder goes unless a job has it."""
        self.launcher.abort()
        try:
            self.records.job(self.name)
        except JobNotFound:
            shutil.rmtree(self.settings.job_dir(self.name), ignore_errors=True)
