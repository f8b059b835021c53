"""Whom an agent may speak to, and how: a peer's URL, and where a token may travel in clear text.

Agents on different machines reach each other's API over TCP with a bearer token (docs/peers.md). A token
sent over plain HTTP can be read by anyone on the path, so clear text is allowed on loopback only: an agent
that listens on any other address serves TLS, and a peer on another machine is an ``https://`` URL.

Pure: each function returns the problem as one line (the caller raises), or None when there is none.
"""

from __future__ import annotations

from collections.abc import Mapping
from ipaddress import ip_address
from typing import Any
from urllib.parse import SplitResult, urlsplit

#: seconds a call to a peer may take before the peer counts as unreachable (connecting included)
PEER_TIMEOUT_S = 5.0


def loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_problem(host: str, port: int, tls: bool) -> str | None:
    """Why the agent may not serve its API on ``host:port`` as asked, or None."""
    if tls or loopback(host):
        return None
    return (
        f"--listen {host}:{port} without --tls-cert and --tls-key would send the token in clear text: "
        "give a certificate and its key, or listen on 127.0.0.1"
    )


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a peer's address (``https://HOST:PORT``; ``http://`` on loopback only), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"bad peer URL {url!r}: give the peer agent's address, e.g. https://node2:7788"
    if parts.username is not None or parts.password is not None:
        return f"bad peer URL {url!r}: a token goes in --token-file, never in the URL"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"bad peer URL {url!r}: give the agent's address alone (https://HOST:PORT), no path"
    if _port(parts) is None:
        return f"bad peer URL {url!r}: its port is not a number from 1 to 65535"
    if parts.scheme == "http" and not loopback(parts.hostname):
        return (
            f"peer URL {url!r} would send the token in clear text: use https:// "
            "(the peer's agent runs with --tls-cert and --tls-key)"
        )
    return None


def fingerprint(text: str) -> str | None:
    """A SHA-256 certificate fingerprint as it is stored, ``sha256:`` and 64 lower-case hex digits, from
    how a person gives it: with or without colons, ``sha256:`` or openssl's ``sha256 Fingerprint=``;
    None if ``text`` is not one."""
    digits = text.strip().lower()
    for prefix in ("sha256 fingerprint=", "sha256:", "sha256="):
        digits = digits.removeprefix(prefix)
    digits = digits.replace(":", "")
    if len(digits) != 64 or any(c not in "0123456789abcdef" for c in digits):
        return None
    return "sha256:" + digits


def differences(here: Mapping[str, Any], there: Mapping[str, Any]) -> list[str]:
    """How a peer's machine (``arch``, ``criu`` of its ``GET /v1/node``) is unlike this one, each as a few
    words (``CRIU 4.1, here 4.2``): a job checkpointed on one restores on the other only with the same
    architecture and CRIU. A value either side does not know is no difference."""
    found = []
    for key, what in (("arch", "arch"), ("criu", "CRIU")):
        mine, its = here.get(key), there.get(key)
        if mine and its and mine != its:
            found.append(f"{what} {its}, here {mine}")
    return found


def base_url(url: str) -> str:
    """``url`` as it is stored: scheme, host and port, without a trailing slash (``url_problem`` is None)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _port(parts: SplitResult) -> int | None:
    try:
        port = parts.port
    except ValueError:
        return None
    if port is None:
        return 443 if parts.scheme == "https" else 80
    return port if 0 < port < 65536 else None
