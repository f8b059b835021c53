"""The routes a peer's agent calls on this one to move a job here (issue 30; :mod:`torpor.core.arrivals`
does the work, :func:`torpor.core.migrate.move` is the caller): the look before the freeze, the chunks
this store lacks, the chunks, the log, the files the job writes, the records, then *go* (or *abort*). Over TCP each needs the
bearer token, as every route does.
"""

from __future__ import annotations

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
        body = await _body(request)
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
        if size > MAX_BODY:
            raise UsageError(f"a request body of more than {MAX_BODY >> 20} MiB is refused")
        parts.append(part)
    return b"".join(parts)
