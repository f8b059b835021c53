"""Policy: torpor's decisions, as pure functions of plain data — when, whom, which, where; never how.

What belongs here: a decision that the core or an app would otherwise make in the middle of its I/O.
Each takes a small frozen snapshot (dataclasses defined here: ids, states as strings or enums of its own,
sizes, times) and returns what to do, with what could not be done (a ``fits: False``, a reason) rather
than silently less. ``now`` is an argument, never read; nothing here opens a file, starts a process,
reads the environment or the database, or raises torpor's errors: the caller gathers the snapshot, asks,
and acts (and says what it did). So each decision has tests that build a snapshot in a line and run in
milliseconds, and can be simulated over thousands of jobs.

What does not: the order of operations and its invariants (checkpoint, restore, the store: the core),
talking to a system (the adapters), parsing and rendering (the apps). Nothing here imports torpor outside
``torpor.policy`` — pyproject.toml's import contracts keep it so — so both the core and the apps call it::

    hot.py          which hot copies leave RAM once an image is durable, and which go to make room
    slurm.py        what a restarted Slurm job restores, when it starts cold, whether to requeue
    retention.py    which checkpoints of a job to delete (keep the newest N, pinned ones stay)
    stop.py         how a job is stopped: SIGTERM, a grace period, then SIGKILL
    retry.py        whether a failed dump is tried again, and after what delay
    rewind.py       what a restore does with each file the job writes: leave, cut back, or refuse
    notices.py      what a cloud's metadata service answered: a spot, preemption or maintenance notice
    evacuation.py   which jobs to save before the machine goes, in which order; what was saved
    precopy.py      when a pre-copied checkpoint's rounds stop and the job is frozen (no caller yet)
    scheduler/      the memory-first scheduler of one node: admit, preempt, reclaim borrowed quota,
                    the memory guard (hibernate before the OOM killer), limit raises, submit checks
"""
