"""Starting a launcher from the CLI, detached: nobody's child, in a session of its own.

It is forked from the CLI, which has imported all it needs already (a millisecond instead of the ~0.1 s
a new interpreter needs to import torpor); a caller with other threads running gets a new interpreter
instead (forking a threaded process can deadlock). What the two then say to each other is
:mod:`torpor.core.launcher.protocol`'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from torpor.adapters.system import private
from torpor.core.launcher import server
from torpor.core.launcher.protocol import LauncherEnds, LaunchSpec, PendingLauncher

#: launchers started as new interpreters (by a caller with threads), reaped as later ones start
_spawned: list[subprocess.Popen[bytes]] = []


def start_launcher(spec: LaunchSpec, log: Path) -> PendingLauncher:
    """Start a detached launcher that opens its state, then waits for :meth:`PendingLauncher.release`.

    A restore starts it before fetching the image, so the launcher's start-up overlaps the fetch.
    """
    pending, ends = PendingLauncher.open_pipes(spec.job, log)
    try:
        if threading.active_count() == 1:
            _fork(spec, log, ends)
        else:
            _spawn(spec, log, ends)
    except BaseException:
        pending.close()
        raise
    finally:
        ends.close()  # the launcher has its own copies now
    return pending


def _spawn(spec: LaunchSpec, log: Path, ends: LauncherEnds) -> None:
    """A new interpreter running ``python -m torpor.core.launcher``, its output into the launcher's log."""
    global _spawned
    _spawned = [child for child in _spawned if child.poll() is None]  # reaps exited ones
    with os.fdopen(private.open_private(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as log_file:
        child = subprocess.Popen(
            [sys.executable, "-m", "torpor.core.launcher", spec.to_json(), *(str(fd) for fd in ends.fds)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=ends.fds,
            close_fds=True,
        )
    _spawned.append(child)


def _fork(spec: LaunchSpec, log: Path, ends: LauncherEnds) -> None:
    """Fork twice (the launcher is nobody's child here, so it never lingers as a zombie of ours)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    middle = os.fork()
    if middle == 0:  # pragma: no cover - child side
        code = 1
        try:
            os.setsid()
            code = server.forked(spec, log, ends) if os.fork() == 0 else 0
        except BaseException:
            traceback.print_exc()  # into the launcher's log, once forked() redirected stderr
        finally:
            os._exit(code)
    os.waitpid(middle, 0)
