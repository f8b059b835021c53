"""The CLI's scheduler commands: ``torpor submit``, ``queue`` and ``quota``, and ``rm`` of a job still
queued.

They need the agent: the node's memory budget, what its jobs hold and the decisions are the agent's;
without it they say to start it. The agent's own commands are :mod:`torpor.apps.agent.commands`'s.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torpor.apps.agent.commands import AddParser, connected
from torpor.apps.render import emit_json, human_age, size_or_dash, table
from torpor.core.recordtypes import CheckpointId
from torpor.errors import EnvironmentProblem, UsageError
from torpor.policy.scheduler import format_size
from torpor.settings import Settings

if TYPE_CHECKING:
    from torpor.apps.agent.client import AgentClient
    from torpor.core.engine import Engine


def cmd_submit(settings: Settings, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("say what to run: torpor submit --memory 4G -- CMD ARGS...")
    with scheduler(settings) as client:
        submission = client.submit(
            command,
            memory=args.memory,
            cwd=os.getcwd(),
            env=dict(os.environ),  # the job runs as if started from here, as 'torpor run' does
            umask=settings.job_umask if settings.job_umask is not None else _current_umask(),
            name=args.name,
            cpus=args.cpus,
            priority=args.priority,
            project=args.project,
        )
    if args.json:
        from torpor.apps.agent.wire import submission_to_dict

        emit_json(submission_to_dict(submission))
    else:
        print(
            f"queued job '{submission.name}' ({format_size(submission.memory)}, priority "
            f"{submission.priority}, project {submission.project}): torpor queue shows it"
        )
    return 0


def cmd_queue(settings: Settings, args: argparse.Namespace) -> int:
    with scheduler(settings) as client:
        queue = client.queue()
    if args.json:
        emit_json(queue)
        return 0
    print(node_line(queue))
    rows = [
        [
            job["name"],
            str(job["state"]),
            size_or_dash(job.get("request")),
            "-" if job["state"] == "queued" else size_or_dash(job.get("usage")),  # nothing runs yet
            size_or_dash(job.get("limit")),
            _priority(job),
            str(job.get("project") or "-"),
            human_age(float(job.get("waited_s") or 0)),
            _why(job),
        ]
        for job in queue["jobs"]
    ]
    headers = ["NAME", "STATE", "REQUEST", "USAGE", "LIMIT", "PRIO", "PROJECT", "WAITED", "WHY"]
    print(table(headers, rows) if rows else "no submitted job (torpor submit --memory SIZE -- CMD)")
    return 0


def _current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def node_line(queue: dict[str, Any]) -> str:
    """The node's memory in one line: the budget, what the jobs hold, what is free, and the kernel's view."""
    line = (
        f"budget {format_size(queue['budget'])} (reserve {format_size(queue['reserve'])}): "
        f"held {format_size(queue['held'])}, free {format_size(queue['free'])}"
    )
    if queue.get("mem_available") is not None:
        line += f"; MemAvailable {format_size(queue['mem_available'])}"
    if queue.get("psi_full_avg10") is not None:
        line += f"; memory pressure (full, avg10) {float(queue['psi_full_avg10']):.2f}%"
    return line


def _priority(job: dict[str, Any]) -> str:
    """The priority asked for, and the one aging raised it to when they differ (``2 (3.5)``)."""
    asked = int(job["priority"])
    effective = job.get("effective_priority")
    if effective is None or abs(float(effective) - asked) < 0.05:
        return str(asked)
    return f"{asked} ({float(effective):.1f})"


def _why(job: dict[str, Any]) -> str:
    """Why it waits; for a job hibernated, first by what (``preempted; needs 800M, …``)."""
    said = [str(job[key]) for key in ("hibernated_by", "why") if job.get(key)]
    if job.get("state") != "hibernated":
        said = said[1:] if job.get("hibernated_by") else said
    return "; ".join(said) or "-"


def cmd_quota(settings: Settings, args: argparse.Namespace) -> int:
    with scheduler(settings) as client:
        if args.action == "set":
            borrow = 0 if args.no_borrow else args.borrow_limit
            quota = client.set_quota(args.project, args.share, borrow)
            if args.json:
                from torpor.apps.agent.wire import quota_to_dict

                emit_json(quota_to_dict(quota))
            else:
                print(f"project {quota.project}: {_quota_text(quota.share, quota.borrow_limit)}")
            return 0
        if args.action == "rm":
            client.remove_quota(args.project)
            if args.json:
                emit_json({"project": args.project, "removed": True})
            else:
                print(f"removed the quota of project {args.project}")
            return 0
        quotas = client.quotas()
    if args.json:
        emit_json(quotas)
        return 0
    projects = quotas["projects"]
    shares = sum(int(p["share"]) for p in projects)
    print(f"budget {format_size(quotas['budget'])}; shares {format_size(shares)}")
    rows = [
        [
            p["project"],
            format_size(int(p["share"])),
            _borrow_text(p.get("borrow_limit")),
            format_size(int(p.get("held") or 0)),
            format_size(int(p.get("borrowed") or 0)),
        ]
        for p in projects
    ]
    if rows:
        print(table(["PROJECT", "SHARE", "MAY BORROW", "HELD", "BORROWED"], rows))
    else:
        print("no quotas: every job draws on the whole budget (torpor quota set PROJECT --share SIZE)")
    return 0


def _borrow_text(limit: int | None) -> str:
    if limit is None:
        return "any"
    return "none" if limit == 0 else f"up to {format_size(limit)}"


def _quota_text(share: int, borrow_limit: int | None) -> str:
    borrow = {None: "may borrow what others leave unused", 0: "may not borrow"}.get(borrow_limit)
    return f"guaranteed {format_size(share)}, " + (
        borrow or f"may borrow up to {format_size(borrow_limit or 0)} more"
    )


def remove_or_cancel(engine: Engine, name: str, force: bool) -> list[CheckpointId] | None:
    """``torpor rm``: remove a job and its checkpoints (their ids), or cancel it (None) if it waits in
    the queue — through the agent when one runs, which cancels it in the scheduler."""
    through = getattr(engine, "remove_or_cancel", None)  # the RemoteEngine's
    if through is not None:
        result: list[CheckpointId] | None = through(name, force)
        return result
    submission = engine.records.submission(name)
    if submission is not None and submission.queued:
        engine.records.delete_submission(name)  # no agent runs: nobody can be starting it meanwhile
        return None
    return engine.remove(name, force=force)


@contextmanager
def scheduler(settings: Settings) -> Iterator[AgentClient]:
    """The agent's client; EnvironmentProblem when none runs: scheduling is the agent's."""
    with connected(settings) as client:
        if client is None:
            raise EnvironmentProblem(
                f"no agent runs for {settings.home}: the scheduler is the agent's; start it with "
                "'torpor agent' (e.g. 'torpor agent --memory-budget 16G')"
            )
        yield client


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser``'s errors one line, as torpor's own are; ``--help`` still shows the usage."""

    def error(message: str) -> Any:
        parser.exit(2, f"torpor: error: {parser.prog.removeprefix('torpor ')}: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def add_scheduling_parsers(sub: Any, add: AddParser) -> None:
    """``submit``, ``queue`` and ``quota`` (docs/scheduler.md)."""
    p = one_line_errors(
        add(
            "submit",
            "give a job to the agent's scheduler: it starts when its memory fits, else waits in the queue",
            job=False,
        )
    )
    p.add_argument("--name", help="job name (default: derived from the command)")
    p.add_argument(
        "--memory",
        required=True,
        metavar="SIZE",
        help="the memory it needs, e.g. 500M, 4G (binary units); what admission and quotas count",
    )
    p.add_argument(
        "--cpus", type=float, default=1.0, metavar="N", help="the cores it needs (recorded; default 1)"
    )
    p.add_argument(
        "--priority",
        type=int,
        default=0,
        metavar="P",
        help="0 or more (default 0): a job that does not fit hibernates running jobs of lower priority",
    )
    p.add_argument(
        "--project",
        default="default",
        metavar="X",
        help="the project whose quota it draws on (default 'default'; must have a quota once any exists)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.epilog = (
        "The job starts in this shell's environment, working directory and umask. Needs a running "
        "'torpor agent'."
    )
    p.set_defaults(func=cmd_submit, needs_settings=True)

    p = one_line_errors(
        add(
            "queue",
            "the node's memory budget, what is held and free, and every submitted job with why it waits",
            job=False,
        )
    )
    p.set_defaults(func=cmd_queue, needs_settings=True)

    p = one_line_errors(
        sub.add_parser(
            "quota",
            help="show or set the projects' guaranteed shares of the memory budget",
            description="show or set the projects' guaranteed shares of the memory budget; a project may "
            "borrow what others leave unused, and borrowed work is hibernated first when an owner needs "
            "its share back",
        )
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("show", "every project's share, borrowing limit, and what it holds and borrows now"),
        ("set", "give a project a guaranteed share (shares beyond the budget are refused)"),
        ("rm", "drop a project's quota"),
    ):
        q = one_line_errors(actions.add_parser(action, help=text, description=text))
        if action != "show":
            q.add_argument("project", help="project name")
        if action == "set":
            q.add_argument("--share", required=True, metavar="SIZE", help="its guaranteed memory, e.g. 8G")
            borrow = q.add_mutually_exclusive_group()
            borrow.add_argument(
                "--borrow-limit",
                metavar="SIZE",
                help="how much more than its share it may borrow (default: any that others leave unused)",
            )
            borrow.add_argument(
                "--no-borrow", action="store_true", help="it may not borrow: it gets its share, no more"
            )
        q.add_argument("--json", action="store_true", help="print machine-readable JSON")
        q.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_quota, needs_settings=True)
