"""The ``torpor`` command line: parse, call the engine, render a table or JSON. Nothing else.

Errors torpor expects are printed as one line (plus the lines that explain them, e.g. CRIU's log) and
exit with the error's code; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from torpor import __version__
from torpor.adapters.system import private
from torpor.apps import machine, slurm, templates
from torpor.apps import migrate as migrate_app
from torpor.apps import peers as peers_app
from torpor.apps import pod as pod_app
from torpor.apps.agent import commands as agent_commands
from torpor.apps.agent import scheduler_commands
from torpor.apps.agent.locate import answers, socket_path
from torpor.apps.agent.wire import SCHEDULER_CAUSES, scheduling_fields, status_to_dict
from torpor.apps.render import emit_json, human_age, human_bytes, progress, size_or_dash, table
from torpor.core.engine import Engine, JobStatus
from torpor.core.moves import Moves
from torpor.core.recordtypes import SUPERVISED_STATES, Checkpoint, JobState
from torpor.errors import TorporError
from torpor.policy import torchrun
from torpor.settings import Settings

# -- rendering -------------------------------------------------------------------------------------------


def _status_dict(status: JobStatus) -> dict[str, Any]:
    return status_to_dict(status)


# -- commands ---------------------------------------------------------------------------------------------


def cmd_run(engine: Engine, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    policy = agent_commands.policy_for_run(args)  # checked before the job starts
    templates.check_run_flags(args, command)
    where = ""
    if templates.wants_template(args):
        job, where = templates.run_with_template(engine, args, command)
    else:
        job = engine.run(args.name, command, os.getcwd())
    if policy is not None:
        engine.records.set_policy(job.name, policy)
    if args.lazy and job.restored_from is not None:
        engine.wait_lazy(job.name, progress=progress(args))
    if args.json:
        emit_json({**_status_dict(engine.status(job.name)), "started": where or "cold"})
    else:
        print(
            f"started job '{job.name}' (pid {job.pid}){' ' + where if where else ''}; output: torpor logs {job.name}"
        )
        if policy is not None:
            agent = "" if socket_path(engine.settings).exists() else " (once 'torpor agent' runs)"
            print(f"the agent will: {policy.describe()}{agent}")
        if torchrun.is_adapted(job.command):
            print(torchrun.NOTE)
    return 0


def cmd_ps(engine: Engine, args: argparse.Namespace) -> int:
    statuses = engine.statuses()
    # read here, not asked of the agent, so that ps says the same embedded (queued jobs: torpor queue)
    submissions = engine.records.submissions()
    cares = engine.records.cares()
    origins = templates.origins(engine)
    moved = Moves(engine.records).moved()  # handed to a peer: 'moved to PEER'
    if args.json:
        emit_json(
            [
                {
                    **_status_dict(s),
                    **scheduling_fields(submissions.get(s.job.name), cares.get(s.job.name), engine.records),
                    **templates.origin_fields(origins.get(s.job.name)),
                    "moved_to": moved.get(s.job.name),
                }
                for s in statuses
            ]
        )
        return 0
    now = time.time()
    rows = []
    for status in statuses:
        job = status.job
        state = f"moved to {moved[job.name]}" if job.name in moved else str(job.state)
        if job.exit_code is not None and job.state in (JobState.EXITED, JobState.FAILED):
            state += f" ({job.exit_code})"
        last = status.last_checkpoint
        rows.append(
            [
                job.name,
                state,
                str(job.pid) if job.pid else "-",
                human_bytes(status.rss_bytes),
                size_or_dash(submitted.memory) if (submitted := submissions.get(job.name)) else "-",
                human_age(now - job.created_at),
                f"{last.id} ({human_age(now - last.created_at)} ago)" if last else "-",
            ]
        )
    headers = ["NAME", "STATE", "PID", "MEMORY", "REQUEST", "AGE", "LAST CHECKPOINT"]
    if any(origin.address for origin in origins.values()):  # jobs with a network of their own
        headers.append("ADDRESS")
        for row, status in zip(rows, statuses, strict=True):
            row.append(origins[status.job.name].address or "-" if status.job.name in origins else "-")
    print(table(headers, rows) if rows else "no jobs")
    # why a job failed is worth a line of its own (an exit code says it for exited jobs), and why the
    # scheduler hibernated one
    reasons = [
        f"{s.job.name}: {s.job.message}" for s in statuses if s.job.state == JobState.FAILED and s.job.message
    ]
    for s in statuses:
        fields = scheduling_fields(submissions.get(s.job.name), cares.get(s.job.name), engine.records)
        if s.job.state == JobState.HIBERNATED and fields["hibernated_by"] in SCHEDULER_CAUSES:
            said = fields["hibernation"] or str(fields["hibernated_by"])
            reasons.append(f"{s.job.name}: {said}" + (f"; now {fields['why']}" if fields["why"] else ""))
    if reasons:
        print()
        print("\n".join(reasons))
    return 0


def cmd_logs(engine: Engine, args: argparse.Namespace) -> int:
    path = engine.log_path(args.name)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - kept open while following
    except FileNotFoundError:
        return 0
    with handle:
        if args.tail is not None:
            lines = handle.read().splitlines(keepends=True)[-args.tail :]
            sys.stdout.buffer.write(b"".join(lines))
        else:
            while chunk := handle.read(1 << 16):
                sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        while args.follow:
            chunk = handle.read(1 << 16)
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            if engine.status(args.name).job.state not in SUPERVISED_STATES:
                break
            time.sleep(0.2)
    return 0


def _checkpoint_line(verb: str, checkpoint: Checkpoint) -> str:
    return (
        f"{verb} {checkpoint.job} as {checkpoint.id}: frozen {checkpoint.freeze_s:.3f} s"
        f"{_precopied(checkpoint, ', after pre-copying ')}, image {human_bytes(checkpoint.size_bytes)}, "
        f"total {checkpoint.total_s:.2f} s"
    )


def _precopied(checkpoint: Checkpoint, lead: str = "") -> str:
    """What a pre-copied checkpoint copied while the job ran ("" when it was not pre-copied)."""
    if not checkpoint.rounds:
        return ""
    n = len(checkpoint.rounds)
    return f"{lead}{human_bytes(checkpoint.precopied_bytes)} in {n} round{'s' if n > 1 else ''}"


def _warn(args: argparse.Namespace) -> Any:
    """Warnings go to stderr even with --quiet; with --wait the command fails instead (exit 6)."""

    def warn(text: str) -> None:
        if not getattr(args, "wait", False):
            print(f"torpor: warning: {text}", file=sys.stderr, flush=True)

    return warn


def cmd_checkpoint(engine: Engine, args: argparse.Namespace) -> int:
    checkpoint = engine.checkpoint(
        args.name, hibernate=False, progress=progress(args), warn=_warn(args), ext_unix_sk=args.ext_unix_sk
    )
    if args.wait and not args.json:
        print(_checkpoint_line("checkpointed", checkpoint), flush=True)
    image = engine.wait_durable(checkpoint.id, progress=progress(args)) if args.wait else None
    if args.json:
        emit_json(
            {**asdict(checkpoint), **({"durable": True, "stored_bytes": image.stored_bytes} if image else {})}
        )
    elif image is not None:
        print(f"{checkpoint.id} is durable: {human_bytes(image.stored_bytes)} new in the store")
    else:
        print(_checkpoint_line("checkpointed", checkpoint))
    return 0


def cmd_hibernate(engine: Engine, args: argparse.Namespace) -> int:
    before = engine.status(args.name).rss_bytes
    checkpoint = engine.checkpoint(
        args.name, hibernate=True, progress=progress(args), warn=_warn(args), ext_unix_sk=args.ext_unix_sk
    )
    if args.wait and not args.json:
        print(
            _checkpoint_line("hibernated", checkpoint) + f"; freed {human_bytes(before)} of memory",
            flush=True,
        )
    image = engine.wait_durable(checkpoint.id, progress=progress(args)) if args.wait else None
    if args.json:
        durable = {"durable": True, "stored_bytes": image.stored_bytes} if image else {}
        emit_json({**asdict(checkpoint), "freed_rss_bytes": before, **durable})
    elif image is not None:
        print(f"{checkpoint.id} is durable: {human_bytes(image.stored_bytes)} new in the store")
    else:
        print(_checkpoint_line("hibernated", checkpoint) + f"; freed {human_bytes(before)} of memory")
    return 0


def _restore(engine: Engine, args: argparse.Namespace, ref: str | None) -> int:
    job, checkpoint, seconds = engine.restore(
        args.name,
        ref,
        force=args.force,
        progress=progress(args),
        lazy=args.lazy,
        rewind=args.rewind,
        warn=_warn(args),
    )
    if not args.json:
        print(f"restored {job.name} from {checkpoint.id} in {seconds:.2f} s (pid {job.pid})", flush=True)
    if args.lazy:
        started = time.monotonic()
        engine.wait_lazy(job.name, progress=progress(args))
        if not args.quiet:
            print(f"  … all of its memory is in ({time.monotonic() - started:.2f} s later)", file=sys.stderr)
    if args.json:
        emit_json({"job": job.name, "pid": job.pid, "checkpoint": checkpoint.id, "restore_s": seconds})
    return 0


def cmd_resume(engine: Engine, args: argparse.Namespace) -> int:
    return _restore(engine, args, None)


def cmd_restore(engine: Engine, args: argparse.Namespace) -> int:
    return _restore(engine, args, args.from_)


def cmd_checkpoints(engine: Engine, args: argparse.Namespace) -> int:
    checkpoints = engine.checkpoints(args.name)
    images = engine.image_states(checkpoints)
    if args.json:
        emit_json(
            [
                {
                    **asdict(c),
                    "state": image.state if (image := images.get(c.id)) else "missing",
                    "progress": image.progress if image else None,
                    "stored_bytes": image.stored_bytes if image else None,
                    "pinned": image.pinned if image else False,
                    "error": image.error if image else None,
                }
                for c in checkpoints
            ]
        )
        return 0
    rows = [
        [
            c.id + (" (pinned)" if (image := images.get(c.id)) and image.pinned else ""),
            c.job,
            c.kind,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created_at)),
            human_bytes(c.size_bytes),
            human_bytes(image.stored_bytes) if image and image.state == "durable" else "-",
            f"{c.freeze_s:.3f} s",
            _precopied(c) or "-",
            f"{c.total_s:.2f} s",
            image.state_text if image else "missing",
        ]
        for c in checkpoints
    ]
    headers = ["ID", "JOB", "KIND", "TIME", "SIZE", "STORED", "FROZEN", "PRE-COPIED", "TOTAL", "STATE"]
    print(table(headers, rows) if rows else "no checkpoints")
    troubled = [(c.id, image) for c in checkpoints if (image := images.get(c.id)) and image.error]
    if troubled:
        print("\nwhy some are not durable (only in RAM: lost if the machine restarts) or not known:")
        for checkpoint_id, image in troubled:
            unknown = "its state is unknown: " if image.state == "unknown" else ""
            print(f"  {checkpoint_id}: {unknown}{image.error}")
    return 0


def cmd_gc(engine: Engine, args: argparse.Namespace) -> int:
    removed, result = engine.gc(progress=progress(args))
    if args.json:
        emit_json({"removed_checkpoints": removed, **asdict(result)})
    else:
        print(
            f"retention removed {len(removed)} checkpoint(s); {result.chunks_deleted} unreferenced chunk(s) "
            f"deleted, {result.chunks_kept} kept for {result.checkpoints} checkpoint(s)"
        )
    return 0


def cmd_pin(engine: Engine, args: argparse.Namespace) -> int:
    checkpoint = engine.pin(args.name, args.checkpoint, pinned=not args.unpin)
    if args.json:
        emit_json({"checkpoint": checkpoint.id, "pinned": not args.unpin})
    else:
        print(f"{'unpinned' if args.unpin else 'pinned'} {checkpoint.id} of {checkpoint.job}")
    return 0


def cmd_stop(engine: Engine, args: argparse.Namespace) -> int:
    job = engine.stop(args.name, grace_s=args.timeout)
    if args.json:
        emit_json(_status_dict(engine.status(job.name)))
    else:
        print(f"stopped {job.name}: {job.state}" + (f" ({job.message})" if job.message else ""))
    return 0


def cmd_rm(engine: Engine, args: argparse.Namespace) -> int:
    removed = scheduler_commands.remove_or_cancel(engine, args.name, args.force)
    if args.json:
        emit_json({"job": args.name, "removed_checkpoints": removed or [], "cancelled": removed is None})
    elif removed is None:
        print(f"cancelled {args.name}: it waited in the queue and never started")
    else:
        print(f"removed {args.name} and {len(removed)} checkpoint(s)")
    return 0


#: what the CLI asks the agent to do when one runs (the rest only reads the state directory, or is run
#: with the caller's environment: ``run``)
THROUGH_THE_AGENT = frozenset({"ps", "checkpoint", "hibernate", "resume", "restore", "stop", "rm"})

# -- parser ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torpor",
        description="Run jobs under supervision; checkpoint, hibernate and restore them transparently with CRIU.",
        epilog="State lives in --home, $TORPOR_HOME, or /var/lib/torpor (root). See 'torpor COMMAND --help'.",
    )
    parser.add_argument("--version", action="version", version=f"torpor {__version__}")
    parser.add_argument("--home", help="state directory (default: $TORPOR_HOME or /var/lib/torpor)")
    parser.add_argument("--criu", help="criu binary to use (default: .venv/bin/criu, then PATH)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", required=True)

    def add(
        name: str, help_text: str, *, json_flag: bool = True, job: bool = True
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if job:
            p.add_argument("name", help="job name")
        if json_flag:
            p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
        return p

    p = add("run", "start COMMAND as a supervised job and return (the job survives the terminal)", job=False)
    p.add_argument("--name", help="job name (default: derived from the command)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    agent_commands.add_policy_flags(p, for_run=True)
    templates.add_run_flags(p)
    p.epilog = (
        "torchrun (or python -m torch.distributed.run) is started with its TCPStore without libuv, whose "
        "io_uring CRIU cannot checkpoint (docs/architecture.md)."
    )
    p.set_defaults(func=cmd_run)

    ps_help = "list jobs: name, state, pid, memory (resident, shared pages once), age, last checkpoint"
    add("ps", ps_help, job=False).set_defaults(func=cmd_ps)

    p = add("logs", "print a job's output (stdout and stderr)", json_flag=False)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output while the job runs")
    p.add_argument("-n", "--tail", type=int, help="only the last N lines")
    p.set_defaults(func=cmd_logs)

    ext_unix_help = (
        "save unix sockets connected to processes outside the job (a 'psql -h /tmp' session, an attached"
        " tmux client) without their outside end: a job restored from this checkpoint sees those"
        " connections closed"
    )
    p = add("checkpoint", "checkpoint a running job; it keeps running")
    p.add_argument(
        "--wait", action="store_true", help="return once the checkpoint is durable (in the cold tier)"
    )
    p.add_argument("--ext-unix-sk", action="store_true", help=ext_unix_help)
    p.set_defaults(func=cmd_checkpoint)
    p = add("hibernate", "checkpoint a running job, then stop it, freeing its memory")
    p.add_argument(
        "--wait", action="store_true", help="return once the checkpoint is durable (in the cold tier)"
    )
    p.add_argument("--ext-unix-sk", action="store_true", help=ext_unix_help)
    p.set_defaults(func=cmd_hibernate)

    lazy_help = (
        "start the job before all of its memory is read; the command returns once all of it is in "
        "(exit 5 if a damaged chunk killed the job meanwhile)"
    )
    rewind_help = (
        "cut the files the job writes back to their size at the checkpoint even where someone else "
        "changed them since the job stopped (the later bytes are saved first); without it torpor refuses"
    )
    p = add("resume", "restore a job from its latest checkpoint")
    p.add_argument("--force", action="store_true", help="stop the job first if it is running")
    p.add_argument("--lazy", action="store_true", help=lazy_help)
    p.add_argument("--rewind", action="store_true", help=rewind_help)
    p.set_defaults(func=cmd_resume)

    p = add("restore", "restore a job from a given checkpoint (roll back)")
    p.add_argument(
        "--from", dest="from_", required=True, metavar="CHECKPOINT_ID", help="checkpoint id or prefix"
    )
    p.add_argument("--force", action="store_true", help="stop the job first if it is running")
    p.add_argument("--lazy", action="store_true", help=lazy_help)
    p.add_argument("--rewind", action="store_true", help=rewind_help)
    p.set_defaults(func=cmd_restore)

    p = add("checkpoints", "list checkpoints: time, size and freeze time of each", job=False)
    p.add_argument("name", nargs="?", help="only this job's")
    p.set_defaults(func=cmd_checkpoints)

    p = add("stop", "stop a running job (SIGTERM, then SIGKILL); its checkpoints are kept")
    p.add_argument(
        "--timeout",
        type=agent_commands.seconds,
        metavar="DURATION",
        help="time between SIGTERM and SIGKILL, e.g. 10s (a bare number is seconds; default 5s)",
    )
    p.set_defaults(func=cmd_stop)

    p = add("pin", "keep a checkpoint whatever the retention (TORPOR_KEEP_LAST) says")
    p.add_argument("checkpoint", help="checkpoint id or prefix")
    p.add_argument("--unpin", action="store_true", help="let retention delete it again")
    p.set_defaults(func=cmd_pin)

    add(
        "gc",
        "apply retention, then delete stored chunks no checkpoint needs (safe while checkpointing)",
        job=False,
    ).set_defaults(func=cmd_gc)

    p = add("rm", "forget a job and delete its checkpoints (a submitted job still queued: cancel it)")
    p.add_argument("--force", action="store_true", help="stop the job first if it is running")
    p.set_defaults(func=cmd_rm)

    machine.add_parsers(sub, add)
    templates.add_parsers(sub, add)
    pod_app.add_parsers(sub, add)
    agent_commands.add_parsers(sub, add)
    peers_app.add_parsers(sub)
    migrate_app.add_parser(sub)
    scheduler_commands.add_scheduling_parsers(sub, add)
    slurm.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # everything torpor and CRIU create is private (images hold a job's memory); jobs keep the caller's
    caller_umask = os.umask(private.PRIVATE_UMASK)
    try:
        settings = replace(Settings.from_environment(home=args.home, criu=args.criu), job_umask=caller_umask)
        if args.command_name == "doctor":
            return machine.cmd_doctor(settings, args)
        if args.command_name == "store":
            return machine.cmd_store(settings, args)
        if getattr(args, "needs_settings", False):
            return int(args.func(settings, args))
        engine = Engine(settings)
        if args.command_name in THROUGH_THE_AGENT and answers(socket_path(settings)):
            from torpor.apps.agent.client import AgentClient, RemoteEngine

            client = AgentClient.if_running(socket_path(settings))
            if client is not None:
                try:
                    return int(args.func(RemoteEngine(client, engine), args))
                finally:
                    client.close()
        return int(args.func(engine, args))
    except TorporError as exc:
        if args.debug:
            raise
        print(f"torpor: error: {exc.message}", file=sys.stderr)
        for line in exc.details:
            print(f"  {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("torpor: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        os.umask(caller_umask)  # for a caller that runs main() in its own process (tests)


if __name__ == "__main__":
    sys.exit(main())
