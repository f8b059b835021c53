"""Setting a job's policy: checked in full when it is set, so that it is never found impossible later.

Used by the API and by the CLI alike (``torpor run --checkpoint-every``, ``torpor policy set`` with or
without an agent): the policy is written to the records, where the agent reads it at each round.
"""

from __future__ import annotations

from typing import Any

from torpor.adapters import wake
from torpor.adapters.system import procfs
from torpor.core.records import Records
from torpor.core.recordtypes import Job, JobState
from torpor.errors import UsageError
from torpor.policy.jobpolicy import JobPolicy


def set_policy(records: Records, name: str, changes: dict[str, Any]) -> JobPolicy:
    """Merge ``changes`` (fields of :class:`JobPolicy`, ``None`` unsets one) into ``name``'s policy."""
    job = records.job(name)
    current = records.care(job.name).policy
    merged = _merged(current, changes, f" for '{name}'", f"cannot set that policy on '{name}': ")
    for port in set(merged.wake_on) - set(current.wake_on):
        check_wake_port(job, port)
    records.set_policy(job.name, merged)
    return merged


def new_policy(changes: dict[str, Any]) -> JobPolicy:
    """The policy of a job about to start (the defaults with ``changes``), checked in full first."""
    policy = _merged(JobPolicy(), changes, "", "")
    for port in policy.wake_on:
        wake.check_port(port, [])
    return policy


def _merged(base: JobPolicy, changes: dict[str, Any], whose: str, refusal: str) -> JobPolicy:
    """``base`` with ``changes``, refused (UsageError) if a field is unknown or the policy impossible."""
    try:
        merged = JobPolicy.from_dict({**base.to_dict(), **changes})
    except (TypeError, ValueError) as exc:
        raise UsageError(f"bad policy{whose}: {exc}") from None
    problems = merged.problems()
    if problems:
        raise UsageError(refusal + "; ".join(problems))
    return merged


def check_wake_port(job: Job, port: int) -> None:
    """Refuse ``--wake-on PORT`` when another program listens on it: the agent could not hold it."""
    pids = procfs.namespace_members(job.pid) if job.pid and job.state == JobState.RUNNING else []
    wake.check_port(port, pids)
