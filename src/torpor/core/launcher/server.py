"""The launcher itself: one small process per job incarnation that supervises it and takes its commands.

Started detached (its own session, stdio away from the terminal) by ``torpor run`` or ``torpor resume``
(:mod:`torpor.core.launcher.spawn`):

* it becomes a child subreaper, then starts the job as PID 1 of a new PID namespace, in a new IPC
  namespace and a session of its own (stdin /dev/null, stdout+stderr appended to the job's log) — or,
  on resume, runs ``criu restore -d`` so the restored tree is re-parented to it;
* it records the job's pid and, when the job ends, its exit status;
* it serves ``status``, ``checkpoint`` and ``wait_lazy`` requests (:mod:`torpor.core.control`) on a unix
  socket; a checkpoint runs here, because the launcher is the one process that can tell a job killed by
  a hibernating dump from a crash.

The CLI is never the job's parent, so closing the terminal does not touch the job. The checkpoint and
restore themselves are :mod:`torpor.core.checkpoint`'s and :mod:`torpor.core.restore`'s.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torpor.adapters.system import ownprocess, private, procfs
from torpor.core import control, readiness
from torpor.core.checkpoint import checkpoint_in_launcher
from torpor.core.context import Context, Progress
from torpor.core.launcher import protocol
from torpor.core.launcher.protocol import LauncherEnds, LaunchMode, LaunchSpec, RestoreSpec, Started
from torpor.core.recordtypes import JobState
from torpor.core.restore import restore_into_launcher
from torpor.core.templates import Templates, program_of
from torpor.errors import JobExited, JobNotFound, JobStartFailed, TorporError
from torpor.policy.ready import Outcome, parse_ready_when


class Launcher:
    """Supervises one incarnation of a job: starts or restores it, records its end, serves its socket."""

    def __init__(
        self, spec: LaunchSpec, restore: RestoreSpec | None = None, umask: int = private.PRIVATE_UMASK
    ) -> None:
        """``restore``: what to restore from (mode restore); ``umask``: the job's when the settings name none."""
        self.spec = spec
        self.restore = restore
        self.ctx = Context(spec.settings())
        self.job_umask = umask if self.ctx.settings.job_umask is None else self.ctx.settings.job_umask
        if spec.umask is not None:
            self.job_umask = spec.umask
        self.job = self.ctx.records.job(spec.job)
        self.lock = threading.Lock()  # one operation at a time, and the waiter waits for it
        self.pid: int | None = None
        self.server: socketserver.ThreadingUnixStreamServer | None = None
        self.finished = threading.Event()  # the job's end is on record
        self.log_start = 0

    # -- starting -----------------------------------------------------------------------------------

    def start_job(self) -> int:
        """Fork the job as PID 1 of a new PID namespace, in a new IPC namespace; returns its pid (our child,
        via subreaping)."""
        log_fd = private.open_private(Path(self.job.log_path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self.log_start = os.fstat(log_fd).st_size  # what the job writes comes after: --ready-when log:
        pid_r, pid_w = os.pipe()
        exec_r, exec_w = os.pipe2(os.O_CLOEXEC)
        middle = os.fork()
        if middle == 0:  # pragma: no cover - runs in the forked children
            try:
                os.close(pid_r)
                os.close(exec_r)
                if self.spec.cgroup:  # the job's processes, forked from here, are all counted there
                    try:
                        ownprocess.join_cgroup(Path(self.spec.cgroup))
                    except OSError as exc:
                        os.write(
                            exec_w, f"cannot join its cgroup {self.spec.cgroup}: {exc.strerror}".encode()
                        )
                        raise
                ownprocess.unshare_job_namespaces()
                child = os.fork()
                if child == 0:
                    self._exec_job(log_fd, exec_w)
                os.write(pid_w, str(child).encode())
            finally:
                os._exit(0)
        os.close(pid_w)
        os.close(exec_w)
        os.close(log_fd)
        os.waitpid(middle, 0)  # once the middle process is reaped, the job is our child
        with os.fdopen(pid_r) as pipe:
            text = pipe.read()
        with os.fdopen(exec_r, "rb") as pipe:
            failure = pipe.read()
        if not text:
            why = failure.decode(errors="replace") or "creating its PID and IPC namespaces failed"
            raise JobStartFailed(f"could not start the job: {why}")
        pid = int(text)
        if failure:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            raise JobStartFailed(f"cannot run {self.job.command[0]!r}: {failure.decode(errors='replace')}")
        return pid

    def _exec_job(self, log_fd: int, exec_w: int) -> None:  # pragma: no cover - child side
        try:
            os.setsid()
            os.chdir(self.job.cwd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.closerange(3, exec_w)
            os.closerange(exec_w + 1, 65536)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            os.umask(self.job_umask)  # torpor's own is private; the job creates files as its caller would
            if self.spec.env is None:
                os.execvp(self.job.command[0], self.job.command)
            os.execvpe(self.job.command[0], self.job.command, self.spec.env)
        except OSError as exc:
            os.write(exec_w, (exc.strerror or str(exc)).encode())
        os._exit(127)

    def restore_job(self) -> int:
        spec = self.restore
        assert spec is not None and spec.image_dir and spec.checkpoint_id
        return restore_into_launcher(
            self.ctx,
            self.job,
            Path(spec.image_dir),
            spec.checkpoint_id,
            lazy=spec.lazy,
            served=spec.served,
            stream=spec.stream,
            copy_of=spec.copy_of,
            net_namespace=spec.net_namespace,
            net_external=spec.net_external,
            gate=self.ctx.restore_gate(Path(spec.gate), spec.gate_pid)
            if spec.gate and spec.gate_pid
            else None,
        )

    # -- serving ------------------------------------------------------------------------------------

    def serve(self, ready_fd: int) -> int:
        ownprocess.become_subreaper()
        try:
            pid = self.start_job() if self.spec.mode == LaunchMode.START else self.restore_job()
        except TorporError as exc:
            if self.spec.mode == LaunchMode.START:
                self.ctx.records.set_fields(self.job.name, message=exc.message)
                self.ctx.records.transition(
                    self.job.name, {JobState.STARTING}, JobState.FAILED, ended_at=time.time()
                )
            protocol.report_failed(ready_fd, exc)
            return 1
        self.pid = pid
        sock_path = self.ctx.settings.socket_path(self.job.name)
        private.make_private_dirs(sock_path.parent)
        sock_path.unlink(missing_ok=True)
        self.server = _Server(str(sock_path), _Handler)
        self.server.launcher = self
        expected = {JobState.STARTING} if self.spec.mode == LaunchMode.START else {JobState.RESTORING}
        self.ctx.records.transition(
            self.job.name,
            expected,
            JobState.RUNNING,
            pid=pid,
            pid_ticks=procfs.start_ticks(pid),
            launcher_pid=os.getpid(),
            started_at=time.time(),
            ended_at=None,
            exit_code=None,
            message=None,
            restored_from=self.restore.checkpoint_id if self.restore else None,
        )
        waiter = threading.Thread(target=self._wait_for_job, name="waiter", daemon=True)
        waiter.start()
        if self.spec.mode == LaunchMode.START and self.spec.warm and self.spec.ready_when:
            threading.Thread(target=self._save_when_ready, name="warm-start", daemon=True).start()
        protocol.report_started(ready_fd, Started(pid, os.getpid()))
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self.server.server_close()
            with contextlib.suppress(FileNotFoundError):
                if sock_path.exists() and self._socket_is_ours(sock_path):
                    sock_path.unlink()
        return 0

    def _socket_is_ours(self, path: Path) -> bool:
        try:
            job = self.ctx.records.job(self.job.name)
        except JobNotFound:
            return True  # removed (``rm``): nobody else serves it
        return job.launcher_pid in (None, os.getpid())

    def _wait_for_job(self) -> None:
        try:
            while True:
                waited = self.pid
                assert waited is not None
                try:
                    _, status = os.waitpid(waited, 0)
                except ChildProcessError:
                    status = None
                with self.lock:
                    if self.pid != waited and self.pid is not None and procfs.is_alive(self.pid):
                        continue  # a failed hibernation restored the job under a new pid: keep watching
                    self._finish(status)
                    self.finished.set()
                    break
        finally:  # even if the record could not be written (its state folder gone): do not linger
            assert self.server is not None
            self.server.shutdown()

    def _finish(self, status: int | None) -> None:
        job = self.ctx.records.job(self.job.name)
        if job.state == JobState.HIBERNATED or job.launcher_pid != os.getpid():
            return  # hibernated by a checkpoint, or a newer incarnation owns the record
        now = time.time()
        if status is None:
            state, code, message = JobState.FAILED, None, "the job's exit status was lost"
        elif os.WIFEXITED(status):
            state, code, message = JobState.EXITED, os.WEXITSTATUS(status), None
        else:
            sig = os.WTERMSIG(status)
            state, code = JobState.FAILED, 128 + sig
            message = f"killed by signal {sig} ({signal.Signals(sig).name})"
            if self.ctx.killed_because:  # torpor killed it, e.g. a lazy restore met a damaged chunk
                message = self.ctx.killed_because
        self.ctx.records.set_fields(self.job.name, pid=None, exit_code=code, message=message, ended_at=now)
        self.ctx.records.transition(self.job.name, set(JobState), state)

    def _save_when_ready(self) -> None:
        """``--warm-start``: once the job is ready, checkpoint it (it runs on) as its template."""
        assert self.spec.warm and self.spec.ready_when and self.pid
        ready_when = parse_ready_when(self.spec.ready_when)
        records = self.ctx.records
        verdict = readiness.watch(
            ready_when, self.pid, Path(self.job.log_path), self.log_start, stop=self.finished
        )
        if verdict.outcome != Outcome.READY:
            records.add_event(self.job.name, "warm-start", f"no template saved: {verdict.reason}")
            return
        try:
            with self.lock:
                job = records.job(self.job.name)
                if self.pid is None or job.state != JobState.RUNNING or self.finished.is_set():
                    return
                pids = procfs.namespace_members(self.pid)
                files, listens = program_of(job, pids)
                reply = checkpoint_in_launcher(
                    self.ctx, job.name, self.pid, False, self, _log_progress, for_copies=True
                )
                template, old = Templates(records).adopt(
                    self.spec.warm, reply.checkpoint, job, files, listens, str(ready_when), replace=True
                )
            if old is not None and old != template.checkpoint:
                self.ctx.store.delete(old)
        except TorporError as exc:
            records.add_event(self.job.name, "warm-start", f"no template saved: {exc.message}")
            return
        records.add_event(
            self.job.name,
            "warm-start",
            f"saved template {template.name}: {verdict.reason}",
            checkpoint=template.checkpoint,
            freeze_s=template.freeze_s,
            size_bytes=template.size_bytes,
        )

    # -- requests ------------------------------------------------------------------------------------

    def handle(self, request: control.Request, progress: Progress) -> control.Reply:
        if isinstance(request, control.StatusRequest):
            return control.StatusReply(pid=self.pid, launcher_pid=os.getpid())
        if isinstance(request, control.CheckpointRequest):
            with self.lock:
                if self.pid is None or not procfs.is_alive(self.pid):
                    raise JobExited(f"job '{self.job.name}' is not running")
                return checkpoint_in_launcher(
                    self.ctx,
                    self.job.name,
                    self.pid,
                    request.hibernate,
                    self,
                    progress,
                    ext_unix_sk=request.ext_unix_sk,
                    for_copies=request.for_copies,
                )
        # wait_lazy, after a lazy restore: until every page is in, the job can still meet a damaged chunk
        daemon = self.ctx.lazy_pages
        if daemon is not None and daemon.poll() is None:
            progress("the job runs; bringing in the rest of its memory, each chunk verified")
            daemon.wait()
        if self.ctx.killed_because:  # say it once the record says it too
            self.finished.wait(10)
        return control.WaitLazyReply(killed=self.ctx.killed_because)

    def adopt(self, pid: int) -> None:
        """A failed hibernation restored the job from its staging image: supervise the new tree."""
        self.pid = pid
        self.ctx.records.set_fields(self.job.name, pid=pid, pid_ticks=procfs.start_ticks(pid))


def _log_progress(text: str) -> None:
    print(f"warm start: {text}", flush=True)


class _Server(socketserver.ThreadingUnixStreamServer):
    # server_close() waits for handlers, so a hibernation's reply is sent before the launcher exits
    daemon_threads = False
    block_on_close = True
    launcher: Launcher


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        def send(message: dict[str, Any]) -> None:
            with contextlib.suppress(OSError):
                self.wfile.write(json.dumps(message).encode() + b"\n")
                self.wfile.flush()

        def progress(text: str) -> None:
            send(control.progress(text))

        reply: dict[str, Any]
        try:
            request = control.parse_request(json.loads(self.rfile.readline() or b"{}"))
            reply = control.reply_to_json(self.server.launcher.handle(request, progress))
        except TorporError as exc:
            reply = control.failed(exc)
        except Exception as exc:  # a bug: report it rather than leave the client hanging
            reply = {
                "ok": False,
                "error": "TorporError",
                "message": f"internal error: {exc!r}",
                "details": [],
            }
            print(f"launcher: internal error handling a request: {exc!r}", file=sys.stderr, flush=True)
        send(reply)


def forked(spec: LaunchSpec, log: Path, ends: LauncherEnds) -> int:
    """Become the launcher in a process just forked from the CLI (which imported everything already).

    Starting a launcher this way takes a millisecond instead of the ~0.1 s a new interpreter needs to
    import torpor, and a restore waits for its launcher. The CLI's stdio is swapped for the launcher's
    log, and every other descriptor it had is closed (a caller reading the CLI's output to its end must
    not wait for the launcher too).
    """
    gc.freeze()  # nothing the CLI left behind may be collected here and close a descriptor we reuse
    # signals as after an exec: the CLI's handlers (e.g. `torpor slurm run` queues SIGUSR1/SIGTERM and
    # wakes on a pipe) are not the launcher's; what the CLI ignores stays ignored (it means to)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    out = private.open_private(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    start = 3
    for keep in sorted(ends.fds):
        os.closerange(start, keep)
        start = keep + 1
    os.closerange(start, 65536)
    # the CLI's sys.stdout may not write to fd 1 at all (e.g. captured by a test runner)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as we do
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    with contextlib.suppress(OSError):
        ownprocess.set_process_name("torpor-launch")
    return _serve(spec, ends.ready_w, ends.go_r)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = LaunchSpec.from_json(args[0])
    ready_fd, go_fd = int(args[1]), int(args[2])  # args[3]: its life pipe, held until it exits
    return _serve(spec, ready_fd, go_fd)


def _serve(spec: LaunchSpec, ready_fd: int, go_fd: int) -> int:
    # what the launcher and CRIU (its child) write is private; the job gets its caller's umask back
    inherited = os.umask(private.PRIVATE_UMASK)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    # the CLI starts us early (a restore fetches its image meanwhile), then sends the rest of the spec
    go = protocol.receive_go(go_fd)
    if go is None:
        print(f"launcher {os.getpid()} for job {spec.job}: called off before it started", flush=True)
        return 0
    print(f"launcher {os.getpid()} for job {spec.job} ({spec.mode}) at {time.ctime()}", flush=True)
    return Launcher(spec, go.restore, inherited).serve(ready_fd)
