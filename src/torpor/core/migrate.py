"""What a move of a job to a peer needs to know before the job is frozen (issue 30, part 4), on both
sides: :func:`job_facts` on the source, from /proc of the running tree, and :func:`look` on the peer,
which the source asks through ``POST /v1/arrivals/look``; :func:`torpor.policy.migration.refusals`
decides from both. Moving the job itself (``torpor migrate`` without ``--check``) is not built yet.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from torpor.adapters.gpu import NVIDIA_DEVICE_PREFIX
from torpor.adapters.system import procfs, sockets
from torpor.core.engine import Engine
from torpor.core.recordtypes import JobState
from torpor.errors import WrongState
from torpor.policy.migration import Job, Stamp

#: what a peer is asked about at most (a job with more open files is unusual; the rest are not compared)
MAX_LOOKED_AT = 10_000


def job_facts(engine: Engine, name: str) -> Job:
    """What :func:`~torpor.policy.migration.refusals` needs of the running job ``name``: its memory (the
    tree's PSS), the files it maps or reads (its program, libraries, data it reads on) with their size
    and modification time here, the TCP ports it listens on, its established TCP connections, whether
    it uses a GPU. WrongState if it is not running."""
    status = engine.status(name)
    job = status.job
    if job.state != JobState.RUNNING or not job.pid:
        raise WrongState(f"job '{job.name}' is {job.state}: only a running job can be checked for a move")
    pids = procfs.namespace_members(job.pid)
    log = os.path.realpath(job.log_path)
    read = {path: stamp for path, stamp in stamps(procfs.program_files(pids)).items() if path != log}
    return Job(
        name=job.name,
        memory=status.rss_bytes or 0,
        read_files={path: stamp for path, stamp in read.items() if stamp is not None},
        listens=sorted({address.port for address in sockets.listening_sockets(pids)}),
        connections=sockets.established_connections(pids),
        gpu=procfs.uses_device(pids, NVIDIA_DEVICE_PREFIX),
    )


def stamps(paths: Iterable[str]) -> dict[str, Stamp | None]:
    """Each regular file of ``paths`` with its (size, modification time in ns) here; None: not here, or
    not a regular file."""
    found: dict[str, Stamp | None] = {}
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            found[path] = None
            continue
        found[path] = (info.st_size, info.st_mtime_ns) if os.path.isfile(path) else None
    return found


def look(paths: list[str], ports: list[int]) -> dict[str, Any]:
    """What the peer answers ``POST /v1/arrivals/look``: the stamps of ``paths`` here (None: missing)
    and which of ``ports`` a process of this network namespace listens on."""
    if len(paths) > MAX_LOOKED_AT or len(ports) > MAX_LOOKED_AT:
        raise ValueError(f"at most {MAX_LOOKED_AT} files and ports are looked at")
    taken = sorted({port for port in ports if sockets.port_listeners(port)})
    return {
        "stamps": {path: list(stamp) if stamp else None for path, stamp in stamps(paths).items()},
        "ports_taken": taken,
    }
