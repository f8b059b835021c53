"""CRIU's nftables network lock, where torpor must release it itself.

A dump locks the job's TCP connections (``--network-lock nftables``) in an nftables table of its own,
``inet CRIU-<its run id>`` (cut to what fits CRIU's 32-byte name buffer), so that no packet reaches or
leaves them while they are saved: the peer sees silence, never a reset. A dump that leaves the job running
drops the table at its end; a hibernation's stays, and ``criu restore`` of that image drops it. A
hibernated job that is removed, or restored from another checkpoint, is never restored from that image:
its table would stay for good, one per hibernation (each one made even when the job had no TCP
connection), and the peers of its connections would wait on silence. Those are released here, through
``nft`` (Debian's nftables package; scripts/install-programs.sh): without it, nothing is done.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

_RUN_ID = re.compile(r"CRIU run id = ([0-9a-f-]{8,})")
_TABLE = re.compile(r"^table inet (CRIU-[0-9a-f-]+)$", re.MULTILINE)
_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def run_id(dump_log: Path) -> str | None:
    """The run id a CRIU dump logged first (its lock table is named after it); None if not found."""
    try:
        with open(dump_log, errors="replace") as log:
            head = log.read(4096)
    except OSError:
        return None
    match = _RUN_ID.search(head)
    return match.group(1) if match else None


def _nft() -> str | None:
    return shutil.which("nft") or shutil.which("nft", path=_SBIN)


def lock_tables(run: str) -> list[str]:
    """The nftables tables (``inet``) that the CRIU run ``run`` made to lock connections, still there."""
    nft = _nft()
    if nft is None:
        return []
    listed = subprocess.run([nft, "list", "tables"], capture_output=True, text=True, timeout=30)
    if listed.returncode != 0:
        return []
    # a name holds as much of the run id as fitted; the 8 first characters at least make it this run's
    return [
        name
        for name in _TABLE.findall(listed.stdout)
        if len(name) >= 13 and run.startswith(name[len("CRIU-") :])
    ]


def release(run: str) -> list[str]:
    """Delete the lock tables of CRIU run ``run``; returns those deleted (none without ``nft``)."""
    nft = _nft()
    released = []
    for name in lock_tables(run):
        if (
            nft
            and subprocess.run(
                [nft, "delete", "table", "inet", name], capture_output=True, timeout=30
            ).returncode
            == 0
        ):
            released.append(name)
    return released
