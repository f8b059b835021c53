"""Where a state directory's agent listens, and whether one does: cheap enough for every CLI call.

The CLI asks this before it imports the agent's client (httpx) or anything of the server (FastAPI,
uvicorn), which would add a good part of a second to every command.
"""

from __future__ import annotations

import socket
from pathlib import Path

from torpor.settings import Settings


def socket_path(settings: Settings) -> Path:
    return settings.home / "agent.sock"


def answers(uds: Path) -> bool:
    """Whether something accepts connections on the unix socket ``uds`` (a dead agent's file does not)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(str(uds))
        except OSError:
            return False
    return True
