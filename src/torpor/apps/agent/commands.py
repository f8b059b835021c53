"""The CLI's agent commands: ``torpor agent``, ``policy``, ``events``, ``drain``, and ``run``'s policy flags;
and the scheduler's: ``submit``, ``queue``, ``quota``.

Each of the first works whether an agent runs or not: through the agent when one answers on the state
directory's socket, embedded otherwise (a policy is written to the records, where the next agent finds
it; a drain is carried out by this process). The scheduler's need the agent: the node's memory budget,
what its jobs hold and the decisions are the agent's; without it they say to start it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torpor.apps.agent import care
from torpor.apps.agent.locate import answers, socket_path
from torpor.apps.agent.wire import event_to_dict
from torpor.apps.render import emit_json, human_age, human_bytes, progress, size_or_dash, table
from torpor.core.records import CheckpointId, Event, Records
from torpor.errors import EnvironmentProblem, UsageError
from torpor.policy.jobpolicy import JobPolicy, parse_duration
from torpor.policy.scheduler import format_size, parse_size
from torpor.settings import Settings

if TYPE_CHECKING:
    from torpor.apps.agent.client import AgentClient
    from torpor.apps.agent.service import Agent
    from torpor.core.engine import Engine

AddParser = Callable[..., argparse.ArgumentParser]


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    """A duration (``30s``, ``2m``) or, as these flags always took, a bare number of seconds (``0.5``)."""
    try:
        value = float(text)
    except ValueError:
        return duration(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is negative")
    return value


def optional_duration(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else duration(text)


def share(text: str) -> float:
    value = text.strip().rstrip("%")
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a share: write e.g. 2% or 0.02") from None
    return number / 100 if text.strip().endswith("%") or number >= 1 else number


def size(text: str) -> int:
    """A memory size as users write it (``500M``, ``4G``)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT (e.g. 127.0.0.1:7788)")
    return host.strip("[]"), int(port)


def add_policy_flags(p: argparse.ArgumentParser, for_run: bool) -> None:
    """The policy's flags; a flag not given is absent from the namespace (so it changes nothing)."""
    off = "" if for_run else " ('off' removes it)"
    kind = duration if for_run else optional_duration
    flags = p.add_argument_group("what the agent does for the job by itself (docs/agent.md)")
    for flag, options in (
        (
            "--checkpoint-every",
            {"type": kind, "metavar": "DURATION", "help": f"checkpoint the job this often, e.g. 10m{off}"},
        ),
        (
            "--budget",
            {
                "type": share,
                "metavar": "SHARE",
                "help": "the share of its time checkpoints may freeze it (default 2%%)",
            },
        ),
        (
            "--keep",
            {
                "type": int,
                "metavar": "N",
                "help": "keep its newest N checkpoints (default: the store's keep_last)",
            },
        ),
        (
            "--idle-after",
            {"type": kind, "metavar": "DURATION", "help": f"hibernate it once it used no CPU this long{off}"},
        ),
        (
            "--wake-on",
            {
                "type": int,
                "action": "append",
                "metavar": "PORT",
                "help": "while it sleeps, a connection to this TCP port resumes it (repeatable)",
            },
        ),
        ("--no-wake-on", {"action": "store_true", "help": "listen on no port for it any more"}),
        ("--priority", {"type": int, "help": "higher is saved first when the node is evacuated (default 0)"}),
    ):
        if flag != "--no-wake-on" or not for_run:
            flags.add_argument(flag, default=argparse.SUPPRESS, **options)


_FIELDS = {
    "checkpoint_every": "checkpoint_every_s",
    "idle_after": "idle_after_s",
    "budget": "budget",
    "keep": "keep",
    "priority": "priority",
    "wake_on": "wake_on",
}


def policy_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The policy fields the flags set (a field the user did not name is not in it; 'off' is None)."""
    changes = {field: getattr(args, flag) for flag, field in _FIELDS.items() if hasattr(args, flag)}
    if getattr(args, "no_wake_on", False):
        changes["wake_on"] = []
    return changes


def policy_for_run(args: argparse.Namespace) -> JobPolicy | None:
    """The policy ``torpor run``'s flags ask for, checked before the job starts; None when none."""
    changes = policy_changes(args)
    return care.new_policy(changes) if changes else None


# -- commands ---------------------------------------------------------------------------------------------


def cmd_agent(settings: Settings, args: argparse.Namespace) -> int:
    from torpor.apps.agent.scheduling import SchedulerOptions
    from torpor.apps.agent.serve import Listen, serve
    from torpor.apps.agent.service import AgentOptions

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s torpor-agent %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    options = AgentOptions(
        round_s=args.round,
        parallel=args.parallel,
        stop_deadline_s=args.stop_deadline,
        on_sigterm=args.on_sigterm,
        notice_url=args.notice_url,
        notice_format=args.notice_format,
        notice_interval_s=args.notice_interval,
        scheduling=SchedulerOptions(budget=args.memory_budget, reserve=args.memory_reserve),
    )
    listen = None
    if args.listen:
        if not args.token_file:
            raise UsageError(
                "--listen needs --token-file: the API on TCP takes only requests with that token"
            )
        listen = Listen(args.listen[0], args.listen[1], args.token_file)
    return serve(settings, options, listen)


def cmd_policy(settings: Settings, args: argparse.Namespace) -> int:
    records = Records(settings.db_path)
    with connected(settings) as client:
        if args.action == "set":
            changes = policy_changes(args)
            if not changes:
                raise UsageError("say what to set: e.g. torpor policy set NAME --checkpoint-every 10m")
            policy = (
                client.set_policy(args.name, changes)
                if client
                else care.set_policy(records, args.name, changes)
            )
        else:
            policy = client.policy(args.name) if client else records.care(records.job(args.name).name).policy
    if args.json:
        emit_json(policy.to_dict())
        return 0
    print(f"{args.name}: {policy.describe()}")
    if args.action == "set" and client is None:
        print("  (no agent runs for this state directory: 'torpor agent' applies it)", file=sys.stderr)
    return 0


def _event_line(event: Event) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at))
    detail = event.detail
    costs = []
    if "freeze_s" in detail:
        costs.append(f"froze {float(str(detail['freeze_s'])):.3f} s")
    if "size_bytes" in detail:
        costs.append(f"image {human_bytes(int(str(detail['size_bytes'])))}")
    if "freed_bytes" in detail:
        costs.append(f"freed {human_bytes(int(str(detail['freed_bytes'])))}")
    if "restore_s" in detail:
        costs.append(f"restored in {float(str(detail['restore_s'])):.2f} s")
    if "durable_s" in detail:
        costs.append(f"durable {float(str(detail['durable_s'])):.2f} s after the dump")
    if "overhead" in detail:
        costs.append(f"overhead {float(str(detail['overhead'])):.2%}")
    if "error" in detail:
        costs.append(f"FAILED: {detail['error']}")
    tail = f" ({', '.join(costs)})" if costs else ""
    return f"{when}  {event.job or '-':<16} {event.action:<11} {event.reason}{tail}"


def cmd_events(settings: Settings, args: argparse.Namespace) -> int:
    records = Records(settings.db_path)
    if args.job:
        records.job(args.job)  # an unknown job is an error, not an empty list
    shown = records.events(0, args.job, args.tail)
    if args.json and not args.follow:
        emit_json([event_to_dict(e) for e in shown])
        return 0
    last = 0
    while True:
        for event in shown:
            print(_json_line(event) if args.json else _event_line(event), flush=True)
            last = event.id
        if not args.follow:
            return 0
        time.sleep(0.5)
        shown = records.events(last, args.job)


def _json_line(event: Event) -> str:
    return json.dumps(event_to_dict(event), default=str)


def cmd_drain(settings: Settings, args: argparse.Namespace) -> int:
    show = progress(args)
    with connected(settings) as client:
        if args.cancel:
            resumed = client.undrain() if client else _embedded(settings, lambda agent: agent.undrain())
            if args.json:
                emit_json({"resumed": resumed})
            else:
                print("the node takes jobs again" + (f"; resuming {', '.join(resumed)}" if resumed else ""))
            return 0
        if client is not None:
            report = client.drain(args.why, args.deadline, progress=show)
        else:
            show("no agent runs: evacuating from here")
            report = _embedded(
                settings, lambda agent: agent.evacuate(args.why, "drain", args.deadline).to_dict()
            )
    if args.json:
        emit_json(report)
    else:
        print_report(report)
    return 0 if not report["failed"] and not report["pending"] else 4


def _embedded(settings: Settings, work: Callable[[Agent], Any]) -> Any:
    from torpor.apps.agent.service import Agent

    agent = Agent(settings)
    try:
        return work(agent)
    finally:
        agent.close(finish=True)  # the resumes a cancelled drain queued are this command's to finish


def print_report(report: dict[str, Any]) -> None:
    took = (report["finished_at"] or time.time()) - report["started_at"]
    print(
        f"evacuation ({report['by']}: {report['why']}) in {took:.1f} s; the node takes no new job ('torpor drain --cancel' ends that)"
    )
    rows = []
    for name in report["order"]:
        if name in report["saved"]:
            saved = report["saved"][name]
            rows.append([name, "durable", saved["checkpoint"], f"{saved['durable_s']:.1f} s"])
        elif name in report["failed"]:
            rows.append([name, "FAILED", report["failed"][name], "-"])
        else:
            rows.append([name, "not durable by the deadline", "-", "-"])
    print(table(["JOB", "SAVED", "CHECKPOINT", "DURABLE AFTER"], rows) if rows else "no job to save")


# -- the scheduler's: submit, queue, quota ----------------------------------------------------------------


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


# -- parsers ----------------------------------------------------------------------------------------------


def add_parsers(sub: Any, add: AddParser) -> None:
    p = add(
        "agent",
        "run the node agent in the foreground (docs/agent.md); logs on stderr",
        job=False,
        json_flag=False,
    )
    p.add_argument(
        "--listen", type=address, metavar="HOST:PORT", help="serve the API on TCP too (needs --token-file)"
    )
    p.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="the bearer token TCP requests must bring (a 0600 file)",
    )
    p.add_argument(
        "--round", type=duration, default=1.0, metavar="DURATION", help="time between two rounds (default 1s)"
    )
    p.add_argument(
        "--parallel", type=int, default=4, metavar="N", help="jobs an evacuation saves at once (default 4)"
    )
    p.add_argument(
        "--stop-deadline",
        type=duration,
        default=90.0,
        metavar="DURATION",
        help="how long the evacuation at SIGTERM may take (default 90s)",
    )
    p.add_argument(
        "--on-sigterm",
        choices=("auto", "hibernate", "leave"),
        default="auto",
        help="at SIGTERM, hibernate every job and resume them at the next start ('hibernate'), leave them "
        "running ('leave'), or hibernate only when the machine shuts down ('auto', the default: when systemd "
        "says it stops, or where no systemd runs it)",
    )
    p.add_argument(
        "--notice-url",
        metavar="URL",
        help="poll this metadata URL for spot and maintenance notices (AWS or GCP)",
    )
    p.add_argument(
        "--notice-format",
        choices=("auto", "aws", "gcp"),
        default="auto",
        help="the notice URL's format (default: from the URL)",
    )
    p.add_argument(
        "--notice-interval",
        type=duration,
        default=5.0,
        metavar="DURATION",
        help="how often to poll it (default 5s)",
    )
    p.add_argument(
        "--memory-budget",
        type=size,
        metavar="SIZE",
        help="the memory the scheduler hands out to submitted jobs (e.g. 16G; default: the machine's "
        "memory less the reserve)",
    )
    p.add_argument(
        "--memory-reserve",
        type=size,
        metavar="SIZE",
        help="the memory the budget leaves to the machine (default: a tenth of it, at least 3G)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    p.set_defaults(func=cmd_agent, needs_settings=True)

    p = sub.add_parser(
        "policy",
        help="show or set what the agent does for a job by itself",
        description="show or set what the agent does for a job by itself",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("show", "show a job's policy"),
        ("set", "change a job's policy; an impossible one is refused"),
    ):
        q = actions.add_parser(action, help=text, description=text)
        q.add_argument("name", help="job name")
        q.add_argument("--json", action="store_true", help="print machine-readable JSON")
        q.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
        if action == "set":
            add_policy_flags(q, for_run=False)
    p.set_defaults(func=cmd_policy, needs_settings=True)

    p = add("events", "what torpor did by itself, with why and at what cost", job=False)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    p.add_argument("--job", help="only this job's")
    p.add_argument("-n", "--tail", type=int, metavar="N", help="only the last N")
    p.set_defaults(func=cmd_events, needs_settings=True)

    p = add(
        "drain",
        "evacuate the node: hibernate every job into the durable tier, most valuable first",
        job=False,
    )
    p.add_argument("--deadline", type=duration, metavar="DURATION", help="report by then (default 10m)")
    p.add_argument("--why", default="torpor drain", help="the reason, shown in the events")
    p.add_argument(
        "--cancel", action="store_true", help="take new jobs again and resume what the drain hibernated"
    )
    p.set_defaults(func=cmd_drain, needs_settings=True)


@contextmanager
def connected(settings: Settings) -> Iterator[AgentClient | None]:
    """A client of the state directory's agent, or None when none runs (httpx imported only then)."""
    uds = socket_path(settings)
    if not answers(uds):
        yield None
        return
    from torpor.apps.agent.client import AgentClient

    client = AgentClient.if_running(uds)
    try:
        yield client
    finally:
        if client is not None:
            client.close()
