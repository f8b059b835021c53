"""``torpor peers``: the other machines' agents this one knows (docs/peers.md).

``torpor peers add NAME URL --token-file F [--ca-file F | --fingerprint SHA256]`` records a peer after
asking it who it is (over TLS, the token in a header; clear text only on loopback: policy.peers),
``torpor peers [ls]`` asks each peer at once how it is, within a timeout, and ``torpor peers rm NAME``
forgets one. What is recorded (its token, the certificates it must chain to or the one pinned) is in the
private state directory, never printed.
"""

from __future__ import annotations

import argparse
import hashlib
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from torpor.apps.agent import tokens
from torpor.apps.agent.peering import Seen, ask
from torpor.apps.render import emit_json, human_age, human_bytes, table
from torpor.core.naming import check_name
from torpor.core.peers import Peers, this_machine
from torpor.core.records import Records
from torpor.core.recordtypes import Peer
from torpor.errors import EnvironmentProblem, UsageError
from torpor.policy import peers as policy
from torpor.settings import Settings

if TYPE_CHECKING:  # httpx is imported by the commands that call a peer only: it costs every CLI call 0.3 s
    pass


def pinned_certificate(url: str, pin: str, timeout_s: float = policy.PEER_TIMEOUT_S) -> str:
    """The PEM certificate ``url``'s server shows, checked to have the fingerprint ``pin``
    (``sha256:HEX``); EnvironmentProblem (one line) if it cannot be had or has another."""
    parts = urlsplit(url)
    address = (parts.hostname or "", parts.port or 443)
    try:
        pem = ssl.get_server_certificate(address, timeout=timeout_s)
    except (OSError, ssl.SSLError) as exc:
        raise EnvironmentProblem(
            f"cannot get the certificate of {url}: {getattr(exc, 'strerror', None) or exc}; not added"
        ) from None
    seen = "sha256:" + hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()
    if seen != pin:
        raise EnvironmentProblem(
            f"the certificate of {url} has the fingerprint {seen}, not the {pin} given; not added "
            "(someone may be in between, or the peer has a new certificate)"
        )
    return pem


# -- commands ---------------------------------------------------------------------------------------------


def cmd_peers(settings: Settings, args: argparse.Namespace) -> int:
    peers = Peers(Records(settings.db_path))
    action: Callable[[Peers, argparse.Namespace, Settings], int] = {
        "add": _add,
        "rm": _remove,
    }.get(args.peers_command or "ls", _list)
    return action(peers, args, settings)


def _add(peers: Peers, args: argparse.Namespace, settings: Settings) -> int:
    check_name(args.peer, "peer")
    problem = policy.url_problem(args.url)
    if problem:
        raise UsageError(problem)
    url = policy.base_url(args.url)
    if (args.ca_file or args.fingerprint) and not url.startswith("https:"):
        raise UsageError(f"{'--ca-file' if args.ca_file else '--fingerprint'} goes with an https:// URL")
    if args.ca_file and args.fingerprint:
        raise UsageError("--ca-file and --fingerprint are two ways to trust a peer: give one")
    pin = None
    if args.fingerprint:
        pin = policy.fingerprint(args.fingerprint)
        if pin is None:
            raise UsageError(
                f"bad --fingerprint {args.fingerprint!r}: give the SHA-256 of the peer's certificate, as "
                "'openssl x509 -noout -fingerprint -sha256 -in CERT' prints it"
            )
    token = tokens.read_token(args.token_file)
    ca = None
    if args.ca_file:
        ca = _read_certificates(args.ca_file)
    elif pin:
        ca = pinned_certificate(url, pin)  # asks the peer for it, even with --no-check
    peer = Peer(args.peer, url, token, ca, time.time(), pin)
    seen = None
    if not args.no_check:
        seen = ask(peer).compared(this_machine(settings))
        if seen.problem:
            raise EnvironmentProblem(
                f"peer {peer.name} ({peer.url}): {seen.problem}; not added ('--no-check' adds it anyway)"
            )
    peers.add(peer, replace=args.replace)
    if args.json:
        emit_json(seen.to_dict() if seen else Seen(peer).to_dict() | {"reachable": None})
    else:
        about = f": torpor {seen.node.get('version')} on {seen.node.get('hostname')}" if seen else ""
        print(f"added peer {peer.name} ({peer.url}){about}")
        if seen and seen.differs:
            print(
                f"note: its machine is unlike this one ({'; '.join(seen.differs)}): jobs cannot move between them"
            )
    return 0


def _remove(peers: Peers, args: argparse.Namespace, settings: Settings) -> int:
    if not peers.delete(args.peer):
        peers.get(args.peer)  # raises, naming the peers there are
    if args.json:
        emit_json({"removed": args.peer})
    else:
        print(f"removed peer {args.peer}")
    return 0


def _list(peers: Peers, args: argparse.Namespace, settings: Settings) -> int:
    recorded = peers.all()
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(recorded)))) as pool:
        asked = pool.map(ask, recorded)
        here = this_machine(settings)
        seen = [each.compared(here) for each in asked]
    if args.json:
        emit_json([each.to_dict() for each in seen])
        return 0
    if not seen:
        print("no peers: torpor peers add NAME https://HOST:PORT --token-file FILE [--ca-file FILE]")
        return 0
    headers = ["PEER", "URL", "REACHABLE", "HOST", "VERSION", "MACHINE", "FREE/BUDGET", "JOBS", "ADDED"]
    print(table(headers, _rows(seen)))
    return 0


def _rows(seen: list[Seen]) -> list[list[str]]:
    rows = []
    for each in seen:
        added = human_age(time.time() - each.peer.added_at) + " ago"
        if each.problem:
            rows.append([each.peer.name, each.peer.url, f"no: {each.problem}", *["-"] * 5, added])
            continue
        memory = each.node.get("memory") or {}
        jobs = each.node.get("jobs") or {}
        rows.append(
            [
                each.peer.name,
                each.peer.url,
                "yes, draining" if each.node.get("draining") else "yes",
                str(each.node.get("hostname", "-")),
                str(each.node.get("version", "-")),
                _machine(each),
                f"{human_bytes(memory.get('free'))}/{human_bytes(memory.get('budget'))}",
                ", ".join(f"{n} {state}" for state, n in sorted(jobs.items())) or "none",
                added,
            ]
        )
    return rows


def _machine(seen: Seen) -> str:
    """``x86_64, CRIU 4.2``, and how it is unlike this machine if it is."""
    criu = seen.node.get("criu")
    text = f"{seen.node.get('arch') or '?'}, {f'CRIU {criu}' if criu else 'no CRIU'}"
    return text + (f" (unlike here: {'; '.join(seen.differs)})" if seen.differs else "")


def _read_certificates(path: Path) -> str:
    """The PEM certificates in ``path``, checked to be some."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the CA file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        ssl.create_default_context(cadata=text)
    except (ssl.SSLError, ValueError):
        raise UsageError(
            f"the CA file {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)"
        ) from None
    return text


# -- parsers ----------------------------------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    """``torpor peers [ls|add|rm]``."""
    peers_help = "the other machines' agents this one knows: list them and how each is, add, remove"
    peers = sub.add_parser(
        "peers",
        help=peers_help,
        description=peers_help
        + f". Each peer is asked at once, each within {policy.PEER_TIMEOUT_S:g} s: an unreachable one is "
        "listed with why (docs/peers.md).",
    )
    peers_sub = peers.add_subparsers(dest="peers_command", metavar="SUBCOMMAND")
    ls_help = (
        "list the peers: reachable (or why not), host, torpor version, architecture and CRIU, memory free "
        "and budget, jobs"
    )
    listing = peers_sub.add_parser("ls", help=ls_help, description=ls_help + " (the default)")
    add_help = "record another machine's agent as peer NAME, once it answered with the token"
    adding = peers_sub.add_parser("add", help=add_help, description=add_help)
    adding.add_argument("peer", metavar="NAME", help="the peer's name here")
    adding.add_argument(
        "url", metavar="URL", help="its agent's API: https://HOST:PORT (http:// on loopback only)"
    )
    adding.add_argument(
        "--token-file",
        type=Path,
        required=True,
        metavar="FILE",
        help="the peer agent's token (its --token-file's content): a regular 0600 file of yours",
    )
    adding.add_argument(
        "--ca-file",
        type=Path,
        metavar="FILE",
        help="PEM certificates the peer's TLS certificate must chain to: its own for a self-signed one "
        "(default: the system's CAs)",
    )
    adding.add_argument(
        "--fingerprint",
        metavar="SHA256",
        help="trust the peer's certificate by its SHA-256 fingerprint alone (as 'openssl x509 -noout "
        "-fingerprint -sha256' prints it), whatever host it names; instead of --ca-file",
    )
    adding.add_argument("--replace", action="store_true", help="replace a peer of that name")
    adding.add_argument("--no-check", action="store_true", help="record it without asking it first")
    rm_help = "forget a peer"
    removing = peers_sub.add_parser("rm", help=rm_help, description=rm_help)
    removing.add_argument("peer", metavar="NAME", help="the peer's name")
    for p in (peers, listing, adding, removing):
        # on the subcommands too, without a default that would hide 'torpor peers --json'
        p.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS if p is not peers else False,
            help="print machine-readable JSON",
        )
    peers.set_defaults(func=cmd_peers, needs_settings=True)
