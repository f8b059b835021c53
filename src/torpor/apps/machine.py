"""``torpor doctor``, ``torpor cleanup`` and ``torpor store``: what this machine can do, what deleted state
directories left in RAM, and where the state directory's images go.

All three work before (and without) an engine: ``doctor`` must report a machine where torpor cannot run,
``cleanup`` judges the hot tiers of state directories other than its own, and ``store`` shows and changes the
store configuration that every other command checks its environment against.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torpor.apps.render import emit_json, human_bytes
from torpor.core import doctor
from torpor.core.engine import Engine
from torpor.core.store import config as store_config
from torpor.core.store import leftovers
from torpor.errors import TorporError, UsageError
from torpor.settings import Settings


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


def _other_users_line(other: dict[str, Any]) -> str:
    if other["problem"]:
        return f"--  {other['problem']}" + "".join(f"\n      {line}" for line in other["details"])
    if other["cap_sys_resource"]:
        return "ok  jobs with processes of another user (runuser -u USER -- ...): yes"
    how = f"torpor's rlimit shim for criu ({other['rlimit_shim']})" if other["rlimit_shim"] else "criu"
    return (
        "ok  jobs with processes of another user (runuser -u USER -- ...): yes; root lacks CAP_SYS_RESOURCE"
        f" here, and {how} reads their limits from /proc/PID/limits"
    )


def _hot_tier_text(tier: dict[str, Any]) -> str:
    mounted = "a tmpfs, " if tier["mounted"] else ""
    return f"{tier['path']} ({mounted}{human_bytes(tier['used_bytes'])}): {tier['reason']}"


def _hot_tiers_line(tiers: list[dict[str, Any]]) -> str:
    stale = [tier for tier in tiers if tier["stale"]]
    if not stale:
        return "ok  no hot tier in RAM left over by a deleted state directory"
    lines = ["--  hot tiers in RAM left over by deleted state directories (torpor cleanup removes them):"]
    return "\n      ".join(lines + [_hot_tier_text(tier) for tier in stale])


def cmd_cleanup(settings: Settings, args: argparse.Namespace) -> int:
    """Remove the hot tiers that deleted state directories left in RAM (``--dry-run``: only say which)."""
    removed, failed, kept = [], [], []
    for tier in leftovers.survey(settings, force=args.force):
        entry = tier.to_dict()
        if not tier.verdict.remove:
            if tier.verdict.stale:
                kept.append(entry)
            continue
        problem = None if args.dry_run else leftovers.remove(tier)
        if problem is None:
            removed.append(entry)
        else:
            failed.append(entry | {"error": problem})
    if args.json:
        emit_json({"dry_run": args.dry_run, "removed": removed, "failed": failed, "left": kept})
    else:
        done = "would remove" if args.dry_run else "removed"
        for entry in removed:
            print(f"{done} {_hot_tier_text(entry)}")
        for entry in failed:
            print(f"could not remove {entry['path']}: {entry['error']}")
        for entry in kept:
            print(f"left {_hot_tier_text(entry)}")
        if not (removed or failed or kept):
            print("no hot tier in RAM is left over by a deleted state directory")
    return 1 if failed else 0


def cmd_doctor(settings: Settings, args: argparse.Namespace) -> int:
    report = doctor_report(settings)
    if args.json:
        emit_json(report)
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
        tracking = criu["write_tracking"]
        print(
            f"{mark(tracking['uffd_wp_async'])} tracking a running job's writes (userfaultfd write-protection): "
            + (
                "yes (checkpoints do not use it yet)"
                if tracking["uffd_wp_async"]
                else f"no: {tracking['problem']}"
            )
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
    for device in report["gpus"]:
        print(
            f"    GPU {device['minor']}: {device['name']}, {human_bytes(device['memory_bytes'])}, "
            f"{device['uuid']}{', MIG mode' if device['mig'] else ''}"
        )
    if report["gpus_error"]:
        print(f"--  GPUs cannot be listed: {report['gpus_error']}")
    free = report.get("home_free_bytes")
    print(
        f"{mark(report['home_writable'])} state directory writable: {'yes' if report['home_writable'] else 'NO'}"
        + (f", {human_bytes(free)} free" if free is not None else "")
    )
    store = report["store"]
    store_ok = doctor.store_ok(store)
    for n, line in enumerate(_store_lines(store)):
        print(f"{mark(store_ok)} {line}" if n == 0 else f"    {line}")
    print(_other_users_line(report["other_users"]))
    print(_hot_tiers_line(report["hot_tiers"]))
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
        emit_json(report)
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
        emit_json(store_report(settings))
    elif after == before:
        print("store configuration unchanged")
    else:
        print("\n".join(_store_lines(store_report(settings))))
    return 0


def add_parsers(sub: Any, add: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``doctor`` and ``store`` commands of the CLI's parser (``add`` makes one like the others)."""
    add(
        "doctor",
        "what works on this machine: CRIU, dirty tracking, userfaultfd, cgroups, GPU; the store configuration;"
        " whether jobs with processes of another user can be checkpointed",
        job=False,
    ).set_defaults(func=None)

    cleanup_help = "remove the hot tiers (folders in RAM) that deleted state directories left behind"
    cleanup = sub.add_parser(
        "cleanup",
        help=cleanup_help,
        description=cleanup_help
        + ". A state directory's hot tier lives outside it, in /dev/shm/torpor-<hash of its path> (often a "
        "tmpfs of torpor's own), and names its state directory: one whose state directory is gone is "
        "unmounted and deleted if it is empty, and with --force if it still holds images. Only your own "
        "hot tiers are looked at, and one a process has a file open in stays. torpor doctor lists them.",
    )
    cleanup.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    cleanup.add_argument(
        "--force",
        action="store_true",
        help="remove the leftovers that still hold images too (their state directory may only be unmounted)",
    )
    cleanup.add_argument("--json", action="store_true", help="print machine-readable JSON")
    cleanup.set_defaults(func=cmd_cleanup, needs_settings=True)

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
