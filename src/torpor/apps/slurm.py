"""``torpor slurm``: batch jobs that Slurm can preempt, requeue or hold without losing their work.

``torpor slurm run -- CMD`` is the last line of a batch script (``exec torpor slurm run -- CMD``). It runs
CMD as a torpor job named after the Slurm job (``slurm-<SLURM_JOB_ID>``), stays in the foreground for the
whole run, copies the job's output to its own stdout (Slurm's output file) and exits with the job's exit
status. Then:

* **SIGUSR1** (``--signal=B:USR1@N``; with ``SlurmctldParameters=preempt_send_user_signal`` Slurm sends
  it the moment the job is preempted): hibernate the job into the store — its memory is freed — and
  ``scontrol requeue`` it. Simply exiting is not enough: Slurm would count the job as completed.
* **SIGTERM** (``scontrol requeue``, ``scancel``, the end of a grace time): hibernate the job, then
  requeue it unless Slurm is already requeueing it (its restart count went up) or ending it for good
  (cancelled, out of time): the checkpoint stays in the store and ``scontrol requeue`` brings it back.
* **SIGUSR2** (``torpor slurm hibernate JOBID``): hibernate and ``scontrol requeuehold`` — the
  hibernate-instead-of-suspend path: the job leaves the node and its memory, and ``torpor slurm resume
  JOBID`` (``scontrol release``) lets Slurm run it again wherever there is room.
* **Started again** (``SLURM_RESTART_COUNT`` > 0, same job id, state directory shared between nodes):
  restore the newest checkpoint of this Slurm job; if that fails, the one before, and so on; with none
  left, start cold. Every such decision is written to stderr (Slurm's error file), prefixed
  ``torpor slurm:``.
* ``--interval S`` also takes a checkpoint every S seconds while the job runs, bounding what a node crash
  can lose (the restart then repeats at most the steps after the last checkpoint).

Because Slurm truncates the output file when it starts a requeued job (the default ``--open-mode``),
a restored run first replays the job's earlier output, so the file ends up as if the job had never
stopped. With ``--open-mode=append`` the earlier output is still there and is not repeated.

What to restore, when to start cold and whether to requeue are :mod:`torpor.policy.slurm`'s decisions;
this module reads the environment, the records and Slurm, acts on them and writes what it did.

Slurm's SIGTERM reaches every process of the job, not just this one: the job's main process ignores it
(it is PID 1 of its own PID namespace and has no handler), and torpor's launcher is started with SIGTERM
ignored; child processes of the job that do not handle SIGTERM die before the checkpoint. Preempting
through ``--signal=B:USR1`` signals only this process and has no such problem.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import select
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from torpor.adapters import slurm
from torpor.apps.agent.commands import seconds
from torpor.core.engine import Engine
from torpor.core.recordtypes import Checkpoint, Job, JobState
from torpor.errors import TorporError, UsageError
from torpor.policy import slurm as policy
from torpor.policy.slurm import After

PREFIX = "torpor slurm"
_ENDED = frozenset({JobState.EXITED, JobState.FAILED})
_POLL_S = 0.2


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job this batch script runs as (read from the environment at the edge)."""

    job_id: str
    restart_count: int

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> SlurmJob:
        job_id = environ.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            raise UsageError(
                "torpor slurm run must run inside a Slurm batch job (SLURM_JOB_ID is not set): "
                "submit it with sbatch, e.g. sbatch --signal=B:USR1@60 --wrap 'exec torpor slurm run -- CMD'"
            )
        if not job_id.isdigit():
            raise UsageError(f"SLURM_JOB_ID is {job_id!r}, not a job number")
        restarts = environ.get("SLURM_RESTART_COUNT", "").strip() or "0"
        if not restarts.isdigit():
            raise UsageError(f"SLURM_RESTART_COUNT is {restarts!r}, not a number")
        return cls(job_id, int(restarts))

    def owns(self, torpor_job: str) -> bool:
        return policy.owns(self.job_id, torpor_job)


@dataclass(frozen=True)
class _Start:
    name: str  # the torpor job now running
    replay_to: int | None  # restored: its log up to here is the output before the checkpoint
    follow_from: int  # where in its log the output of this run begins


@dataclass
class _OutputState:
    """What Slurm's output file holds, kept in ``<home>/slurm/<id>.json`` across the job's runs."""

    job: str | None = None  # the torpor job whose log was being copied
    offset: int = 0  # how far into that log
    written: int = 0  # bytes of job output in Slurm's file (it is truncated on a restart, unless appending)
    marks: dict[str, int] = field(default_factory=dict)  # checkpoint id → size of the job's log then

    @classmethod
    def load(cls, path: Path) -> _OutputState:
        try:
            data = json.loads(path.read_text())
            marks = {str(k): int(v) for k, v in dict(data.get("marks", {})).items()}
            job = data.get("job")
            return cls(
                str(job) if job else None, int(data.get("offset", 0)), int(data.get("written", 0)), marks
            )
        except (OSError, ValueError, TypeError, AttributeError):
            return cls()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "format": 1,
                    "job": self.job,
                    "offset": self.offset,
                    "written": self.written,
                    "marks": self.marks,
                }
            )
        )
        os.replace(tmp, path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Supervisor:
    """One run of a Slurm job: start or restore, forward output, answer signals, report the exit."""

    def __init__(
        self,
        engine: Engine,
        job: SlurmJob,
        command: list[str],
        cwd: str,
        interval_s: float | None,
        out: IO[bytes],
        err: TextIO,
    ) -> None:
        self.engine = engine
        self.job = job
        self.command = command
        self.cwd = cwd
        self.interval_s = interval_s
        self.out = out
        self.err = err
        self.state_file = engine.settings.home / "slurm" / f"{job.job_id}.json"
        self.output = _OutputState.load(self.state_file)
        self.history = engine.settings.home / "slurm" / f"{job.job_id}.log"
        self.signals: list[int] = []
        self._wake_r = -1

    def say(self, text: str) -> None:
        """Tell Slurm's error file, and ``<home>/slurm/<id>.log``, which outlives Slurm truncating it."""
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        line = f"{PREFIX} [{stamp}]: {text}"
        print(line, file=self.err, flush=True)
        with contextlib.suppress(OSError):
            self.history.parent.mkdir(parents=True, exist_ok=True)
            with open(self.history, "a") as history:
                history.write(f"{line}\n")

    # -- the whole run --------------------------------------------------------------------------------

    def run(self) -> int:
        truncated = self._output_was_truncated()  # before anything is written to it
        if truncated:
            self.output.written = 0
        self._install_signal_handlers()
        start = self._start()
        with open(self.engine.log_path(start.name), "rb") as log:
            if start.replay_to is not None:
                # a restored job: the earlier output up to its checkpoint, unless Slurm's file has it
                done = self.output.offset if not truncated and self.output.job == start.name else 0
                log.seek(min(done, start.replay_to))
                self._write(log.read(max(0, start.replay_to - log.tell())))
            log.seek(start.follow_from)
            self.output.job = start.name
            return self._supervise(start.name, log)

    def _install_signal_handlers(self) -> None:
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        for name in policy.SIGNALS:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    @contextlib.contextmanager
    def _term_ignored(self) -> Iterator[None]:
        """Start launchers with SIGTERM ignored: Slurm signals every process of the job, and the launcher
        must outlive that signal to checkpoint the job (the job itself gets SIGTERM back to default)."""
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    # -- starting -------------------------------------------------------------------------------------

    def _start(self) -> _Start:
        """Restore the newest usable checkpoint on a restart, else start cold."""
        if not policy.restores(self.job.restart_count):
            self._forget_earlier_jobs_with_this_id()
        else:
            restored = self._restore_newest()
            if restored is not None:
                return restored
        return _Start(self._cold_start(), replay_to=None, follow_from=0)

    def _checkpoints(self) -> list[Checkpoint]:
        """This Slurm job's checkpoints in the order a restart tries them (over all its incarnations)."""
        return policy.restore_order(self.job.job_id, self.engine.records.checkpoints())

    def _restore_newest(self) -> _Start | None:
        candidates = self._checkpoints()
        if not candidates:
            self.say(
                f"restart {self.job.restart_count} of Slurm job {self.job.job_id}: no checkpoint exists "
                "(it was stopped before its first checkpoint); starting cold"
            )
            return None
        for index, checkpoint in enumerate(candidates):
            try:
                log_size = _size(self.engine.log_path(checkpoint.job))  # the restored job appends here
                with self._term_ignored():
                    _, _, seconds = self.engine.restore(checkpoint.job, checkpoint.id)
            except TorporError as exc:
                previous = policy.fallback(candidates, index)
                fallback = f"the previous checkpoint {previous.id}" if previous else "a cold start"
                self.say(
                    f"restoring checkpoint {checkpoint.id} failed: {exc.message}; falling back to {fallback}"
                )
                for line in exc.details[-6:]:
                    self.say(f"  {line}")
                continue
            age = time.time() - checkpoint.created_at
            self.say(
                f"restart {self.job.restart_count}: restored {checkpoint.job} from {checkpoint.kind} "
                f"{checkpoint.id} (taken {age:.0f} s ago) in {seconds:.2f} s; it continues where it was"
            )
            # the log holds the output up to the checkpoint, maybe more from the run that went on after it
            at_checkpoint = min(self.output.marks.get(checkpoint.id, log_size), log_size)
            return _Start(checkpoint.job, replay_to=at_checkpoint, follow_from=log_size)
        return None

    def _cold_start(self) -> str:
        taken = {job.name for job in self.engine.records.jobs()}
        unique = policy.cold_start_name(self.job.job_id, self.job.restart_count, taken)
        with self._term_ignored():
            job = self.engine.run(unique, self.command, self.cwd)
        self.say(f"started {' '.join(self.command)} as torpor job {job.name} (pid {job.pid})")
        return job.name

    def _forget_earlier_jobs_with_this_id(self) -> None:
        """A first run whose id already has torpor jobs: they belong to an earlier cluster's job with the
        same number (Slurm numbers jobs anew when its state is wiped); restoring them would be wrong."""
        for job in self.engine.records.jobs():
            if self.job.owns(job.name):
                removed = self.engine.remove(job.name, force=False)
                self.say(
                    f"removed torpor job {job.name} and {len(removed)} checkpoint(s): left by an earlier "
                    f"Slurm job numbered {self.job.job_id} (this is a first run, not a restart)"
                )
        self.state_file.unlink(missing_ok=True)
        self.history.unlink(missing_ok=True)
        self.output = _OutputState()

    # -- output ---------------------------------------------------------------------------------------

    def _output_was_truncated(self) -> bool:
        """Whether Slurm's output file lost the earlier runs' output (default) or kept it (append mode)."""
        try:
            size = os.fstat(self.out.fileno()).st_size
        except (OSError, ValueError, AttributeError):
            return True
        return self.output.written == 0 or size < self.output.written

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()
        self.output.written += len(data)

    def _forward(self, log: IO[bytes]) -> None:
        while chunk := log.read(1 << 16):
            self._write(chunk)

    def _save_output_state(self, log: IO[bytes]) -> None:
        self.output.offset = log.tell()
        existing = {c.id for c in self._checkpoints()}  # forget the marks of checkpoints retention deleted
        self.output.marks = {id_: size for id_, size in self.output.marks.items() if id_ in existing}
        with contextlib.suppress(OSError):
            self.output.save(self.state_file)

    # -- supervising ----------------------------------------------------------------------------------

    def _supervise(self, name: str, log: IO[bytes]) -> int:
        next_checkpoint = time.monotonic() + self.interval_s if self.interval_s else None
        while True:
            self._forward(log)
            if self.signals:
                return self._stop_for_slurm(name, self.signals[0], log)
            if next_checkpoint is not None and time.monotonic() >= next_checkpoint:
                self._periodic_checkpoint(name, log)
                next_checkpoint = time.monotonic() + (self.interval_s or 0)
                continue
            job = self.engine.reconcile(self.engine.records.job(name))
            if job.state in _ENDED:
                self._forward(log)
                return self._exit_code(job)
            self._sleep(_POLL_S)

    def _sleep(self, seconds: float) -> None:
        ready, _, _ = select.select([self._wake_r], [], [], seconds)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def _exit_code(self, job: Job) -> int:
        code = job.exit_code if job.exit_code is not None else 1
        if job.state == JobState.FAILED:
            self.say(f"the job failed: {job.message or 'no reason recorded'} (exit {code})")
        return code

    def _periodic_checkpoint(self, name: str, log: IO[bytes]) -> None:
        try:
            checkpoint = self.engine.checkpoint(name, hibernate=False)
        except TorporError as exc:
            if self.engine.reconcile(self.engine.records.job(name)).state not in _ENDED:
                self.say(f"periodic checkpoint failed: {exc.message}; the job keeps running")
            return
        # the job kept running: the log may already hold a line or two printed after the freeze, which a
        # restore from here then repeats (the exact offset is only known for hibernations)
        self.output.marks[checkpoint.id] = _size(self.engine.log_path(name))
        self._forward(log)
        self._save_output_state(log)
        self.say(
            f"checkpoint {checkpoint.id}: frozen {checkpoint.freeze_s:.2f} s, "
            f"{checkpoint.size_bytes / 2**20:.1f} MiB"
        )

    # -- preemption, requeue, hold --------------------------------------------------------------------

    def _stop_for_slurm(self, name: str, signum: int, log: IO[bytes]) -> int:
        received = signal.Signals(signum).name
        what = policy.intent(received).value  # "hold" or "requeue"
        self.say(f"received {received} at {time.time():.3f}: hibernating the job, then {what}")
        try:
            checkpoint = self.engine.checkpoint(name, hibernate=True)
        except TorporError as exc:
            job = self.engine.reconcile(self.engine.records.job(name))
            if job.state in _ENDED:
                self._forward(log)
                self.say(f"the job ended before it could be hibernated: {exc.message}")
                return self._exit_code(job)
            self.say(f"checkpoint failed: {exc.message}")
            for line in exc.details[-6:]:
                self.say(f"  {line}")
            older = self._checkpoints()
            self.say(
                f"the next run restores the earlier checkpoint {older[0].id}"
                if older
                else "the next run starts cold (there is no checkpoint to restore)"
            )
            with contextlib.suppress(TorporError):
                self.engine.stop(name, grace_s=0)
        else:
            self.output.marks[checkpoint.id] = _size(self.engine.log_path(name))  # exact: the job is gone
            self.say(
                f"hibernated as {checkpoint.id}: frozen {checkpoint.freeze_s:.2f} s, image "
                f"{checkpoint.size_bytes / 2**20:.1f} MiB, {checkpoint.total_s:.2f} s in all; its memory is free"
            )
        self._forward(log)
        self._save_output_state(log)
        return self._requeue(received)

    def _requeue(self, received: str) -> int:
        """Requeue or hold the Slurm job as the policy says after the signal ``received``."""
        job_id = self.job.job_id
        state = None
        if policy.asks_slurm(received):
            try:
                info = slurm.job_info(job_id)
            except TorporError as exc:
                self.say(f"cannot ask Slurm about job {job_id}: {exc.message}; not requeueing it")
                return 1
            state = policy.SlurmState(info.state, info.restarts)
        after = policy.after_stop(received, self.job.restart_count, state)
        if after is After.SLURM_REQUEUES:
            self.say("Slurm is requeueing the job itself; the next run restores it")
            return 0
        if after is After.SLURM_ENDS and state is not None:
            self.say(
                f"Slurm is ending the job ({state.state}); it stays hibernated: "
                f"'scontrol requeue {job_id}' brings it back where it was"
            )
            return 0
        hold = after is After.HOLD
        try:
            slurm.requeue(job_id, hold=hold)
        except TorporError as exc:
            self.say(
                f"could not requeue Slurm job {job_id}: {exc.message}; the job is hibernated: "
                f"'scontrol requeue {job_id}' brings it back where it was"
            )
            return 1
        if hold:
            self.say(f"Slurm job {job_id} is held; 'torpor slurm resume {job_id}' lets it run again")
        else:
            self.say(f"requeued Slurm job {job_id}; the next run restores it")
        return 0


# -- commands -----------------------------------------------------------------------------------------


def cmd_run(engine: Engine, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given: torpor slurm run [--interval S] -- COMMAND [ARGS...]")
    if args.interval is not None and args.interval <= 0:
        raise UsageError(f"--interval must be a positive number of seconds, not {args.interval}")
    job = SlurmJob.from_environment(os.environ)
    if not os.environ.get("TORPOR_HOT_CAPACITY"):
        # the node goes to another job right after a hibernation: write images straight to the (shared)
        # cold tier instead of keeping them in this node's RAM, where a restart elsewhere cannot find them
        engine = Engine(dataclasses.replace(engine.settings, hot_capacity_bytes=0))
    _keep_stdout_blocking()
    supervisor = Supervisor(engine, job, command, os.getcwd(), args.interval, sys.stdout.buffer, sys.stderr)
    return supervisor.run()


def cmd_hibernate(engine: Engine, args: argparse.Namespace) -> int:
    job_id = _job_id(args.job_id)
    slurm.signal_batch_shell(job_id, "USR2")
    print(
        f"asked Slurm job {job_id} to hibernate; it is requeued and held, its memory freed "
        f"('torpor slurm resume {job_id}' lets it run again)"
    )
    return 0


def cmd_resume(engine: Engine, args: argparse.Namespace) -> int:
    job_id = _job_id(args.job_id)
    slurm.release(job_id)
    print(f"released Slurm job {job_id}; it restores where it was when Slurm starts it")
    return 0


def _job_id(text: str) -> str:
    if not text.isdigit():
        raise UsageError(f"bad Slurm job id {text!r}: give the number sbatch printed")
    return text


def _keep_stdout_blocking() -> None:
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stdout.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def add_parser(sub: Any) -> None:
    """Add ``torpor slurm {run,hibernate,resume}`` to the CLI's subcommands."""
    parser = sub.add_parser(
        "slurm",
        help="run batch jobs that Slurm can preempt and requeue without losing work (see docs/slurm.md)",
        description="Run batch jobs under torpor so Slurm preemption, requeue and hold keep their work.",
    )
    commands = parser.add_subparsers(dest="slurm_command", metavar="SLURM_COMMAND", required=True)

    p = commands.add_parser(
        "run",
        help="the batch script's last line: exec torpor slurm run -- CMD",
        description=(
            "Run CMD as this Slurm job under torpor, in the foreground, with its output on stdout. "
            "SIGUSR1/SIGTERM: hibernate and requeue; SIGUSR2: hibernate and hold; on a restart "
            "(SLURM_RESTART_COUNT > 0): restore the newest checkpoint."
        ),
    )
    p.add_argument(
        "--interval",
        type=seconds,
        metavar="DURATION",
        help="also checkpoint this often, e.g. 10m (a bare number is seconds; bounds a node crash's loss)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=cmd_run)

    p = commands.add_parser(
        "hibernate",
        help="hibernate a running Slurm job and hold it (instead of suspending it in memory)",
    )
    p.add_argument("job_id", help="Slurm job id")
    p.set_defaults(func=cmd_hibernate)

    p = commands.add_parser("resume", help="release a hibernated Slurm job so it restores when scheduled")
    p.add_argument("job_id", help="Slurm job id")
    p.set_defaults(func=cmd_resume)
