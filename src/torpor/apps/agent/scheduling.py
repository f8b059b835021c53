"""A stand-in with the interface the lead announced (the lead's scheduling.py replaces it at the merge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torpor.core.records import Quota, Submission


@dataclass(frozen=True)
class SubmitRequest:
    command: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    umask: int = 0o022
    memory: str | int = 0
    name: str | None = None
    cpus: float = 1.0
    priority: int = 0
    project: str = "default"


class Scheduling:
    def submit(self, request: SubmitRequest) -> Submission:
        raise NotImplementedError

    def queue(self) -> dict[str, Any]:
        raise NotImplementedError

    def quotas(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_quota(self, project: str, share: str | int, borrow_limit: str | int | None) -> Quota:
        raise NotImplementedError

    def remove_quota(self, project: str) -> bool:
        raise NotImplementedError

    def describe(self, name: str) -> dict[str, Any] | None:
        raise NotImplementedError

    def cancel(self, name: str) -> bool:
        raise NotImplementedError
