"""Bodies of chunks a peer sends (apps/agent/arrivals.py): read into buffers kept for the next body, each
exactly as long as it said, and a buffer handed on only once its use ended well."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.requests import Request

from torpor.apps.agent.arrivals import KEPT_BUFFERS, MAX_BODY, _body_into, _Buffers
from torpor.errors import UsageError


def request(parts: list[bytes], length: int | None) -> Request:
    """A real Starlette request whose body arrives in ``parts``, saying it is ``length`` bytes."""
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/arrivals/j/chunks", "headers": headers}
    messages = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return Request(scope, receive)


def read(req: Request, buffers: _Buffers, use: Callable[[memoryview], Awaitable[Any]] | None = None) -> bytes:
    async def run() -> bytes:
        async with _body_into(req, buffers) as body:
            if use is not None:
                await use(body)
            return bytes(body)

    return asyncio.run(run())


def test_a_body_is_read_whole_and_its_buffer_serves_the_next_one() -> None:
    buffers = _Buffers()
    first = [b"a" * 1000, b"b" * 24, b"c" * 3000]
    assert read(request(first, 4024), buffers) == b"".join(first)
    (kept,) = buffers._free
    assert read(request([b"xyz"], 3), buffers) == b"xyz"  # a smaller one: the same buffer, its front
    assert buffers._free == [kept] and bytes(kept[:3]) == b"xyz"
    assert read(request([b"p", b"q"], None), buffers) == b"pq"  # no length said: read as it comes
    assert buffers._free == [kept]


def test_a_body_not_the_length_it_said_or_too_large_is_refused() -> None:
    buffers = _Buffers()
    with pytest.raises(UsageError, match="not its Content-Length"):
        read(request([b"abc"], 5), buffers)
    with pytest.raises(UsageError, match="longer than its Content-Length"):
        read(request([b"abcdef"], 5), buffers)
    with pytest.raises(UsageError, match="MiB is refused"):
        read(request([b""], MAX_BODY + 1), buffers)
    assert buffers._free == []  # none of them handed a buffer on


def test_a_buffer_whose_use_failed_is_never_handed_to_another_body() -> None:
    buffers = _Buffers()

    async def fails(_: memoryview) -> None:
        raise RuntimeError("the store refused it")

    with pytest.raises(RuntimeError):
        read(request([b"secret"], 6), buffers, fails)
    assert buffers._free == []  # a thread may still read it: the next body gets a buffer of its own


def test_at_most_as_many_buffers_as_a_sender_keeps_in_flight_are_kept_the_largest() -> None:
    buffers = _Buffers()
    with contextlib.ExitStack() as stack:
        for size in (10, 40, 20, 30):  # four bodies at once
            stack.enter_context(buffers.body(size))
    assert [len(b) for b in buffers._free] == [10, 20, 30, 40][-KEPT_BUFFERS:]
