"""The CLI's templates and warm starts: ``torpor template save|ls|rm``, ``torpor run --from-template``,
``torpor run --warm-start --ready-when``, and ``torpor whoami`` (which job am I, was I restored?).

Parse, call :class:`torpor.core.cloning.Cloner`, render. Where a start comes from is decided here only
as far as the user asked; whether a template is stale is the cloner's (policy.warmstart).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from torpor.adapters.system import procfs
from torpor.apps.render import emit_json, human_age, human_bytes, progress, table
from torpor.core.cloning import Cloner, Started
from torpor.core.engine import Engine
from torpor.core.readiness import read_ready_when
from torpor.core.recordtypes import LIVE_STATES, Job, JobName, Origin, Template
from torpor.core.templates import Templates
from torpor.errors import RestoreFailed, UsageError
from torpor.policy.warmstart import warm_template_name

# -- torpor run --from-template / --warm-start ------------------------------------------------------------


def wants_template(args: argparse.Namespace) -> bool:
    return bool(args.from_template or args.warm_start)


def check_run_flags(args: argparse.Namespace, command: list[str]) -> None:
    """The template flags of ``torpor run`` that do not go together, refused before anything starts."""
    if args.from_template and command:
        raise UsageError("--from-template starts the template's own command: give no COMMAND after it")
    if args.from_template and args.warm_start:
        raise UsageError("--from-template and --warm-start do not go together: pick one")
    if args.warm_start and not args.ready_when:
        raise UsageError(
            "--warm-start needs --ready-when port:N|log:REGEX|idle:D (when the job is ready to be saved)"
        )
    if args.ready_when and not args.warm_start:
        raise UsageError("--ready-when goes with --warm-start")
    if args.ready_when:
        read_ready_when(args.ready_when)
    if not wants_template(args) and (args.lazy or args.own_network):
        raise UsageError("--lazy and --own-network go with --from-template or --warm-start")


def run_with_template(engine: Engine, args: argparse.Namespace, command: list[str]) -> tuple[Job, str]:
    """``torpor run`` with ``--from-template`` or ``--warm-start``: the job, and a line saying where it
    came from (a template, or a cold start and why).

    A template that is stale, or that this machine's CRIU or kernel cannot restore, starts its command
    cold instead; a warm-start one is saved again once that job is ready. A refusal (a taken port) is
    not a reason to start cold: it is the user's to settle, and stands.
    """
    cloner = Cloner(engine)
    if args.from_template:
        template = cloner.templates.get(args.from_template)
        job, why = _start_or_say_why(cloner, template, args)
        if job is not None:
            return job, why
        job = engine.run(
            args.name, template.command, template.cwd, warm=_resave(template), ready_when=template.ready_when
        )
        if template.ready_when:
            return job, f"cold: template '{template.name}' {why}; a new one is saved once it is ready"
        return job, f"cold: template '{template.name}' {why}; save a new one with 'torpor template save'"
    ready_when = str(read_ready_when(args.ready_when))
    if not command:
        raise UsageError("no command given: torpor run --warm-start --ready-when SPEC -- COMMAND [ARGS...]")
    cwd = os.getcwd()
    name = warm_template_name(command, dict(os.environ), cwd)
    saved = cloner.templates.find(name)
    if saved is None:
        reason = f"cold: its warm-start template '{name}' is saved once it is ready ({ready_when})"
    else:
        job, why = _start_or_say_why(cloner, saved, args, warm=name, ready_when=ready_when)
        if job is not None:
            return job, why
        reason = f"cold: its warm-start template {why}; a new one is saved once it is ready"
    return engine.run(args.name, command, cwd, warm=name, ready_when=ready_when), reason


def _start_or_say_why(
    cloner: Cloner, template: Template, args: argparse.Namespace, **warm: str
) -> tuple[Job | None, str]:
    """A job started from ``template`` and where it came from; or None and why it cannot be (stale, or
    its restore failed here), in words that follow the template's name."""
    why = cloner.stale(template)
    if why is not None:
        return None, f"is stale ({why})"
    try:
        started = cloner.start(
            template,
            args.name,
            lazy=args.lazy,
            own_network=args.own_network,
            progress=progress(args),
            **warm,
        )
    except RestoreFailed as exc:
        for line in exc.details:
            print(f"  {line}", file=sys.stderr)
        return None, f"could not be restored here ({exc.message})"
    return _from(started)


def origins(engine: Engine) -> dict[JobName, Origin]:
    return Templates(engine.records).origins()


def origin_fields(origin: Origin | None) -> dict[str, Any]:
    """What ``torpor ps --json`` says of a job's origin: its template, warm start and address."""
    return {
        "template": origin.template if origin else None,
        "warm_start": origin.warm if origin else None,
        "address": origin.address if origin else None,
    }


def _from(started: Started) -> tuple[Job, str]:
    return started.job, f"from template '{started.template.name}' in {started.seconds:.2f} s"


def _resave(template: Template) -> str | None:
    """The template a cold start of a stale ``template`` saves once ready: itself, if it was a warm one."""
    return template.name if template.ready_when else None


# -- torpor template save|ls|rm ---------------------------------------------------------------------------


def template_dict(template: Template, users: Sequence[str]) -> dict[str, Any]:
    return {
        "name": template.name,
        "checkpoint": template.checkpoint,
        "source_job": template.source_job,
        "created_at": template.created_at,
        "size_bytes": template.size_bytes,
        "freeze_s": template.freeze_s,
        "criu_version": template.criu_version,
        "command": template.command,
        "cwd": template.cwd,
        "listens": [list(address) for address in template.listens],
        "files": len(template.files),
        "ready_when": template.ready_when,
        "own_network": template.own_network,
        "jobs": users,
    }


def cmd_template(engine: Engine, args: argparse.Namespace) -> int:
    cloner = Cloner(engine)
    if args.template_command == "save":
        template = cloner.save(args.template, args.job, progress=progress(args), warn=_warning)
        if args.json:
            emit_json(template_dict(template, []))
        else:
            print(
                f"saved template '{template.name}' from job '{template.source_job}': checkpoint "
                f"{template.checkpoint}, frozen {template.freeze_s:.3f} s, image {human_bytes(template.size_bytes)}; "
                f"start it with: torpor run --from-template {template.name}"
            )
        return 0
    if args.template_command == "rm":
        template = cloner.remove(args.template)
        if args.json:
            emit_json({"removed": template.name, "checkpoint": template.checkpoint})
        else:
            print(f"removed template '{template.name}' (checkpoint {template.checkpoint})")
        return 0
    templates = Templates(engine.records)
    found = templates.all()
    users = {t.name: templates.users(t.name) for t in found}
    memory = {t.name: _memory_of(engine, users[t.name]) for t in found}
    if args.json:
        emit_json([{**template_dict(t, users[t.name]), "jobs_memory_bytes": memory[t.name]} for t in found])
        return 0
    now = time.time()
    rows = [
        [
            t.name,
            t.source_job,
            human_bytes(t.size_bytes),
            human_age(now - t.created_at) + " ago",
            ",".join(str(port) for _, port in t.listens) or "-",
            t.ready_when or "-",
            str(len(users[t.name])),
            human_bytes(memory[t.name]) if users[t.name] else "-",
            " ".join(t.command)[:60],
        ]
        for t in found
    ]
    headers = ["NAME", "FROM JOB", "SIZE", "SAVED", "PORTS", "READY WHEN", "JOBS", "JOBS' MEMORY", "COMMAND"]
    print(table(headers, rows) if rows else "no templates")
    return 0


def _memory_of(engine: Engine, jobs: Sequence[str]) -> int:
    """What the running ones of ``jobs`` hold in memory together (the sum of their PSS, as ``ps``)."""
    return sum(engine.status(name).rss_bytes or 0 for name in jobs)


def _warning(text: str) -> None:
    print(f"torpor: warning: {text}", file=sys.stderr)


# -- torpor whoami ----------------------------------------------------------------------------------------


def cmd_whoami(engine: Engine, args: argparse.Namespace) -> int:
    """The job the calling process belongs to: the one whose PID namespace it runs in."""
    job = _my_job(engine)
    if job is None:
        raise UsageError("this process is not in a torpor job (of this state directory)")
    origin = Templates(engine.records).origin(job.name)
    if args.json:
        emit_json(
            {
                "job": job.name,
                "restored": job.restored_from is not None,
                "restored_from": job.restored_from,
                "template": origin.template if origin else None,
                "started_at": job.started_at,
                "address": origin.address if origin else None,
            }
        )
        return 0
    line = f"job '{job.name}'"
    if origin is not None and origin.template:
        line += f", started from template '{origin.template}'"
    if job.restored_from:
        line += f", restored from checkpoint {job.restored_from}"
    print(line)
    return 0


def _my_job(engine: Engine) -> Job | None:
    if not procfs.in_own_pid_namespace():
        return None  # jobs run in PID namespaces of their own
    mine = procfs.own_pid_namespace()
    deadline = time.monotonic() + 2  # a job asking as it starts: its launcher records its pid just after
    while True:
        for job in engine.records.jobs():
            if job.state in LIVE_STATES and job.pid and procfs.pid_namespace(job.pid) == mine:
                return job
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


# -- the parser -------------------------------------------------------------------------------------------


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """``torpor run``'s template flags."""
    p.add_argument(
        "--from-template",
        metavar="TEMPLATE",
        help="start a new job where template TEMPLATE was (its own name, log and PID namespace); no COMMAND",
    )
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="start COMMAND from its template if there is one, else cold, saving the template once ready",
    )
    p.add_argument(
        "--ready-when",
        metavar="SPEC",
        help="with --warm-start: when the job is ready to be saved: port:N (accepts a connection), "
        "log:REGEX (a line of its output matches), idle:D (its CPU falls idle for D)",
    )
    p.add_argument(
        "--lazy",
        action="store_true",
        help="from a template: start before all of its memory is read (it comes in as the job runs)",
    )
    p.add_argument(
        "--own-network",
        action="store_true",
        help="from a template: a network of its own (an address on torpor's bridge, shown by 'torpor ps'), "
        "so that copies of a server can listen on the same port",
    )


def add_parsers(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """``torpor template`` and ``torpor whoami``."""
    template_help = "templates: checkpoints of running jobs kept as start points for new jobs"
    template = sub.add_parser(
        "template",
        help=template_help,
        description=template_help
        + ". A template is never removed by retention nor by 'torpor rm' of its job; a job started from it "
        "('torpor run --from-template NAME') continues its memory: the same random-number state, start "
        "time and open files (docs/warmstart.md).",
    )
    template_sub = template.add_subparsers(dest="template_command", metavar="SUBCOMMAND", required=True)
    save_help = "checkpoint a running job (it runs on) and keep it as template NAME"
    save = template_sub.add_parser("save", help=save_help, description=save_help)
    save.add_argument("template", metavar="NAME", help="the template's name")
    save.add_argument("job", metavar="JOB", help="the running job")
    ls_help = "list the templates: source job, size, age, ports, the jobs started from each"
    listing = template_sub.add_parser("ls", help=ls_help, description=ls_help)
    rm_help = "forget a template and delete its image (jobs started from it are not touched)"
    remove = template_sub.add_parser("rm", help=rm_help, description=rm_help)
    remove.add_argument("template", metavar="NAME", help="the template's name")
    for p in (save, listing, remove):
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    template.set_defaults(func=cmd_template)

    whoami_help = (
        "from inside a job: which job this is, and whether (and from what) it was restored; a job started "
        "from a template has the template's environment, so this, not $VARIABLES, tells who it is"
    )
    add("whoami", whoami_help, job=False).set_defaults(func=cmd_whoami)
