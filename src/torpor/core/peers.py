"""Peers: other machines' agents this state directory may ask (``torpor peers add``).

Their table is in :mod:`torpor.core.records`' schema; its token and CA are secrets of this state
directory, as every row of torpor.db is. Asking a peer is :mod:`torpor.apps.peers`'. Here too is this
machine as its peers see it (:func:`this_machine`: the agent's ``GET /v1/node`` says it, ``torpor peers``
compares each peer with it).
"""

from __future__ import annotations

import platform
from typing import Any

from torpor.adapters.criu import Criu
from torpor.core.records import Records
from torpor.core.recordtypes import Peer
from torpor.errors import TorporError, UsageError
from torpor.settings import Settings


class Peers:
    """The peers recorded in ``records``."""

    def __init__(self, records: Records) -> None:
        self.records = records

    def add(self, peer: Peer, replace: bool = False) -> None:
        """Record ``peer``; UsageError if one of its name is recorded already, unless ``replace``."""
        with self.records.transaction() as db:
            if not replace and db.execute("SELECT 1 FROM peers WHERE name=?", (peer.name,)).fetchone():
                raise UsageError(
                    f"a peer named {peer.name!r} is recorded already: 'torpor peers rm {peer.name}' first, "
                    "or add it with --replace"
                )
            db.execute("DELETE FROM peers WHERE name=?", (peer.name,))  # and its pin, if it had one
            db.execute(
                "INSERT INTO peers(name, url, token, ca, added_at) VALUES (?,?,?,?,?)",
                (peer.name, peer.url, peer.token, peer.ca, peer.added_at),
            )
            if peer.pin is not None:
                db.execute("INSERT INTO peer_pins(name, fingerprint) VALUES (?,?)", (peer.name, peer.pin))

    def delete(self, name: str) -> bool:
        """Forget the peer ``name``; whether there was one."""
        with self.records.transaction() as db:
            return db.execute("DELETE FROM peers WHERE name=?", (name,)).rowcount > 0

    def all(self) -> list[Peer]:
        """Every peer, by name."""
        with self.records.transaction() as db:
            rows = db.execute(
                "SELECT peers.*, peer_pins.fingerprint FROM peers"
                " LEFT JOIN peer_pins ON peer_pins.name = peers.name ORDER BY peers.name"
            ).fetchall()
        return [
            Peer(row["name"], row["url"], row["token"], row["ca"], row["added_at"], row["fingerprint"])
            for row in rows
        ]

    def get(self, name: str) -> Peer:
        """The peer ``name``; UsageError naming the known ones when there is none."""
        peers = self.all()
        for peer in peers:
            if peer.name == name:
                return peer
        known = ", ".join(p.name for p in peers) or "none yet ('torpor peers add NAME URL ...')"
        raise UsageError(f"no peer named {name!r}; the peers are: {known}")


def this_machine(settings: Settings) -> dict[str, Any]:
    """This machine as a peer sees it (``GET /v1/node`` says it; :func:`policy.peers.differences` compares
    it): architecture, kernel and the CRIU version (None: none that works)."""
    try:
        criu: str | None = Criu(settings.criu).info().version
    except TorporError:
        criu = None
    return {"arch": platform.machine(), "kernel": platform.release(), "criu": criu}
