"""The CLI's agent commands: ``torpor agent``, ``policy``, ``events``, ``drain``, and ``run``'s policy flags
(with the flag types they share with the scheduler's commands, :mod:`torpor.apps.agent.scheduler_commands`).

Each works whether an agent runs or not: through the agent when one answers on the state directory's
socket (:func:`connected`), embedded otherwise (a policy is written to the records, where the next agent
finds it; a drain is carried out by this process).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torpor.apps.agent import care
from torpor.apps.agent.locate import answers, socket_path
from torpor.apps.agent.wire import event_to_dict
from torpor.apps.render import emit_json, human_bytes, progress, table
from torpor.core.records import Records
from torpor.core.recordtypes import Event
from torpor.errors import UsageError
from torpor.policy import peers as peers_policy
from torpor.policy.jobpolicy import JobPolicy, parse_duration
from torpor.policy.scheduler import parse_size
from torpor.settings import Settings

if TYPE_CHECKING:
    from torpor.apps.agent.client import AgentClient
    from torpor.apps.agent.serve import Listen
    from torpor.apps.agent.service import Agent


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
    from torpor.apps.agent.serve import serve
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
        evacuate_to_peers=args.evacuate_to_peers,
        scheduling=SchedulerOptions(budget=args.memory_budget, reserve=args.memory_reserve),
    )
    return serve(settings, options, listen_of(args))


def listen_of(args: argparse.Namespace) -> Listen | None:
    """Where ``torpor agent``'s flags ask the API to be served on TCP, refused as a whole when it cannot."""
    from torpor.apps.agent.serve import Listen

    if not args.listen:
        if args.token_file or args.tls_cert or args.tls_key:
            raise UsageError("--token-file, --tls-cert and --tls-key go with --listen HOST:PORT")
        return None
    host, port = args.listen
    if not args.token_file:
        raise UsageError("--listen needs --token-file: the API on TCP takes only requests with that token")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together: the certificate and its private key")
    problem = peers_policy.listen_problem(host, port, tls=bool(args.tls_cert))
    if problem:
        raise UsageError(problem)
    return Listen(host, port, args.token_file, args.tls_cert, args.tls_key)


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
    if "precopied_bytes" in detail:
        costs.append(f"pre-copied {human_bytes(int(str(detail['precopied_bytes'])))} first")
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
            report = client.drain(args.why, args.deadline, args.to_peers, progress=show)
        else:
            show("no agent runs: evacuating from here")
            report = _embedded(
                settings,
                lambda agent: agent.evacuate(
                    args.why, "drain", args.deadline, to_peers=args.to_peers
                ).to_dict(),
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
        saved = report["saved"].get(name)
        if saved and saved.get("moved_to"):
            rows.append([name, f"moved to {saved['moved_to']}", "-", f"stopped {saved['stopped_s']:.2f} s"])
        elif saved:
            rows.append([name, "durable", saved["checkpoint"], f"{saved['durable_s']:.1f} s"])
        elif name in report["failed"]:
            rows.append([name, "FAILED", report["failed"][name], "-"])
        else:
            rows.append([name, "not durable by the deadline", "-", "-"])
    print(table(["JOB", "SAVED", "CHECKPOINT", "DURABLE AFTER"], rows) if rows else "no job to save")
    for name, why in (report.get("stayed") or {}).items():
        print(f"{name} stayed here: {why}")


# -- parsers ----------------------------------------------------------------------------------------------


def add_parsers(sub: Any, add: AddParser) -> None:
    p = add(
        "agent",
        "run the node agent in the foreground (docs/agent.md); logs on stderr",
        job=False,
        json_flag=False,
    )
    p.add_argument(
        "--listen",
        type=address,
        metavar="HOST:PORT",
        help="serve the API on TCP too (needs --token-file; any address but loopback needs --tls-cert/--tls-key)",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="the bearer token TCP requests must bring: a regular 0600 file of yours (not a link, nor <(...))",
    )
    p.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="serve --listen with TLS: this PEM certificate (its chain after it); peers trust it or its CA",
    )
    p.add_argument(
        "--tls-key",
        type=Path,
        metavar="FILE",
        help="the certificate's private key (PEM, a 0600 file of yours)",
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
        "--evacuate-to-peers",
        action="store_true",
        help="a spot or maintenance notice moves each job to a peer that has room first (as 'torpor drain "
        "--to-peers'), and hibernates the rest",
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
        "evacuate the node: hibernate every job into the durable tier (or move it to a peer, "
        "--to-peers), most valuable first",
        job=False,
    )
    p.add_argument(
        "--to-peers",
        action="store_true",
        help="move each job to a peer that has room ('torpor peers'), as 'torpor migrate' does; hibernate "
        "here only those no peer takes",
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
