"""The launcher's control protocol: one JSON request per connection, answered by JSON lines.

Every line but the last is progress (``{"progress": "..."}``); the last has ``"ok"`` and either the result
or a serialised :class:`~torpor.errors.TorporError`.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torpor.errors import LauncherUnreachable, from_dict


def call(
    sock_path: Path,
    message: dict[str, Any],
    on_progress: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Send ``message`` to the launcher at ``sock_path``; return its final reply or raise its error."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout)
    try:
        try:
            client.connect(str(sock_path))
            client.sendall(json.dumps(message).encode() + b"\n")
            reader = client.makefile("rb")
            for raw in reader:
                reply = json.loads(raw)
                if "progress" in reply:
                    if on_progress is not None:
                        on_progress(str(reply["progress"]))
                    continue
                if reply.get("ok"):
                    return dict(reply)
                raise from_dict(reply)
        except (OSError, ValueError) as exc:
            raise LauncherUnreachable(
                f"the job's launcher does not answer on {sock_path} ({exc}); see 'torpor ps'"
            ) from exc
    finally:
        client.close()
    raise LauncherUnreachable(f"the job's launcher closed {sock_path} without an answer; see 'torpor ps'")
