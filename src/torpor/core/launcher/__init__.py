"""The launcher: one small process per job incarnation that supervises the job and takes its commands.

Three modules, so that each end of every conversation with a launcher lives in one place::

    protocol.py   the launch spec and the ready/go/life pipes between the CLI and a new launcher (both ends)
    spawn.py      starting a launcher from the CLI: forked, or a new interpreter when the CLI has threads
    server.py     the launcher itself: starts or restores the job, records its end, serves the control socket

The control socket's requests and replies are :mod:`torpor.core.control`'s; what a checkpoint or a
restore does inside the launcher is :mod:`torpor.core.checkpoint`'s and :mod:`torpor.core.restore`'s.
``python -m torpor.core.launcher`` runs :func:`torpor.core.launcher.server.main`.
"""
