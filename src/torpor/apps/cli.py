"""The ``torpor`` command line: parse, call the engine, render a table or JSON. Nothing else.

Errors torpor expects are printed as one line (plus the lines that explain them, e.g. CRIU's log) and
exit with the error's code; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from torpor import __version__
from torpor.adapters import system
from torpor.apps import slurm
from torpor.core import doctor
from torpor.core.engine import Engine, JobStatus
from torpor.core.records import SUPERVISED_STATES, Checkpoint, JobState
from torpor.core.store import config as store_config
from torpor.errors import TorporError, UsageError
from torpor.settings import Settings

# -- rendering -------------------------------------------------------------------------------------------


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _status_dict(status: JobStatus) -> dict[str, Any]:
    job = status.job
    data: dict[str, Any] = asdict(job)
    data["state"] = str(job.state)
    data["rss_bytes"] = status.rss_bytes
    data["last_checkpoint"] = asdict(status.last_checkpoint) if status.last_checkpoint else None
    return data


def _emit_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))


def _progress(args: argparse.Namespace) -> Any:
    def show(text: str) -> None:
        if not args.quiet:
            print(f"  … {text}", file=sys.stderr, flush=True)

    return show


# -- commands ---------------------------------------------------------------------------------------------


def cmd_run(engine: Engine, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    job = engine.run(args.name, command, os.getcwd())
    if args.json:
        _emit_json(_status_dict(engine.status(job.name)))
    else:
        print(f"started job '{job.name}' (pid {job.pid}); output: torpor logs {job.name}")
    return 0


def cmd_ps(engine: Engine, args: argparse.Namespace) -> int:
    statuses = engine.statuses()
    if args.json:
        _emit_json([_status_dict(s) for s in statuses])
        return 0
    now = time.time()
    rows = []
    for status in statuses:
        job = status.job
        state = str(job.state)
        if job.exit_code is not None and job.state in (JobState.EXITED, JobState.FAILED):
            state += f" ({job.exit_code})"
        last = status.last_checkpoint
        rows.append(
            [
                job.name,
                state,
                str(job.pid) if job.pid else "-",
                human_bytes(status.rss_bytes),
                human_age(now - job.created_at),
                f"{last.id} ({human_age(now - last.created_at)} ago)" if last else "-",
            ]
        )
    print(table(["NAME", "STATE", "PID", "RSS", "AGE", "LAST CHECKPOINT"], rows) if rows else "no jobs")
    # why a job failed is worth a line of its own (an exit code says it for exited jobs)
    reasons = [
        f"{s.job.name}: {s.job.message}" for s in statuses if s.job.state == JobState.FAILED and s.job.message
    ]
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
        f"{verb} {checkpoint.job} as {checkpoint.id}: frozen {checkpoint.freeze_s:.3f} s, "
        f"image {human_bytes(checkpoint.size_bytes)}, total {checkpoint.total_s:.2f} s"
    )


def _warn(args: argparse.Namespace) -> Any:
    """Warnings go to stderr even with --quiet; with --wait the command fails instead (exit 6)."""

    def warn(text: str) -> None:
        if not args.wait:
            print(f"torpor: warning: {text}", file=sys.stderr, flush=True)

    return warn


def cmd_checkpoint(engine: Engine, args: argparse.Namespace) -> int:
    checkpoint = engine.checkpoint(args.name, hibernate=False, progress=_progress(args), warn=_warn(args))
    if args.wait and not args.json:
        print(_checkpoint_line("checkpointed", checkpoint), flush=True)
    image = engine.wait_durable(checkpoint.id, progress=_progress(args)) if args.wait else None
    if args.json:
        _emit_json(
            {**asdict(checkpoint), **({"durable": True, "stored_bytes": image.stored_bytes} if image else {})}
        )
    elif image is not None:
        print(f"{checkpoint.id} is durable: {human_bytes(image.stored_bytes)} new in the store")
    else:
        print(_checkpoint_line("checkpointed", checkpoint))
    return 0


def cmd_hibernate(engine: Engine, args: argparse.Namespace) -> int:
    before = engine.status(args.name).rss_bytes
    checkpoint = engine.checkpoint(args.name, hibernate=True, progress=_progress(args), warn=_warn(args))
    if args.wait and not args.json:
        print(
            _checkpoint_line("hibernated", checkpoint) + f"; freed {human_bytes(before)} of memory",
            flush=True,
        )
    image = engine.wait_durable(checkpoint.id, progress=_progress(args)) if args.wait else None
    if args.json:
        durable = {"durable": True, "stored_bytes": image.stored_bytes} if image else {}
        _emit_json({**asdict(checkpoint), "freed_rss_bytes": before, **durable})
    elif image is not None:
        print(f"{checkpoint.id} is durable: {human_bytes(image.stored_bytes)} new in the store")
    else:
        print(_checkpoint_line("hibernated", checkpoint) + f"; freed {human_bytes(before)} of memory")
    return 0


def _restore(engine: Engine, args: argparse.Namespace, ref: str | None) -> int:
    job, checkpoint, seconds = engine.restore(
        args.name, ref, force=args.force, progress=_progress(args), lazy=args.lazy
    )
    if not args.json:
        print(f"restored {job.name} from {checkpoint.id} in {seconds:.2f} s (pid {job.pid})", flush=True)
    if args.lazy:
        started = time.monotonic()
        engine.wait_lazy(job.name, progress=_progress(args))
        if not args.quiet:
            print(f"  … all of its memory is in ({time.monotonic() - started:.2f} s later)", file=sys.stderr)
    if args.json:
        _emit_json({"job": job.name, "pid": job.pid, "checkpoint": checkpoint.id, "restore_s": seconds})
    return 0


def cmd_resume(engine: Engine, args: argparse.Namespace) -> int:
    return _restore(engine, args, None)


def cmd_restore(engine: Engine, args: argparse.Namespace) -> int:
    return _restore(engine, args, args.from_)


def cmd_checkpoints(engine: Engine, args: argparse.Namespace) -> int:
    checkpoints = engine.checkpoints(args.name)
    images = engine.image_states(checkpoints)
    if args.json:
        _emit_json(
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
            f"{c.total_s:.2f} s",
            image.state_text if image else "missing",
        ]
        for c in checkpoints
    ]
    headers = ["ID", "JOB", "KIND", "TIME", "SIZE", "STORED", "FROZEN", "TOTAL", "STATE"]
    print(table(headers, rows) if rows else "no checkpoints")
    troubled = [(c.id, image) for c in checkpoints if (image := images.get(c.id)) and image.error]
    if troubled:
        print("\nwhy some are not durable (only in RAM: lost if the machine restarts) or not known:")
        for checkpoint_id, image in troubled:
            unknown = "its state is unknown: " if image.state == "unknown" else ""
            print(f"  {checkpoint_id}: {unknown}{image.error}")
    return 0


def cmd_gc(engine: Engine, args: argparse.Namespace) -> int:
    removed, result = engine.gc(progress=_progress(args))
    if args.json:
        _emit_json({"removed_checkpoints": removed, **asdict(result)})
    else:
        print(
            f"retention removed {len(removed)} checkpoint(s); {result.chunks_deleted} unreferenced chunk(s) "
            f"deleted, {result.chunks_kept} kept for {result.checkpoints} checkpoint(s)"
        )
    return 0


def cmd_pin(engine: Engine, args: argparse.Namespace) -> int:
    checkpoint = engine.pin(args.name, args.checkpoint, pinned=not args.unpin)
    if args.json:
        _emit_json({"checkpoint": checkpoint.id, "pinned": not args.unpin})
    else:
        print(f"{'unpinned' if args.unpin else 'pinned'} {checkpoint.id} of {checkpoint.job}")
    return 0


def cmd_stop(engine: Engine, args: argparse.Namespace) -> int:
    job = engine.stop(args.name, grace_s=args.timeout)
    if args.json:
        _emit_json(_status_dict(engine.status(job.name)))
    else:
        print(f"stopped {job.name}: {job.state}" + (f" ({job.message})" if job.message else ""))
    return 0


def cmd_rm(engine: Engine, args: argparse.Namespace) -> int:
    removed = engine.remove(args.name, force=args.force)
    if args.json:
        _emit_json({"job": args.name, "removed_checkpoints": removed})
    else:
        print(f"removed {args.name} and {len(removed)} checkpoint(s)")
    return 0


def store_report(settings: Settings) -> dict[str, Any]:
    """The state directory's store configuration, and the store variables of this environment that
    disagree with it (or, before it is written, the configuration they will write)."""
    home = settings.home
    report: dict[str, Any] = {"file": str(store_config.path_of(home))}
    try:
        current = store_config.load(home)
        report["written"] = current is not None
        if current is None:
            current = store_config.StoreConfig(**store_config.from_variables(settings.store_env, home))
        report["config"] = current.to_dict() | {"url": current.cold_url(home)}
        report["environment_disagrees"] = [
            d.to_dict() for d in store_config.disagreements(current, settings.store_env, home)
        ]
    except TorporError as exc:
        report.update(config=None, environment_disagrees=[], error=exc.message)
    return report


def doctor_report(settings: Settings) -> dict[str, Any]:
    """What works on this machine (:func:`torpor.core.doctor.report`), with the store configuration's."""
    return doctor.report(settings, store_report(settings))


def _store_lines(report: dict[str, Any]) -> list[str]:
    config = report["config"]
    if config is None:
        return [f"store configuration {report['file']}: {report['error']}"]
    where = "" if report["written"] else " (not written yet: the first command writes it from these)"
    key = config["key_file"] or "none (images stored unencrypted)"
    keep = f"the {config['keep_last']} newest" if config["keep_last"] else "all"
    lines = [
        f"store configuration {report['file']}{where}:",
        f"  cold tier  {config['url']}" + (f" at {config['s3_endpoint']}" if config["s3_endpoint"] else ""),
        f"  key file   {key}",
        f"  retention  {keep} checkpoints of each job, and the pinned ones",
    ]
    lines += [
        f"  refused: {d['variable']}={d['given']} differs; {d['fix']}"
        for d in report["environment_disagrees"]
    ]
    return lines


def cmd_doctor(settings: Settings, args: argparse.Namespace) -> int:
    report = doctor_report(settings)
    if args.json:
        _emit_json(report)
        return 0 if report["ok"] else 3
    criu = report["criu"]

    def mark(ok: object) -> str:
        return "ok " if ok else "-- "

    print(f"torpor {report['torpor']}, state in {report['home']}")
    if criu.get("version"):
        print(
            f"{mark(criu['check_ok'])} criu {criu['version']} at {criu['path']}: {criu['check'].splitlines()[-1] if criu['check'] else ''}"
        )
        print(
            f"{mark(criu['dirty_tracking'])} memory dirty tracking (pre-dump, incremental freeze): "
            f"{'yes' if criu['dirty_tracking'] else 'no (kernel lacks soft-dirty; full dumps only)'}"
        )
        print(f"{mark(criu['lazy_pages'])} userfaultfd lazy pages: {'yes' if criu['lazy_pages'] else 'no'}")
        print(
            f"{mark(criu['nftables_lock'])} nftables network lock (keeps TCP connections): "
            f"{'yes' if criu['nftables_lock'] else 'no'}"
        )
    else:
        print(f"--  criu: {criu.get('error')}")
    kernel = report["kernel"]
    print(
        f"ok  kernel {kernel['kernel']}; cgroups {kernel['cgroups']}; PSI {'yes' if kernel['psi'] else 'no'}; "
        f"userfaultfd {'yes' if kernel['userfaultfd'] else 'no'}"
    )
    driver = report["gpu_driver"]
    print(f"{mark(driver)} GPU driver: {driver or 'none'}; GPU checkpoint: {report['gpu_checkpoint']}")
    free = report.get("home_free_bytes")
    print(
        f"{mark(report['home_writable'])} state directory writable: {'yes' if report['home_writable'] else 'NO'}"
        + (f", {human_bytes(free)} free" if free is not None else "")
    )
    store = report["store"]
    store_ok = doctor.store_ok(store)
    for n, line in enumerate(_store_lines(store)):
        print(f"{mark(store_ok)} {line}" if n == 0 else f"    {line}")
    print(
        "torpor can checkpoint here"
        if report["ok"]
        else "torpor cannot checkpoint here: see the lines marked --"
    )
    return 0 if report["ok"] else 3


def cmd_store(settings: Settings, args: argparse.Namespace) -> int:
    if args.store_command == "set":
        return cmd_store_set(settings, args)
    report = store_report(settings)
    if args.json:
        _emit_json(report)
        return 0 if report["config"] is not None else 2
    print("\n".join(_store_lines(report)))
    return 0 if report["config"] is not None else 2


def cmd_store_set(settings: Settings, args: argparse.Namespace) -> int:
    home = settings.home
    given = {
        field: value
        for field, value in (
            ("url", args.url),
            ("s3_endpoint", args.s3_endpoint),
            ("key_file", args.key_file),
            ("keep_last", args.keep_last),
        )
        if value is not None
    }
    changes = store_config.parse_values(given, store_config.FLAGS, home)
    if args.no_key:
        changes["key_file"] = None
    if args.no_s3_endpoint:
        changes["s3_endpoint"] = None
    if not changes:
        raise UsageError("nothing to set: give --url, --s3-endpoint, --key-file, --no-key or --keep-last")
    # the environment's store variables only matter for a fresh state directory: this sets them
    engine = Engine(settings, check_store_env=False)
    before = engine.store_config
    after = engine.set_store(changes, force=args.force)
    if args.json:
        _emit_json(store_report(settings))
    elif after == before:
        print("store configuration unchanged")
    else:
        print("\n".join(_store_lines(store_report(settings))))
    return 0


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
    p.set_defaults(func=cmd_run)

    add("ps", "list jobs: name, state, pid, RSS, age, last checkpoint", job=False).set_defaults(func=cmd_ps)

    p = add("logs", "print a job's output (stdout and stderr)", json_flag=False)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new output while the job runs")
    p.add_argument("-n", "--tail", type=int, help="only the last N lines")
    p.set_defaults(func=cmd_logs)

    p = add("checkpoint", "checkpoint a running job; it keeps running")
    p.add_argument(
        "--wait", action="store_true", help="return once the checkpoint is durable (in the cold tier)"
    )
    p.set_defaults(func=cmd_checkpoint)
    p = add("hibernate", "checkpoint a running job, then stop it, freeing its memory")
    p.add_argument(
        "--wait", action="store_true", help="return once the checkpoint is durable (in the cold tier)"
    )
    p.set_defaults(func=cmd_hibernate)

    lazy_help = (
        "start the job before all of its memory is read; the command returns once all of it is in "
        "(exit 5 if a damaged chunk killed the job meanwhile)"
    )
    p = add("resume", "restore a job from its latest checkpoint")
    p.add_argument("--force", action="store_true", help="stop the job first if it is running")
    p.add_argument("--lazy", action="store_true", help=lazy_help)
    p.set_defaults(func=cmd_resume)

    p = add("restore", "restore a job from a given checkpoint (roll back)")
    p.add_argument(
        "--from", dest="from_", required=True, metavar="CHECKPOINT_ID", help="checkpoint id or prefix"
    )
    p.add_argument("--force", action="store_true", help="stop the job first if it is running")
    p.add_argument("--lazy", action="store_true", help=lazy_help)
    p.set_defaults(func=cmd_restore)

    p = add("checkpoints", "list checkpoints: time, size and freeze time of each", job=False)
    p.add_argument("name", nargs="?", help="only this job's")
    p.set_defaults(func=cmd_checkpoints)

    p = add("stop", "stop a running job (SIGTERM, then SIGKILL); its checkpoints are kept")
    p.add_argument("--timeout", type=float, help="seconds between SIGTERM and SIGKILL (default 5)")
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

    p = add("rm", "forget a job and delete its checkpoints")
    p.add_argument("--force", action="store_true", help="stop the job first if it is running")
    p.set_defaults(func=cmd_rm)

    add(
        "doctor",
        "what works on this machine: CRIU, dirty tracking, userfaultfd, cgroups, GPU; the store configuration",
        job=False,
    ).set_defaults(func=None)

    store_help = "show or change the store configuration of the state directory (HOME/store.json)"
    store = sub.add_parser(
        "store",
        help=store_help,
        description=store_help
        + ". Every torpor process working on this state directory (CLI, job launchers, destager) uses it; "
        "the first command wrote it from TORPOR_STORE, TORPOR_S3_ENDPOINT, TORPOR_KEY_FILE and "
        "TORPOR_KEEP_LAST, and a later command setting one of those to another value is refused.",
    )
    store_sub = store.add_subparsers(dest="store_command", metavar="SUBCOMMAND", required=True)
    show = store_sub.add_parser(
        "show", help="print the store configuration", description="print the store configuration"
    )
    show.add_argument("--json", action="store_true", help="print machine-readable JSON")
    show.set_defaults(func=None)
    set_help = (
        "change the store configuration; each new value is checked first, nothing changes if one is bad"
    )
    change = store_sub.add_parser(
        "set",
        help=set_help,
        description=set_help
        + ". A new cold tier or key is opened for real first (a new folder is created; the key must be the "
        "store's). Checkpoints already stored stay where they are: moving to another cold tier is refused "
        "while it lacks checkpoints the old one holds, unless --force (they are then out of reach until "
        "the store is set back). Images still only in RAM are stored into the new one. A running job's "
        "next checkpoint uses the new configuration.",
    )
    change.add_argument("--url", help="the cold tier: a folder, file:///PATH or s3://BUCKET[/PREFIX]")
    endpoint = change.add_mutually_exclusive_group()
    endpoint.add_argument(
        "--s3-endpoint", help="S3 endpoint URL for S3-compatible servers (http://HOST:PORT)"
    )
    endpoint.add_argument("--no-s3-endpoint", action="store_true", help="use AWS's own endpoints")
    key = change.add_mutually_exclusive_group()
    key.add_argument("--key-file", help="encrypt images with the 32-byte key in this file (new stores only)")
    key.add_argument("--no-key", action="store_true", help="store images unencrypted (new stores only)")
    change.add_argument("--keep-last", metavar="N", help="keep the N newest checkpoints per job (0: all)")
    change.add_argument(
        "--force", action="store_true", help="change the cold tier even if checkpoints stay behind"
    )
    change.add_argument("--json", action="store_true", help="print machine-readable JSON")
    change.set_defaults(func=None)
    slurm.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # everything torpor and CRIU create is private (images hold a job's memory); jobs keep the caller's
    caller_umask = os.umask(system.PRIVATE_UMASK)
    try:
        settings = replace(Settings.from_environment(home=args.home, criu=args.criu), job_umask=caller_umask)
        if args.command_name == "doctor":
            return cmd_doctor(settings, args)
        if args.command_name == "store":
            return cmd_store(settings, args)
        engine = Engine(settings)
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
