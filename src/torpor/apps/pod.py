"""``torpor pod -- CMD`` (the in-pod supervisor) and ``torpor webhook`` (the admission webhook that puts
opted-in pods under it). docs/kubernetes.md says how they are deployed."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from torpor.adapters import kubeapi
from torpor.apps import kubeoperator, webhook
from torpor.core import pod
from torpor.errors import TorporError, UsageError
from torpor.policy.jobpolicy import parse_duration
from torpor.settings import Settings


def _flag(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_parsers(sub: Any, add: Any) -> None:
    env = os.environ
    p = sub.add_parser(
        "pod",
        help="run COMMAND as a pod's job: hibernated on SIGTERM, continued by the next pod of its identity",
        description=(
            "The in-pod supervisor that the admission webhook puts before an opted-in container's "
            "command. It starts COMMAND as a torpor job, or continues the identity's job (resumes it if "
            "it was hibernated, restores its latest checkpoint if its pod went away), copies the job's "
            "output to stdout, hibernates it into the store on SIGTERM and exits 0; a job that exits by "
            "itself ends the identity, and the pod exits with its code. Flags default to the environment "
            "the webhook sets."
        ),
    )
    p.add_argument(
        "--store",
        default=env.get("TORPOR_POD_STORE"),
        help="folder every node sees, holding each identity's state (default: $TORPOR_POD_STORE)",
    )
    p.add_argument(
        "--identity",
        default=env.get("TORPOR_IDENTITY"),
        help="NAMESPACE/NAME[/...]: which pods continue each other's job (default: $TORPOR_IDENTITY)",
    )
    p.add_argument("--job", default="main", help="the job's name within the identity (default: main)")
    p.add_argument(
        "--interchangeable",
        action="store_true",
        default=_flag(env.get("TORPOR_INTERCHANGEABLE")),
        help="pods of this identity run at once (replicas): each takes a free slot ($TORPOR_INTERCHANGEABLE)",
    )
    every = env.get("TORPOR_CHECKPOINT_EVERY")
    p.add_argument(
        "--checkpoint-every",
        type=_duration,
        default=None,
        metavar="DURATION",
        help="checkpoint the job this often, e.g. 5m ($TORPOR_CHECKPOINT_EVERY)",
    )
    p.add_argument(
        "--lazy",
        action="store_true",
        default=_flag(env.get("TORPOR_LAZY_RESTORE")),
        help="restore lazily: the job runs before all of its memory is read ($TORPOR_LAZY_RESTORE)",
    )
    p.add_argument(
        "--s3",
        default=env.get("TORPOR_POD_S3"),
        metavar="s3://BUCKET[/PREFIX]",
        help="keep the checkpoint images in S3, each slot under PREFIX/NAMESPACE/NAME/slot-N ($TORPOR_POD_S3)",
    )
    p.add_argument(
        "--s3-key-file",
        default=env.get("TORPOR_POD_S3_KEY"),
        metavar="FILE",
        help="encrypt them with the 32-byte key in FILE, if it exists ($TORPOR_POD_S3_KEY)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=cmd_pod, needs_settings=True, every_env=every)
    webhook.add_parser(sub)
    kubeoperator.add_parser(sub)


def cmd_pod(settings: Settings, args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given: torpor pod -- COMMAND [ARGS...]")
    if not args.store:
        raise UsageError("no store: give --store or set TORPOR_POD_STORE")
    if not args.identity:
        raise UsageError("no identity: give --identity or set TORPOR_IDENTITY")
    every = args.checkpoint_every
    if every is None and args.every_env:
        try:
            every = parse_duration(args.every_env)
        except ValueError as exc:
            raise UsageError(f"TORPOR_CHECKPOINT_EVERY: {exc}") from exc
    spec = pod.PodSpec(
        Path(args.store),
        args.identity,
        command,
        job=args.job,
        interchangeable=args.interchangeable,
        every_s=every,
        lazy=args.lazy,
        pod=pod.PodInfo.from_environment(),
        s3_base=args.s3 or None,
        s3_key_file=Path(args.s3_key_file) if args.s3_key_file else None,
        job_env=_take_s3_credentials(),
    )
    supervisor = pod.Supervisor(spec, settings, api=kubeapi.KubeAPI.in_cluster())
    if os.getpid() == 1:
        return _as_init(supervisor)
    pod.install_signal_handlers(supervisor)
    return supervisor.run()


#: torpor's S3 credentials (from the namespace's Secret, the webhook's s3_secret) and the names boto3
#: reads them by
S3_CREDENTIALS = {
    "TORPOR_S3_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "TORPOR_S3_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
}


def _take_s3_credentials() -> dict[str, str] | None:
    """Give torpor's S3 credentials to this process and the launchers and destagers it starts (as
    ``AWS_*``, which boto3 reads), and return the environment the job starts in: the pod's, with the
    job's own ``AWS_*`` (if any) and without torpor's. None where the pod has no credentials of torpor's."""
    if not any(name in os.environ for name in S3_CREDENTIALS):
        return None
    job_env = {name: value for name, value in os.environ.items() if name not in S3_CREDENTIALS}
    for ours, boto in S3_CREDENTIALS.items():
        if ours in os.environ:
            os.environ[boto] = os.environ.pop(ours)
    return job_env


def _as_init(supervisor: pod.Supervisor) -> int:
    """As PID 1 of a container: the supervisor runs in a child, and this process reaps every orphan
    that the container's processes leave (launchers whose job ended) and passes SIGTERM/SIGINT on."""
    child = os.fork()
    if child == 0:
        pod.install_signal_handlers(supervisor)
        code = 1
        try:
            code = supervisor.run()
        except TorporError as exc:  # said as the CLI says it: this child never returns to it
            print(f"torpor: error: {exc.message}", file=sys.stderr)
            code = exc.exit_code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def forward(sig: int, _frame: object) -> None:
        os.kill(child, sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if pid == child:
            return os.waitstatus_to_exitcode(status) & 0xFF
