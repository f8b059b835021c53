"""A typed client of the agent's API, and the engine the CLI uses when an agent runs.

``AgentClient`` speaks to the unix socket of a state directory (or a TCP address with a token) and
returns torpor's own types (:class:`~torpor.core.recordtypes.Job`,
:class:`~torpor.core.recordtypes.Checkpoint`, :class:`~torpor.core.engine.JobStatus`…); an error of the agent comes back as the error the engine raised there,
with the message and exit code the CLI would have had embedded.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import httpx

from torpor import errors
from torpor.apps.agent import wire
from torpor.apps.agent.locate import answers
from torpor.core.context import Progress, quiet
from torpor.core.engine import Engine, JobStatus
from torpor.core.recordtypes import Checkpoint, CheckpointId, Event, Job, Quota, Submission
from torpor.core.store import StoredImage
from torpor.errors import EnvironmentProblem, TorporError, UsageError
from torpor.policy.jobpolicy import JobPolicy


def unanswered(exc: httpx.TransportError) -> str:
    """Why a call over ``exc``'s connection got no answer, said as a user can act on it."""
    text = str(exc)
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time (a timeout)"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        detail = text.split("certificate verify failed:", 1)[-1].split("(_ssl", 1)[0].strip(" )")
        return (
            f"its TLS certificate is not one to trust ({detail or 'verify failed'}): "
            "give --ca-file with its certificate or its CA's"
        )
    if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text:
        return "it does not speak TLS on that port (an agent without --tls-cert?)"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "it closed the connection without an answer (an agent with --tls-cert wants https://)"
    return f"cannot connect: {text or type(exc).__name__}"


class AgentClient:
    """The agent of one state directory, over its unix socket (``uds``) or TCP (``url`` and ``token``)."""

    def __init__(
        self,
        uds: Path | None = None,
        url: str = "http://agent",
        token: str | None = None,
        timeout_s: float | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        transport = httpx.HTTPTransport(uds=str(uds)) if uds else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        connect = 5.0 if timeout_s is None else min(5.0, timeout_s)
        self.http = httpx.Client(
            transport=transport,
            base_url=url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect),
            verify=verify,
            trust_env=False,  # a peer is reached directly, never through a proxy of the environment's
        )

    @classmethod
    def if_running(cls, uds: Path) -> AgentClient | None:
        """A client of the agent listening on ``uds``, or None when no agent answers there."""
        if not answers(uds):
            return None
        client = cls(uds)
        try:
            client.http.get("/v1/health", timeout=5.0).raise_for_status()
        except (httpx.TransportError, httpx.HTTPStatusError):
            client.close()
            return None
        return client

    def close(self) -> None:
        self.http.close()

    def node(self) -> dict[str, Any]:
        """The node's name, version, draining, memory and job counts (``GET /v1/node``)."""
        try:
            answer = self._json("GET", "/v1/node")
        except ValueError:  # not JSON
            answer = None
        if not isinstance(answer, dict):
            raise EnvironmentProblem("it answered, but not as a torpor agent does (GET /v1/node)")
        return answer

    # -- calls -----------------------------------------------------------------------------------------

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            reply = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise EnvironmentProblem(f"the agent did not answer: {unanswered(exc)}") from None
        if reply.is_success:
            return reply.json()
        raise _error(reply.status_code, _body(reply))

    def _streamed(self, path: str, body: dict[str, Any], progress: Progress, warn: Progress) -> Any:
        """POST ``body``; show the progress and warnings the agent streams; return its result."""
        try:
            with self.http.stream(
                "POST", path, json=body, headers={"Accept": "application/x-ndjson"}
            ) as reply:
                if not reply.is_success:
                    reply.read()
                    raise _error(reply.status_code, _body(reply))
                for line in reply.iter_lines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if "progress" in item:
                        progress(item["progress"])
                    elif "warning" in item:
                        warn(item["warning"])
                    elif "result" in item:
                        return item["result"]
                    elif "error" in item:
                        raise _error(item.get("status", 500), item["error"])
        except httpx.TransportError as exc:
            raise EnvironmentProblem(f"the agent stopped answering ({exc})") from None
        raise EnvironmentProblem("the agent ended its answer without a result")

    def look(self, paths: list[str], ports: list[int], written: list[str] | None = None) -> dict[str, Any]:
        """The stamps of ``paths`` on the agent's machine, which of ``ports`` are taken there, and of
        ``written`` whether each one's folder is there and who owns it (``POST /v1/arrivals/look``)."""
        body = {"paths": paths, "ports": ports, "written": written or []}
        return dict(self._json("POST", "/v1/arrivals/look", json=body))

    def arrival(self, method: str, job: str, what: str = "", **kwargs: Any) -> Any:
        """A call of the routes a job moving to this agent takes (``/v1/arrivals/JOB/WHAT``)."""
        return self._json(method, f"/v1/arrivals/{_quoted(job)}" + (f"/{what}" if what else ""), **kwargs)

    def health(self) -> dict[str, Any]:
        return dict(self._json("GET", "/v1/health"))

    def jobs(self) -> list[JobStatus]:
        return [wire.status_from_dict(d) for d in self._json("GET", "/v1/jobs")]

    def job(self, name: str) -> JobStatus:
        return wire.status_from_dict(self._json("GET", f"/v1/jobs/{_quoted(name)}"))

    def run(
        self, command: list[str], name: str | None = None, cwd: str = "/", policy: JobPolicy | None = None
    ) -> Job:
        body = {"command": command, "name": name, "cwd": cwd, "policy": policy.to_dict() if policy else {}}
        return wire.job_from_dict(self._json("POST", "/v1/jobs", json=body))

    def checkpoint(
        self,
        name: str,
        hibernate: bool = False,
        ext_unix_sk: bool = False,
        wait: bool = False,
        progress: Progress = quiet,
        warn: Progress = quiet,
    ) -> dict[str, Any]:
        body = {"hibernate": hibernate, "ext_unix_sk": ext_unix_sk, "wait": wait}
        return dict(self._streamed(f"/v1/jobs/{_quoted(name)}/checkpoint", body, progress, warn))

    def restore(
        self,
        name: str,
        checkpoint: str | None = None,
        force: bool = False,
        lazy: bool = False,
        rewind: bool = False,
        progress: Progress = quiet,
        warn: Progress = quiet,
    ) -> tuple[Job, Checkpoint, float]:
        body = {"checkpoint": checkpoint, "force": force, "lazy": lazy, "rewind": rewind}
        result = self._streamed(f"/v1/jobs/{_quoted(name)}/restore", body, progress, warn)
        return (
            wire.job_from_dict(result["job"]),
            wire.checkpoint_from_dict(result["checkpoint"]),
            float(result["restore_s"]),
        )

    def stop(self, name: str, timeout_s: float | None = None) -> JobStatus:
        return wire.status_from_dict(
            self._json("POST", f"/v1/jobs/{_quoted(name)}/stop", json={"timeout_s": timeout_s})
        )

    def remove(self, name: str, force: bool = False) -> list[CheckpointId]:
        result = self._json("DELETE", f"/v1/jobs/{_quoted(name)}", params={"force": force})
        return [CheckpointId(c) for c in result["removed_checkpoints"]]

    def policy(self, name: str) -> JobPolicy:
        return JobPolicy.from_dict(self._json("GET", f"/v1/jobs/{_quoted(name)}/policy"))

    def set_policy(self, name: str, changes: dict[str, Any]) -> JobPolicy:
        return JobPolicy.from_dict(self._json("PUT", f"/v1/jobs/{_quoted(name)}/policy", json=changes))

    def events(self, after: int = 0, job: str | None = None, limit: int | None = None) -> list[Event]:
        params: dict[str, Any] = {"after": after}
        if job:
            params["job"] = job
        if limit:
            params["limit"] = limit
        return [wire.event_from_dict(e) for e in self._json("GET", "/v1/events", params=params)]

    def drain(
        self, why: str, deadline_s: float | None = None, to_peers: bool = False, progress: Progress = quiet
    ) -> dict[str, Any]:
        body = {"why": why, "deadline_s": deadline_s, "to_peers": to_peers}
        return dict(self._streamed("/v1/drain", body, progress, quiet))

    def undrain(self) -> list[str]:
        return list(self._json("DELETE", "/v1/drain")["resumed"])

    # -- the scheduler's ---------------------------------------------------------------------------------

    def submit(
        self,
        command: list[str],
        *,
        memory: str | int,
        cwd: str,
        env: dict[str, str],
        umask: int,
        name: str | None = None,
        cpus: float = 1.0,
        priority: int = 0,
        project: str = "default",
    ) -> Submission:
        """Queue ``command`` for the scheduler; it starts in ``env``, ``cwd`` and ``umask`` once it fits.

        A submission the scheduler refuses (too large for the budget, an unknown project, a negative
        priority, a malformed size, a name in use) raises UsageError with every problem in one line.
        """
        body = {
            "command": command,
            "memory": memory,
            "cwd": cwd,
            "env": env,
            "umask": umask,
            "name": name,
            "cpus": cpus,
            "priority": priority,
            "project": project,
        }
        return wire.submission_from_dict(self._json("POST", "/v1/submit", json=body))

    def queue(self) -> dict[str, Any]:
        """The node's budget, what is held and free, and every submitted job not ended (``GET /v1/queue``)."""
        return dict(self._json("GET", "/v1/queue"))

    def quotas(self) -> dict[str, Any]:
        """The budget and each project's share, borrowing limit, and what it holds and borrows now."""
        return dict(self._json("GET", "/v1/quotas"))

    def set_quota(self, project: str, share: str | int, borrow_limit: str | int | None = None) -> Quota:
        """Give ``project`` a guaranteed ``share``; it may borrow up to ``borrow_limit`` more (None: any)."""
        body = {"share": share, "borrow_limit": borrow_limit}
        return wire.quota_from_dict(self._json("PUT", f"/v1/quotas/{_quoted(project)}", json=body))

    def remove_quota(self, project: str) -> None:
        """Drop ``project``'s quota; UsageError when it has none."""
        self._json("DELETE", f"/v1/quotas/{_quoted(project)}")

    def remove_job(self, name: str, force: bool = False) -> dict[str, Any]:
        """Remove a job, or cancel it if it waits in the queue: ``{"removed_checkpoints", "cancelled"}``."""
        return dict(self._json("DELETE", f"/v1/jobs/{_quoted(name)}", params={"force": force}))


class RemoteEngine:
    """The engine the CLI drives when an agent runs: its operations go to the agent, the rest stays local.

    It offers the :class:`~torpor.core.engine.Engine` methods the CLI's commands call, with the same
    arguments and results, so a command reads the same whichever runs it. What only reads the state
    directory (logs, checkpoints, the store) is the local engine's.
    """

    def __init__(self, client: AgentClient, local: Engine) -> None:
        self.client = client
        self.local = local

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def status(self, name: str) -> JobStatus:
        return self.client.job(name)

    def statuses(self) -> list[JobStatus]:
        return self.client.jobs()

    def checkpoint(
        self,
        name: str,
        hibernate: bool = False,
        progress: Progress = quiet,
        warn: Progress = quiet,
        ext_unix_sk: bool = False,
    ) -> Checkpoint:
        result = self.client.checkpoint(name, hibernate, ext_unix_sk, progress=progress, warn=warn)
        return wire.checkpoint_from_dict(result)

    def wait_durable(self, checkpoint_id: CheckpointId, progress: Progress = quiet) -> StoredImage:
        return self.local.wait_durable(checkpoint_id, progress)

    def restore(
        self,
        name: str,
        ref: str | None = None,
        force: bool = False,
        progress: Progress = quiet,
        lazy: bool = False,
        rewind: bool = False,
        warn: Progress = quiet,
    ) -> tuple[Job, Checkpoint, float]:
        # a lazy restore returns at once; the CLI then waits for the rest itself (wait_lazy, local)
        return self.client.restore(name, ref, force, lazy=lazy, rewind=rewind, progress=progress, warn=warn)

    def stop(self, name: str, grace_s: float | None = None) -> Job:
        return self.client.stop(name, grace_s).job

    def remove(self, name: str, force: bool = False) -> list[CheckpointId]:
        return self.client.remove(name, force)

    def remove_or_cancel(self, name: str, force: bool = False) -> list[CheckpointId] | None:
        """Remove a job (its checkpoints' ids), or, when it waits in the queue, cancel it (None)."""
        result = self.client.remove_job(name, force)
        if result.get("cancelled"):
            return None
        return [CheckpointId(c) for c in result["removed_checkpoints"]]


def _quoted(name: str) -> str:
    return httpx.URL(path=name).raw_path.decode()


def _body(reply: httpx.Response) -> dict[str, Any]:
    try:
        data = reply.json()
    except ValueError:
        first = next((line.strip() for line in reply.text.splitlines() if line.strip()), "")[:80]
        return {
            "error": f"HTTP {reply.status_code}, not the answer of a torpor agent"
            + (f": {first}" if first else "")
        }
    if isinstance(data, dict) and "error" in data:
        return data
    if isinstance(data, dict) and "detail" in data:  # FastAPI's own (a request that fails validation)
        return {"error": _validation_text(data["detail"]), "exit_code": 2}
    return {"error": str(data)}


def _validation_text(detail: Any) -> str:
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" for d in detail)
    return str(detail)


def _error(status: int, body: dict[str, Any]) -> TorporError:
    """The agent's error as the class the engine raised (its exit code with it); FastAPI's own (a body of
    the wrong shape, 422) and a refused token (401) as bad input."""
    details = [str(d) for d in body.get("details", [])]
    if "kind" in body:
        return errors.from_dict({"error": body["kind"], "message": body.get("error"), "details": details})
    if 400 <= status < 500:
        return UsageError(str(body.get("error")), details=details)
    return TorporError(str(body.get("error")), details=details)
