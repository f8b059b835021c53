"""The JSON forms of jobs, checkpoints, images, events, submissions and quotas: what the API sends, the
client reads.

The same dictionaries are what ``torpor ps --json`` and the other ``--json`` outputs print, so a script
reads one shape whether the CLI worked embedded or through the agent.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from torpor.core.engine import JobStatus
from torpor.core.records import Records
from torpor.core.recordtypes import (
    Care,
    Checkpoint,
    CheckpointId,
    CheckpointKind,
    Event,
    Job,
    JobName,
    JobState,
    Quota,
    Submission,
    rounds_from,
)


def status_to_dict(status: JobStatus, care: Care | None = None) -> dict[str, Any]:
    data = job_to_dict(status.job)
    data["rss_bytes"] = status.rss_bytes
    data["last_checkpoint"] = checkpoint_to_dict(status.last_checkpoint) if status.last_checkpoint else None
    if care is not None:
        data["policy"] = care.policy.to_dict()
        data["hibernated_by"] = care.hibernated_by
    return data


def status_from_dict(data: dict[str, Any]) -> JobStatus:
    last = data.get("last_checkpoint")
    return JobStatus(job_from_dict(data), data.get("rss_bytes"), checkpoint_from_dict(last) if last else None)


def job_from_dict(data: dict[str, Any]) -> Job:
    values = {f.name: data[f.name] for f in fields(Job)}
    values["name"] = JobName(values["name"])
    values["state"] = JobState(values["state"])
    return Job(**values)


def checkpoint_to_dict(checkpoint: Checkpoint) -> dict[str, Any]:
    data = asdict(checkpoint)
    data["kind"] = str(checkpoint.kind)
    return data


def checkpoint_from_dict(data: dict[str, Any]) -> Checkpoint:
    values = {f.name: data[f.name] for f in fields(Checkpoint) if f.name != "rounds"}
    values["id"] = CheckpointId(values["id"])
    values["job"] = JobName(values["job"])
    values["kind"] = CheckpointKind(values["kind"])
    return Checkpoint(**values, rounds=rounds_from(data.get("rounds")))


def checkpoint_costs(checkpoint: Checkpoint) -> dict[str, Any]:
    """What an event of a checkpoint records of it: which one, and its freeze, total time and size, and
    what a pre-copy copied while the job ran (in how many rounds)."""
    return {
        "checkpoint": checkpoint.id,
        "freeze_s": checkpoint.freeze_s,
        "total_s": checkpoint.total_s,
        "size_bytes": checkpoint.size_bytes,
        **(
            {"precopied_bytes": checkpoint.precopied_bytes, "rounds": len(checkpoint.rounds)}
            if checkpoint.rounds
            else {}
        ),
    }


def event_to_dict(event: Event) -> dict[str, Any]:
    return asdict(event)


def event_from_dict(data: dict[str, Any]) -> Event:
    job = data.get("job")
    return Event(
        data["id"], data["at"], JobName(job) if job else None, data["action"], data["reason"], data["detail"]
    )


def job_to_dict(job: Job) -> dict[str, Any]:
    data = asdict(job)
    data["state"] = str(job.state)
    return data


def submission_to_dict(submission: Submission) -> dict[str, Any]:
    """A submission as ``torpor submit --json`` prints it: all but its environment.

    The environment is the submitter's (tokens and passwords often live there): the agent keeps it in the
    private records to start the job in it, and never sends it back out.
    """
    data = asdict(submission)
    del data["env"]
    return data


def submission_from_dict(data: dict[str, Any]) -> Submission:
    values = {f.name: data[f.name] for f in fields(Submission) if f.name in data}
    values["name"] = JobName(values["name"])
    values.setdefault("env", {})
    return Submission(**values)


def quota_to_dict(quota: Quota) -> dict[str, Any]:
    return asdict(quota)


def quota_from_dict(data: dict[str, Any]) -> Quota:
    return Quota(str(data["project"]), int(data["share"]), data.get("borrow_limit"))


#: the causes of the scheduler's hibernations (``Care.hibernated_by``; policy.scheduler.Cause)
SCHEDULER_CAUSES = frozenset({"preempted", "reclaimed", "guard"})


def scheduling_fields(
    submission: Submission | None, care: Care | None, records: Records | None = None
) -> dict[str, Any]:
    """What ``torpor ps --json`` says of a job's scheduling: its request, cgroup limit, priority and
    project (None for a job started with ``torpor run``), why it was hibernated (``hibernated_by``, and
    with ``records``, the scheduler's reason then: ``hibernation``), and the scheduler's last word on it
    (``why``: for a hibernated job, why it has not come back yet)."""
    by = care.hibernated_by if care else None
    return {
        "request": submission.memory if submission else None,
        "limit": submission.mem_limit if submission else None,
        "priority": submission.priority if submission else None,
        "project": submission.project if submission else None,
        "hibernated_by": by,
        "hibernation": hibernation_reason(records, submission.name)
        if records is not None and submission is not None and by in SCHEDULER_CAUSES
        else None,
        "why": submission.why if submission else None,
    }


def hibernation_reason(records: Records, name: str) -> str | None:
    """The reason of the scheduler's last hibernation of ``name`` (``preempted by big (priority 5 > 0)``),
    from its events: the submission's ``why`` moves on to why the job waits to come back."""
    for event in reversed(records.events(0, name, 100)):
        if event.action == "hibernate" and "error" not in event.detail and "skipped" not in event.detail:
            return event.reason
    return None
