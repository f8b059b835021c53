"""Policy: decisions as pure functions of plain data — no I/O, no clock reads (``now`` is an argument).

Each module takes a small frozen snapshot and returns what to do; the core gathers the snapshot, asks,
and acts. Nothing here imports torpor outside ``torpor.policy``, so a decision is tested (and later
simulated) in milliseconds without processes, CRIU or a store::

    retention.py    which checkpoints of a job to delete (keep the newest N, pinned ones stay)
    stop.py         how a job is stopped: SIGTERM, a grace period, then SIGKILL
    retry.py        whether a failed dump is tried again, and after what delay

The embedded scheduler (admit, hibernate, resume, migrate) arrives with its own issue.
"""
