"""Asking a peer's agent: its client (its token, and its certificate checked as ``torpor peers add``
recorded it) and how it is (``GET /v1/node``), one line of why where it cannot be asked. ``torpor peers``
shows it, ``torpor migrate`` and the evacuation to peers act on it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torpor.core.recordtypes import Peer
from torpor.errors import TorporError
from torpor.policy import peers as policy

if TYPE_CHECKING:  # httpx is imported by the commands that call a peer only: it costs every CLI call 0.3 s
    from torpor.apps.agent.client import AgentClient


@dataclass(frozen=True)
class Seen:
    """What a peer answered when asked how it is (``GET /v1/node``), or why it did not."""

    peer: Peer
    node: dict[str, Any] = field(default_factory=dict)
    #: one line: why the peer could not be asked (None: it answered)
    problem: str | None = None
    #: how its machine is unlike this one (policy.peers.differences)
    differs: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.peer.name,
            "url": self.peer.url,
            "added_at": self.peer.added_at,
            "reachable": self.problem is None,
            "problem": self.problem,
            "pinned": self.peer.pin,
            **{key: self.node.get(key) for key in NODE_KEYS},
            "differs": list(self.differs),
        }

    def compared(self, here: dict[str, Any]) -> Seen:
        """This, with how the peer's machine is unlike ``here`` (:func:`this_machine`)."""
        return replace(self, differs=tuple(policy.differences(here, self.node)))


#: what of a peer's ``GET /v1/node`` its row and JSON show
NODE_KEYS = ("hostname", "version", "arch", "kernel", "criu", "draining", "memory", "jobs")


def trust(peer: Peer) -> ssl.SSLContext | bool:
    """How ``peer``'s certificate is checked: against its recorded certificates, else the system's. A
    pinned peer's is its very certificate, trusted alone (no chain above it) and whatever host it names."""
    if not peer.url.startswith("https:"):
        return False  # loopback in clear text (policy.peers allows nothing else)
    if not peer.ca:
        return ssl.create_default_context()
    context = ssl.create_default_context(cadata=peer.ca)
    if peer.pin:
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        context.check_hostname = False
    return context


def client_of(peer: Peer, timeout_s: float = policy.PEER_TIMEOUT_S) -> AgentClient:
    """A client of ``peer``'s API whose every call gives up after ``timeout_s``."""
    from torpor.apps.agent.client import AgentClient

    return AgentClient(url=peer.url, token=peer.token, timeout_s=timeout_s, verify=trust(peer))


def ask(peer: Peer, timeout_s: float = policy.PEER_TIMEOUT_S) -> Seen:
    """How ``peer`` is; a peer that cannot be asked gives the one-line reason instead, within ``timeout_s``."""
    client = client_of(peer, timeout_s)
    try:
        return Seen(peer, node=client.node())
    except TorporError as exc:
        # one line, also where a server that is no agent answered a page of text
        line = exc.message.removeprefix("the agent did not answer: ").strip().splitlines()[0]
        return Seen(peer, problem=line if len(line) <= 200 else line[:199] + "…")
    finally:
        client.close()
