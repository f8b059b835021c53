"""The agent's HTTP API (FastAPI): the CLI's operations, policies, events and drains, and the scheduler's
submissions, queue and quotas (docs/scheduler.md); /docs shows it all.

Every operation is the engine's, as the CLI runs it embedded; errors keep their exit code in the body
(``{"error", "details", "exit_code"}``) with a status that says the kind: 400 bad input, 404 no such
job or checkpoint, 409 the job is in the wrong state, 500 the operation failed. A long operation
(checkpoint, restore, drain) asked with ``Accept: application/x-ndjson`` streams its progress lines as it
goes, one JSON object a line (``{"progress": …}``, ``{"warning": …}``), and ends with ``{"result": …}``
or ``{"error": …}``.

On TCP every request needs ``Authorization: Bearer TOKEN`` (the token file's content), but for the page
at ``/``, which a session of its sign-in form opens too (:mod:`torpor.apps.agent.login`); on the unix
socket, which only root can open, none does.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from torpor import __version__
from torpor.apps.agent import arrivals, care, metrics, web, wire
from torpor.apps.agent.login import PageLogin
from torpor.apps.agent.scheduling import Scheduling, SubmitRequest
from torpor.apps.agent.service import BY_DRAIN, Agent
from torpor.core.context import Progress
from torpor.core.peers import this_machine
from torpor.errors import CheckpointNotFound as NoCheckpoint
from torpor.errors import JobNotFound, TorporError, UsageError, WrongState

NDJSON = "application/x-ndjson"


class RunRequest(BaseModel):
    command: list[str] = Field(min_length=1, description="the command and its arguments")
    name: str | None = None
    cwd: str = Field("/", description="the job's working directory")
    policy: dict[str, Any] = Field(default_factory=dict, description="fields of the job's policy")


class CheckpointRequest(BaseModel):
    hibernate: bool = False
    ext_unix_sk: bool = False
    wait: bool = Field(False, description="return once the image is durable")


class RestoreRequest(BaseModel):
    checkpoint: str | None = Field(None, description="checkpoint id or prefix (default: the latest)")
    force: bool = False
    lazy: bool = False
    rewind: bool = False


class SubmitBody(BaseModel):
    """What ``torpor submit`` sends: the job, the submitter's environment, and what it asks of the node.

    Sizes and the priority are checked by the scheduler, not here, so that every problem of a submission
    comes back in one line with the scheduler's wording (400), not as a validation error (422).
    """

    command: list[str] = Field(min_length=1, description="the command and its arguments")
    cwd: str = Field(description="the job's working directory (the submitter's)")
    env: dict[str, str] = Field(description="the job's environment (the submitter's)")
    umask: int = Field(ge=0, le=0o777, description="the job's umask (the submitter's)")
    memory: str | int = Field(description="the memory it needs: 500M, 4G, or bytes")
    name: str | None = None
    cpus: float = Field(1.0, gt=0)
    priority: int = Field(0, description="higher may preempt lower (0 or more)")
    project: str = "default"


class QuotaBody(BaseModel):
    share: str | int = Field(description="the project's guaranteed memory: 2G, or bytes")
    borrow_limit: str | int | None = Field(
        None, description="how much more it may borrow of what others leave unused (null: any)"
    )


class StopRequest(BaseModel):
    timeout_s: float | None = Field(None, ge=0)


class DrainRequest(BaseModel):
    why: str = "torpor drain"
    deadline_s: float | None = Field(None, gt=0)
    to_peers: bool = Field(False, description="move each job to a peer that has room, hibernate the rest")


def status_of(error: TorporError) -> int:
    if isinstance(error, JobNotFound | NoCheckpoint):
        return 404
    if isinstance(error, WrongState):
        return 409
    if isinstance(error, UsageError):
        return 400
    return 500


def error_body(error: TorporError) -> dict[str, Any]:
    kind = str(error.to_dict()["error"])  # the class the client rebuilds (its nearest public one)
    return {
        "error": error.message,
        "details": list(error.details),
        "exit_code": error.exit_code,
        "kind": kind,
    }


def create_app(agent: Agent, token: str | None = None) -> FastAPI:
    """The API of ``agent``; ``token``: what a request over TCP must bring as its bearer token."""
    app = FastAPI(
        title="torpor agent",
        version=__version__,
        description="The node agent of torpor: jobs, checkpoints, policies, events, drains (docs/agent.md).",
    )
    engine, records = agent.engine, agent.records

    def scheduling() -> Scheduling:
        return agent.scheduling

    login = PageLogin(token)
    # on TCP: the bearer token, or for the page alone a session of its sign-in form (login.py says why)
    app.middleware("http")(login.middleware())
    login.add_routes(app)

    @app.exception_handler(TorporError)
    async def torpor_error(_: Request, error: TorporError) -> JSONResponse:
        return JSONResponse(error_body(error), status_code=status_of(error))

    def job_dict(name: str) -> dict[str, Any]:
        status = engine.status(name)
        kept = records.care(status.job.name)
        return {
            **wire.status_to_dict(status, kept),
            **wire.scheduling_fields(records.submission(status.job.name), kept, records),
        }

    @app.get("/v1/health")
    def health() -> dict[str, Any]:
        """The agent's version, pid, state directory, whether the node drains, and its rounds so far."""
        return {
            "version": __version__,
            "pid": os.getpid(),
            "home": str(agent.settings.home),
            "started_at": agent.started_at,
            "draining": agent.draining(),
            "rounds": agent.rounds,
        }

    @app.get("/v1/node")
    def node() -> dict[str, Any]:
        """What a peer asks of this node (``torpor peers``): its name, torpor's version, the machine's
        architecture, kernel and CRIU (None: none that works), whether it drains, its memory budget and
        what is free of it, and how many jobs it has in each state."""
        states: dict[str, int] = {}
        for each in records.jobs():
            states[str(each.state)] = states.get(str(each.state), 0) + 1
        return {
            "hostname": socket.gethostname(),
            "version": __version__,
            **this_machine(agent.settings),
            "draining": agent.draining(),
            "memory": scheduling().memory(),
            "jobs": states,
        }

    @app.get("/v1/jobs")
    def jobs() -> list[dict[str, Any]]:
        """Every job, as ``torpor ps --json`` shows it, with its policy (a queued job is in /v1/queue)."""
        cares = records.cares()
        submissions = records.submissions()
        return [
            {
                **wire.status_to_dict(s, cares.get(s.job.name)),
                **wire.scheduling_fields(submissions.get(s.job.name), cares.get(s.job.name), records),
            }
            for s in engine.statuses()
        ]

    @app.post("/v1/jobs", status_code=201)
    def run(body: RunRequest) -> dict[str, Any]:
        """Start a job (with the agent's environment) and set its policy."""
        policy = care.new_policy(body.policy) if body.policy else None  # refused before anything starts
        job = engine.run(body.name, body.command, body.cwd)
        if policy is not None:
            records.set_policy(job.name, policy)
        return job_dict(job.name)

    @app.get("/v1/jobs/{name}")
    def job(name: str) -> dict[str, Any]:
        return job_dict(name)

    @app.post("/v1/jobs/{name}/checkpoint")
    def checkpoint(name: str, body: CheckpointRequest, request: Request) -> Any:
        """Checkpoint (or hibernate) a running job; with ``wait``, until its image is durable."""

        def work(progress: Progress, warn: Progress) -> dict[str, Any]:
            # what a hibernation frees (the tree's PSS: a page-table walk, so not for a checkpoint)
            before = engine.status(name).rss_bytes if body.hibernate else None
            taken = engine.checkpoint(
                name, hibernate=body.hibernate, progress=progress, warn=warn, ext_unix_sk=body.ext_unix_sk
            )
            result: dict[str, Any] = wire.checkpoint_to_dict(taken)
            costs = wire.checkpoint_costs(taken)
            if body.hibernate:
                records.mark_hibernated(taken.job, None)  # a person's: not the agent's to bring back
                result["freed_rss_bytes"] = costs["freed_bytes"] = before
            verb = "hibernate" if body.hibernate else "checkpoint"
            agent.event(taken.job, verb, "asked through the API", **costs)
            if body.wait:
                image = engine.wait_durable(taken.id, progress=progress)
                result.update(durable=True, stored_bytes=image.stored_bytes)
            return result

        return _answer(request, work)

    @app.post("/v1/jobs/{name}/restore")
    def restore(name: str, body: RestoreRequest, request: Request) -> Any:
        """Restore a job from its latest checkpoint or the one given; with ``lazy``, until all is in."""

        def work(progress: Progress, warn: Progress) -> dict[str, Any]:
            for hook in agent.before_restore:
                hook(records.job(name).name)
            job, taken, seconds = engine.restore(
                name,
                body.checkpoint,
                force=body.force,
                progress=progress,
                lazy=body.lazy,
                rewind=body.rewind,
                warn=warn,
            )
            agent.scheduling.restored(job.name)  # its marks end; a job dumped stopped goes on
            agent.event(job.name, "resume", "asked through the API", checkpoint=taken.id, restore_s=seconds)
            return {
                "job": wire.job_to_dict(job),
                "checkpoint": wire.checkpoint_to_dict(taken),
                "restore_s": seconds,
            }

        return _answer(request, work)

    @app.post("/v1/jobs/{name}/stop")
    def stop(name: str, body: StopRequest) -> dict[str, Any]:
        engine.stop(name, grace_s=body.timeout_s)
        return job_dict(name)

    @app.delete("/v1/jobs/{name}")
    def remove(name: str, force: bool = False) -> dict[str, Any]:
        """Remove a job and its checkpoints; a submitted job that waits in the queue is cancelled."""
        submission = records.submission(name)
        # queued: it has no jobs row yet (the scheduler marks a start before it creates the job)
        if submission is not None and submission.queued and scheduling().cancel(name):
            return {"job": name, "removed_checkpoints": [], "cancelled": True}
        removed = engine.remove(name, force=force)
        return {"job": name, "removed_checkpoints": removed, "cancelled": False}

    @app.get("/v1/jobs/{name}/policy")
    def get_policy(name: str) -> dict[str, Any]:
        job = records.job(name)
        return records.care(job.name).policy.to_dict()

    @app.put("/v1/jobs/{name}/policy")
    def put_policy(name: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change fields of a job's policy (``null`` unsets one); an impossible one is refused (400)."""
        return care.set_policy(records, name, changes).to_dict()

    @app.post("/v1/submit", status_code=201)
    def submit(body: SubmitBody) -> dict[str, Any]:
        """Give a job to the scheduler: it starts when its memory fits (maybe at once), else it waits."""
        request = SubmitRequest(
            command=body.command,
            cwd=body.cwd,
            env=body.env,
            umask=body.umask,
            memory=body.memory,
            name=body.name,
            cpus=body.cpus,
            priority=body.priority,
            project=body.project,
        )
        return wire.submission_to_dict(scheduling().submit(request))

    @app.get("/v1/queue")
    def queue_() -> dict[str, Any]:
        """The budget, what is held and free, and every submitted job not ended (the queued first)."""
        return scheduling().queue()

    @app.get("/v1/quotas")
    def quotas() -> dict[str, Any]:
        """The budget and each project's share, borrowing limit, and what it holds and borrows now."""
        return scheduling().quotas()

    @app.put("/v1/quotas/{project}")
    def set_quota(project: str, body: QuotaBody) -> dict[str, Any]:
        """Set a project's share (and borrowing limit); shares beyond the budget are refused (400)."""
        return wire.quota_to_dict(scheduling().set_quota(project, body.share, body.borrow_limit))

    @app.delete("/v1/quotas/{project}")
    def remove_quota(project: str) -> Any:
        if scheduling().remove_quota(project):
            return {"project": project, "removed": True}
        missing = UsageError(f"no quota for project '{project}' (see 'torpor quota show')")
        return JSONResponse(error_body(missing), status_code=404)

    @app.get("/v1/events")
    def events(
        after: int = Query(0, ge=0, description="only events with a larger id"),
        job: str | None = None,
        limit: int | None = Query(None, ge=1, le=10000, description="the newest this many"),
    ) -> list[dict[str, Any]]:
        """What torpor did by itself (and what was asked through the agent), oldest first."""
        return [wire.event_to_dict(e) for e in records.events(after, job, limit)]

    @app.post("/v1/drain")
    def drain(body: DrainRequest, request: Request) -> Any:
        """Evacuate the node: hibernate every job into the durable tier (``to_peers``: move each to a peer
        that has room, hibernate the rest), most valuable first; take no new job until ``DELETE /v1/drain``. Returns the report once all is saved or the deadline passed."""

        def work(progress: Progress, warn: Progress) -> dict[str, Any]:
            progress(f"evacuating ({body.why})")
            return agent.evacuate(body.why, BY_DRAIN, body.deadline_s, to_peers=body.to_peers).to_dict()

        return _answer(request, work)

    @app.delete("/v1/drain")
    def undrain() -> dict[str, Any]:
        """Take new jobs again and resume the jobs the evacuation hibernated."""
        return {"resumed": agent.undrain()}

    @app.get("/v1/evacuation")
    def last_evacuation() -> dict[str, Any] | None:
        report = agent.last_evacuation
        return report.to_dict() if report else None

    arrivals.add_routes(app, agent)
    metrics.add_routes(app, lambda: engine, records.events).register(agent.gpu_watch)
    web.add_routes(
        app,
        lambda: engine,
        records.events,
        lambda: {n: c.policy for n, c in records.cares().items()},
        history=lambda: {
            name: [(s.at, s.bytes) for s in ring] for name, ring in agent.history.samples().items()
        },
        queue=lambda: agent.scheduling.queue(),
        signed_in=login.signed_in,
    )
    return app


def _answer(request: Request, work: Callable[[Progress, Progress], dict[str, Any]]) -> Any:
    """``work``'s result as JSON, or, for a client that accepts NDJSON, its progress streamed first."""
    if NDJSON not in request.headers.get("accept", ""):
        return work(lambda _: None, lambda _: None)
    lines: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def run() -> None:
        try:
            lines.put(
                {"result": work(lambda t: lines.put({"progress": t}), lambda t: lines.put({"warning": t}))}
            )
        except TorporError as exc:
            lines.put({"error": error_body(exc), "status": status_of(exc)})
        except Exception as exc:
            lines.put({"error": {"error": f"{type(exc).__name__}: {exc}", "details": [], "exit_code": 1}})
        finally:
            lines.put(None)

    threading.Thread(target=run, name="torpor-agent-request", daemon=True).start()

    def stream() -> Iterator[bytes]:
        while (line := lines.get()) is not None:
            yield (json.dumps(line, default=str) + "\n").encode()

    return StreamingResponse(stream(), media_type=NDJSON)
