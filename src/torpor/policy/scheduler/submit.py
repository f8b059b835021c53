"""What ``torpor submit`` and ``torpor quota set`` refuse, as one line each, before anything is queued.

A job that can never start (its request is larger than the whole budget, or its project is unknown)
would wait forever in the queue with nobody told why; a negative priority or a malformed size is a typo.
The agent refuses them at submit with these messages (it raises its own UsageError with them).
"""

from __future__ import annotations

from collections.abc import Mapping

from torpor.policy.scheduler.sizes import format_size, parse_size
from torpor.policy.scheduler.snapshot import Project


def validate_submit(
    memory: str | int, *, priority: int, project: str, budget: int, projects: Mapping[str, Project]
) -> list[str]:
    """What makes this submission impossible, one line each; empty when it may be queued.

    ``memory`` is ``--memory`` as written (or bytes); with no quotas (``projects`` empty) any project
    name is accepted: there is one pool. A request above the project's share is accepted: it borrows.
    """
    problems = []
    request: int | None
    if isinstance(memory, int):
        request = memory
    else:
        try:
            request = parse_size(memory)
        except ValueError as exc:
            problems.append(f"--memory: {exc}")
            request = None
    if request is not None and request <= 0:
        problems.append("--memory must be more than 0: say how much memory the job needs, e.g. 4G")
    elif request is not None and request > budget:
        problems.append(
            f"--memory {format_size(request)} is larger than this node's whole budget "
            f"({format_size(budget)}): the job could never start"
        )
    if priority < 0:
        problems.append(f"--priority {priority}: a priority is 0 or more (higher is more important)")
    if projects and project not in projects:
        known = ", ".join(sorted(projects))
        problems.append(f"unknown project '{project}': the projects with a quota are {known}")
    return problems


def validate_quotas(projects: Mapping[str, Project], budget: int) -> list[str]:
    """What makes a set of quotas impossible to honour, one line each: their shares must fit the budget."""
    problems = []
    for name, project in sorted(projects.items()):
        if project.share < 0:
            problems.append(f"project {name}: a share is 0 or more")
        if project.borrow_limit is not None and project.borrow_limit < 0:
            problems.append(f"project {name}: a borrowing limit is 0 or more")
    total = sum(p.share for p in projects.values())
    if total > budget:
        problems.append(
            f"the shares add up to {format_size(total)}, more than the budget {format_size(budget)}: "
            "a guarantee beyond the budget cannot be kept"
        )
    return problems


def node_budget(total: int, budget: int | None, reserve: int | None) -> tuple[int, int]:
    """The node's memory budget and the reserve it leaves the machine, from ``torpor agent``'s flags.

    ``budget`` given: that (the reserve is what is left of ``total``); else ``total`` less ``reserve``
    (default: a tenth of the machine, at least :data:`MIN_RESERVE`). Both given must fit in ``total``.
    Raises ValueError with the one-line reason.
    """
    if budget is not None and budget <= 0:
        raise ValueError("--memory-budget must be more than 0")
    if reserve is not None and reserve < 0:
        raise ValueError("--memory-reserve must be 0 or more")
    if budget is None:
        reserve = max(total // 10, MIN_RESERVE) if reserve is None else reserve
        if reserve >= total:
            raise ValueError(
                f"--memory-reserve {format_size(reserve)} leaves nothing of this machine's {format_size(total)}"
            )
        return total - reserve, reserve
    if budget + (reserve or 0) > total:
        raise ValueError(
            f"--memory-budget {format_size(budget)}"
            + (f" and --memory-reserve {format_size(reserve)}" if reserve else "")
            + f" are more than this machine's memory ({format_size(total)})"
        )
    return budget, total - budget


#: the least memory the budget leaves to the machine when no reserve is given (3 GiB: above the
#: guard's calm level, 2 GiB by default, so that a full budget does not read as a node short of memory)
MIN_RESERVE = 3 << 30
