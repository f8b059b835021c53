"""The memory-first scheduler of one node, as pure decisions (issue 15): admit, preempt, reclaim, guard.

Memory is what AI jobs run out of; with checkpoints nobody has to be OOM-killed or killed by hand to make
room: the least valuable work is hibernated and comes back when there is room again. This package decides
who, from a frozen :class:`Snapshot` of the node; the agent gathers the snapshot, executes the actions
and shows the reasons. Its modules, each below the ones that use it::

    decision.py   one round: the rules (their spec is that module's docstring) → actions
    victims.py    the one order in which victims are chosen, and choosing the fewest that make room
    submit.py     what is refused at submit (too big, unknown project, negative priority, bad size)
    actions.py    Start, Resume, Hibernate, RaiseLimit, Wait — nothing that kills
    snapshot.py   Job, Project, Pressure, Rules, Snapshot: what a decision is made from
    sizes.py      sizes as users write them: 500M, 4G, 1.5G, 512Ki
"""

from torpor.policy.scheduler.actions import Action, Hibernate, RaiseLimit, Resume, Start, Wait
from torpor.policy.scheduler.decision import decide, effective_priority
from torpor.policy.scheduler.sizes import format_size, parse_size
from torpor.policy.scheduler.snapshot import Cause, Job, Pressure, Project, Rules, Snapshot, State
from torpor.policy.scheduler.submit import node_budget, validate_quotas, validate_submit

__all__ = [
    "Action",
    "Cause",
    "Hibernate",
    "Job",
    "Pressure",
    "Project",
    "RaiseLimit",
    "Resume",
    "Rules",
    "Snapshot",
    "Start",
    "State",
    "Wait",
    "decide",
    "effective_priority",
    "format_size",
    "node_budget",
    "parse_size",
    "validate_quotas",
    "validate_submit",
]
