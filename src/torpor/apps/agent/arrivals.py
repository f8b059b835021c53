"""The routes a peer's agent calls on this one to move a job here (issue 30; :mod:`torpor.core.arrivals`
does the work, :func:`torpor.core.migrate.move` is the caller): the look before the freeze, the chunks
this store lacks, the chunks, the log, the files the job writes, the records, then *go* (or *abort*). Over TCP each needs the
bearer token, as every route does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from torpor.core import migrate
from torpor.core.arrivals import Arrivals
from torpor.core.recordtypes import JobState
from torpor.errors import UsageError

if TYPE_CHECKING:
    from torpor.apps.agent.service import Agent

#: the largest body of chunks (or log) taken in one request
MAX_BODY = 64 << 20

#: the buffers for bodies of chunks kept between requests (as many as a sender keeps in flight)
KEPT_BUFFERS = migrate.IN_FLIGHT


class LookRequest(BaseModel):
    paths: list[str] = Field(default_factory=list, max_length=migrate.MAX_LOOKED_AT)
    ports: list[int] = Field(default_factory=list, max_length=migrate.MAX_LOOKED_AT)
    written: list[str] = Field(default_factory=list, max_length=migrate.MAX_LOOKED_AT)


class MissingRequest(BaseModel):
    chunks: list[str] = Field(max_length=1_000_000)


class ArriveRequest(BaseModel):
    gen: int = Field(ge=1)
    source: str = Field(max_length=253)
    spec: dict[str, Any]


class GoRequest(BaseModel):
    gen: int = Field(ge=1)
    resume: bool = True
    lazy: bool = False


class AbortRequest(BaseModel):
    gen: int = Field(ge=1)


def add_routes(app: FastAPI, agent: Agent) -> None:
    arrivals = Arrivals(agent.engine)
    buffers = _Buffers()

    @app.post("/v1/arrivals/look")
    def look(body: LookRequest) -> dict[str, Any]:
        """Before a job is moved here: each of ``paths`` as it is here (``[size, mtime_ns]``, or null:
        not here, or not a regular file), which of ``ports`` a process listens on here, and for each of
        ``written`` (files the job writes) whether its folder is here and who owns a file there."""
        return migrate.look(body.paths, body.ports, body.written)

    @app.post("/v1/arrivals/{job}/missing")
    def missing(job: str, body: MissingRequest) -> dict[str, Any]:
        """Which of the source's chunk names of ``job`` this store lacks."""
        return {"missing": arrivals.missing(job, body.chunks)}

    @app.post("/v1/arrivals/{job}/chunks")
    async def chunks(job: str, request: Request) -> dict[str, Any]:
        """Chunks of ``job``'s checkpoints, as frames (core/store/transfer.py), stored encrypted here."""
        async with _body_into(request, buffers) as body:
            return {"taken": await run_in_threadpool(arrivals.take, job, body)}

    @app.put("/v1/arrivals/{job}/log")
    async def log(job: str, request: Request, offset: int = Query(0, ge=0)) -> dict[str, Any]:
        """A piece of ``job``'s output so far, at ``offset``: its log here starts with it."""
        body = await _body(request)
        await run_in_threadpool(arrivals.put_log, job, offset, body)
        return {"bytes": len(body)}

    @app.put("/v1/arrivals/{job}/file")
    async def file(
        job: str, request: Request, index: int = Query(ge=0), offset: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        """A piece of the ``index``-th file ``job`` writes, at ``offset``: kept aside until it is handed
        over, then put in its place."""
        body = await _body(request)
        await run_in_threadpool(arrivals.put_file, job, index, offset, body)
        return {"bytes": len(body)}

    @app.post("/v1/arrivals/{job}")
    def arrive(job: str, body: ArriveRequest) -> dict[str, Any]:
        """``job``'s records and its checkpoints' manifests: it is here, hibernated, not to run until
        handed over."""
        arrivals.arrive(job, body.gen, body.source, body.spec)
        agent.event(job, "arriving", f"from {body.source}", gen=body.gen)
        return {"arriving": True}

    @app.post("/v1/arrivals/{job}/go")
    def go(job: str, body: GoRequest) -> dict[str, Any]:
        """The source hands ``job`` over: it is this machine's, and resumed with ``resume``."""
        arrivals.go(job, body.gen)
        answer: dict[str, Any] = {"owned": True, "restored": False}
        arrived = agent.records.job(job)
        if body.resume and arrived.state == JobState.HIBERNATED:
            for hook in agent.before_restore:
                hook(arrived.name)
            resumed, taken, seconds = agent.engine.restore(job, lazy=body.lazy)
            agent.scheduling.restored(resumed.name)
            answer.update(restored=True, checkpoint=taken.id, restore_s=seconds)
        agent.event(job, "arrived", "handed over by its source", gen=body.gen, **answer)
        return answer

    @app.post("/v1/arrivals/{job}/abort")
    def abort(job: str, body: AbortRequest) -> dict[str, Any]:
        """The source kept ``job``: what had arrived of it goes."""
        return {"dropped": arrivals.abort(job, body.gen)}


async def _body(request: Request) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        _refuse_larger(size)
        parts.append(part)
    return b"".join(parts)


def _refuse_larger(size: int) -> None:
    if size > MAX_BODY:
        raise UsageError(f"a request body of more than {MAX_BODY >> 20} MiB is refused")


class _Buffers:
    """Buffers bodies of chunks are read into, kept for the next (at most :data:`KEPT_BUFFERS`): a body
    of tens of MiB in new memory each time cost more than reading it (this virtual machine faults in
    fresh memory slowly), and a body that large is never carved from memory freed before."""

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def body(self, size: int) -> Iterator[bytearray]:
        with self._guard:
            fits = [each for each in self._free if len(each) >= size]
            buffer = min(fits, key=len) if fits else None
            if buffer is not None:
                self._free.remove(buffer)
        if buffer is None:
            buffer = bytearray(size)
        yield buffer
        # kept only when its use ended well: a request cancelled while a thread still stores from its
        # buffer must not have that buffer written by the next
        with self._guard:
            self._free.append(buffer)
            self._free.sort(key=len)
            del self._free[:-KEPT_BUFFERS]  # the largest kept


@contextlib.asynccontextmanager
async def _body_into(request: Request, buffers: _Buffers) -> AsyncIterator[memoryview]:
    """The body of ``request``, sent with its length (a body without one is read as :func:`_body` reads),
    as a view of a buffer of ``buffers``: valid inside the ``async with``. UsageError if it is larger
    than :data:`MAX_BODY`, or not the length it said."""
    declared = request.headers.get("content-length", "")
    if not declared.isdigit():
        yield memoryview(await _body(request))
        return
    size = int(declared)
    _refuse_larger(size)
    with buffers.body(size) as buffer:
        view, at = memoryview(buffer), 0
        async for part in request.stream():
            if at + len(part) > size:
                raise UsageError(f"the request body is longer than its Content-Length ({size} bytes)")
            view[at : at + len(part)] = part
            at += len(part)
        if at != size:
            raise UsageError(f"the request body is {at} bytes, not its Content-Length ({size})")
        yield view[:size]
