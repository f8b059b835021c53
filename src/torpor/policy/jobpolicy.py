"""What the agent is asked to do for a job by itself, and durations as users write them (``30s``, ``10m``).

A :class:`JobPolicy` is plain data, kept in the records beside the job (``torpor run --checkpoint-every``,
``torpor policy set``) and read by the agent at each of its rounds; the decisions it feeds are
:mod:`torpor.policy.periodic` and :mod:`torpor.policy.idle`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")

#: the share of a job's time its periodic checkpoints may keep it frozen, when the policy gives none
DEFAULT_BUDGET = 0.02


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``30s``, ``10m``, ``2h``, ``1d``, ``500ms``, or units together (``1h30m``).

    A bare number is refused: ``10`` could mean seconds or minutes, and a wrong guess checkpoints a job
    sixty times too often. Raises ValueError with a message for the user.
    """
    spec = text.strip().lower()
    if not spec or _DURATION.sub("", spec):
        raise ValueError(
            f"'{text}' is not a duration: write a number and a unit, e.g. 30s, 10m, 2h, 1d (or 1h30m)"
        )
    seconds = sum(float(number) * _UNITS[unit] for number, unit in _DURATION.findall(spec))
    if seconds <= 0:
        raise ValueError(f"'{text}' is not a duration longer than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` the way :func:`parse_duration` reads it back, in the largest unit that fits exactly."""
    for unit in ("d", "h", "m", "s"):
        size = _UNITS[unit]
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    return f"{seconds:g}s" if seconds >= 1 else f"{seconds * 1000:g}ms"


@dataclass(frozen=True)
class JobPolicy:
    """A job's automatic care; every field unset (``None``, empty) means the agent leaves that alone."""

    #: checkpoint the job this often (stretched to respect ``budget``)
    checkpoint_every_s: float | None = None
    #: the share of the job's time periodic checkpoints may freeze it (0.02: 2 %)
    budget: float = DEFAULT_BUDGET
    #: how many of its checkpoints to keep (the newest; pinned ones on top); None: the store's keep_last
    keep: int | None = None
    #: hibernate the job once its processes used (almost) no CPU for this long
    idle_after_s: float | None = None
    #: TCP ports on which the agent listens while the job is hibernated: a connection resumes it
    wake_on: tuple[int, ...] = field(default_factory=tuple)
    #: higher is more valuable: saved first when the node is evacuated
    priority: int = 0

    def problems(self) -> list[str]:
        """What makes this policy impossible to honour, one line each; empty when it is fine."""
        found = []
        if self.checkpoint_every_s is not None and self.checkpoint_every_s < 1:
            found.append("--checkpoint-every must be at least 1s")
        if not 0 < self.budget <= 0.5:
            found.append(f"the overhead budget must be above 0 and at most 50 % (got {self.budget:g})")
        if self.keep is not None and self.keep < 1:
            found.append("--keep must be at least 1")
        if self.idle_after_s is not None and self.idle_after_s < 1:
            found.append("--idle-after must be at least 1s")
        for port in self.wake_on:
            if not 0 < port < 65536:
                found.append(f"--wake-on {port}: a TCP port is 1 to 65535")
        if len(set(self.wake_on)) != len(self.wake_on):
            found.append("--wake-on names a port twice")
        if self.wake_on and self.idle_after_s is None:
            found.append("--wake-on wakes a job that was hibernated when idle: give --idle-after too")
        return found

    @property
    def is_empty(self) -> bool:
        return self == JobPolicy(budget=self.budget, priority=self.priority)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["wake_on"] = list(self.wake_on)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobPolicy:
        """The policy in ``data`` (its JSON form); unknown keys are refused with ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown policy field(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        values = dict(data)
        if "wake_on" in values:
            values["wake_on"] = tuple(int(port) for port in values["wake_on"] or ())
        return replace(cls(), **values)

    def describe(self) -> str:
        """One line for ``torpor ps`` and the agent's page: ``checkpoint every 10m (keep 3), idle 15m…``."""
        parts = []
        if self.checkpoint_every_s is not None:
            keep = f", keep {self.keep}" if self.keep is not None else ""
            parts.append(f"checkpoint every {format_duration(self.checkpoint_every_s)}{keep}")
        elif self.keep is not None:
            parts.append(f"keep {self.keep}")
        if self.idle_after_s is not None:
            parts.append(f"hibernate after {format_duration(self.idle_after_s)} idle")
        if self.wake_on:
            parts.append("wake on port " + ",".join(str(p) for p in self.wake_on))
        if self.priority:
            parts.append(f"priority {self.priority}")
        return "; ".join(parts) or "-"
