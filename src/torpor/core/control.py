"""The launcher's control protocol: one JSON request per connection, answered by JSON lines.

Every line but the last is progress (``{"progress": "..."}``); the last has ``"ok"`` and either the result
or a serialised :class:`~torpor.errors.TorporError`. The requests and replies are the frozen dataclasses
below, and this module alone turns them into JSON and back, for both ends: the CLI's (:func:`status`,
:func:`checkpoint`, :func:`wait_lazy`) and the launcher's (:func:`parse_request`, :func:`reply_to_json`,
:func:`failed`, :func:`progress`). What a request does is the launcher's
(:mod:`torpor.core.launcher.server`).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torpor.core.recordtypes import Checkpoint, CheckpointKind, rounds_from
from torpor.errors import LauncherUnreachable, TorporError, UsageError, from_dict

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StatusRequest:
    """Is the job alive: its pid and the launcher's."""


@dataclass(frozen=True)
class CheckpointRequest:
    """Checkpoint the job, or hibernate it (the dump stops it)."""

    hibernate: bool
    #: let the dump through unix sockets connected to processes outside the job (restored closed)
    ext_unix_sk: bool = False
    #: the image is a template's (checkpoint.checkpoint_in_launcher's ``for_copies``)
    for_copies: bool = False


@dataclass(frozen=True)
class WaitLazyRequest:
    """After a lazy restore: answer once all of the job's memory is in."""


Request = StatusRequest | CheckpointRequest | WaitLazyRequest


@dataclass(frozen=True)
class StatusReply:
    """What a launcher says of its job: the job's pid and its own."""

    pid: int | None
    launcher_pid: int


@dataclass(frozen=True)
class CheckpointReply:
    """A checkpoint the launcher made, and why its image is only in RAM if it is."""

    checkpoint: Checkpoint
    #: why the image is only in RAM (the cold tier cannot take it now); None when all is well
    not_durable: str | None


@dataclass(frozen=True)
class WaitLazyReply:
    """All of a lazily restored job's memory is in; ``killed``: why torpor killed the job instead."""

    #: why torpor killed the job (a damaged chunk met while its memory came in); None if it was not
    killed: str | None


Reply = StatusReply | CheckpointReply | WaitLazyReply


# -- to JSON and back ------------------------------------------------------------------------------


def request_to_json(request: Request) -> dict[str, Any]:
    if isinstance(request, CheckpointRequest):
        return {
            "op": "checkpoint",
            "hibernate": request.hibernate,
            "ext_unix_sk": request.ext_unix_sk,
            "for_copies": request.for_copies,
        }
    return {"op": "status" if isinstance(request, StatusRequest) else "wait_lazy"}


def parse_request(data: dict[str, Any]) -> Request:
    """The request a client sent; UsageError for one this launcher does not know."""
    op = data.get("op")
    if op == "status":
        return StatusRequest()
    if op == "checkpoint":
        return CheckpointRequest(
            hibernate=bool(data.get("hibernate")),
            ext_unix_sk=bool(data.get("ext_unix_sk")),
            for_copies=bool(data.get("for_copies")),
        )
    if op == "wait_lazy":
        return WaitLazyRequest()
    raise UsageError(f"unknown request {op!r}")


def reply_to_json(reply: Reply) -> dict[str, Any]:
    """The final line of a successful request."""
    return {"ok": True, **asdict(reply)}


def failed(exc: TorporError) -> dict[str, Any]:
    """The final line of a failed request (rebuilt as the same error by the client)."""
    return {"ok": False, **exc.to_dict()}


def progress(text: str) -> dict[str, Any]:
    return {"progress": text}


def _checkpoint(data: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        **{**data, "kind": CheckpointKind(data["kind"]), "rounds": rounds_from(data.get("rounds"))}
    )


# -- the client's end --------------------------------------------------------------------------------


def status(sock_path: Path, timeout: float | None = None) -> StatusReply:
    reply = _call(sock_path, StatusRequest(), timeout=timeout)
    return StatusReply(pid=reply.get("pid"), launcher_pid=int(reply["launcher_pid"]))


def checkpoint(
    sock_path: Path,
    hibernate: bool,
    on_progress: Progress | None = None,
    *,
    ext_unix_sk: bool = False,
    for_copies: bool = False,
) -> CheckpointReply:
    reply = _call(sock_path, CheckpointRequest(hibernate, ext_unix_sk, for_copies), on_progress)
    return CheckpointReply(_checkpoint(reply["checkpoint"]), reply.get("not_durable"))


def wait_lazy(sock_path: Path, on_progress: Progress | None = None) -> WaitLazyReply:
    reply = _call(sock_path, WaitLazyRequest(), on_progress)
    return WaitLazyReply(killed=reply.get("killed"))


def _call(
    sock_path: Path,
    request: Request,
    on_progress: Progress | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Send ``request`` to the launcher at ``sock_path``; return its final reply or raise its error."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout)
    try:
        try:
            client.connect(str(sock_path))
            client.sendall(json.dumps(request_to_json(request)).encode() + b"\n")
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
