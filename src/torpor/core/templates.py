"""Templates: checkpoints kept as start points, and where the jobs started from them come from.

A template is made from a checkpoint of a running job (``torpor template save``, or by the job's
launcher once a ``--warm-start`` job is ready): the checkpoint leaves its job's list, so that retention
and ``torpor rm`` of the job never touch it, and its image stays in the store under the same id until
``torpor template rm``. With it are kept what a start from it needs to know: the command and folder it
ran, the log its image writes to (a job started from it gets its own), the TCP addresses it listened on,
and the stamps of the files that make the program what it is (:func:`program_stamps`), so that a start
after one of them changed runs cold instead (:func:`torpor.policy.warmstart.stale_reasons`).

Starting a job from a template is :mod:`torpor.core.cloning`'s.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from torpor.adapters.criuimage import tcp_listeners
from torpor.adapters.system import procfs, sockets
from torpor.core.records import Records
from torpor.core.recordtypes import Checkpoint, CheckpointId, Job, JobName, Origin, Template
from torpor.errors import CheckpointNotFound, TemplateNotFound, UsageError
from torpor.policy.warmstart import FileStamp, stale_reasons, stale_summary

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_template_name(name: str) -> str:
    """A template's name, as a job's: 1 to 64 letters, digits, dots, dashes and underscores."""
    if not 1 <= len(name) <= 64 or not set(name) <= _NAME_CHARS or name.startswith((".", "-")):
        raise UsageError(
            f"invalid template name {name!r}: use 1-64 letters, digits, '.', '_' or '-', not starting "
            "with '.' or '-'"
        )
    return name


def stamp(path: str) -> FileStamp | None:
    """What ``path`` is now (None: gone, or not a regular file)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if not os.path.isfile(path):
        return None
    return FileStamp(path, info.st_size, info.st_mtime_ns, info.st_ino)


def program_stamps(job: Job, pids: list[int]) -> tuple[FileStamp, ...]:
    """The stamps of the files that make ``job``'s running program what it is: what its processes
    have mapped or open read-only, and the files its command names (a script is read and closed)."""
    paths = set(procfs.program_files(pids))
    for word in job.command:
        if word.startswith("-"):
            continue
        candidate = word if os.path.isabs(word) else os.path.join(job.cwd, word)
        if os.path.isfile(candidate):
            paths.add(os.path.normpath(candidate))
    paths.discard(job.log_path)
    stamps = (stamp(path) for path in sorted(paths))
    return tuple(s for s in stamps if s is not None)


def stamps_now(template: Template) -> dict[str, FileStamp | None]:
    return {saved.path: stamp(saved.path) for saved in template.files}


def program_of(job: Job, pids: list[int]) -> tuple[tuple[FileStamp, ...], tuple[tuple[str, int], ...]]:
    """What a template of running ``job`` (its processes ``pids``) remembers of it, read before its
    checkpoint: the stamps of its program's files, and the TCP addresses it listens on."""
    listens = tuple((address.host, address.port) for address in sockets.listening_sockets(pids))
    return program_stamps(job, pids), listens


class Templates:
    """The templates and the jobs' origins, in the state directory's records (``torpor.db``)."""

    def __init__(self, records: Records) -> None:
        self.records = records

    # -- templates ------------------------------------------------------------------------------------

    def adopt(
        self,
        name: str,
        checkpoint: Checkpoint,
        job: Job,
        files: tuple[FileStamp, ...],
        listens: tuple[tuple[str, int], ...],
        ready_when: str | None = None,
        replace: bool = False,
    ) -> tuple[Template, CheckpointId | None]:
        """Make ``checkpoint`` of ``job`` the template ``name``: it leaves the job's checkpoints in the
        same transaction. ``replace``: an older template of that name gives way (its checkpoint's id is
        returned, for the caller to delete its image); otherwise a template of that name is refused."""
        template = Template(
            name=name,
            checkpoint=checkpoint.id,
            source_job=job.name,
            created_at=checkpoint.created_at,
            size_bytes=checkpoint.size_bytes,
            freeze_s=checkpoint.freeze_s,
            criu_version=checkpoint.criu_version,
            command=job.command,
            cwd=job.cwd,
            log_path=job.log_path,
            files=files,
            listens=listens,
            ready_when=ready_when,
            own_network=(origin := self.origin(job.name)) is not None and origin.address is not None,
        )
        with self.records.transaction() as db:
            old = db.execute("SELECT checkpoint FROM templates WHERE name=?", (name,)).fetchone()
            if old is not None and not replace:
                raise UsageError(f"a template named '{name}' exists: 'torpor template rm {name}' first")
            db.execute("DELETE FROM templates WHERE name=?", (name,))
            db.execute("DELETE FROM checkpoints WHERE id=?", (checkpoint.id,))
            db.execute(
                "INSERT INTO templates(name, checkpoint, source_job, created_at, size_bytes, freeze_s,"
                " criu_version, command, cwd, log_path, files, listens, ready_when, own_network)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    name,
                    checkpoint.id,
                    job.name,
                    checkpoint.created_at,
                    checkpoint.size_bytes,
                    checkpoint.freeze_s,
                    checkpoint.criu_version,
                    json.dumps(job.command),
                    job.cwd,
                    job.log_path,
                    json.dumps([f.to_list() for f in files]),
                    json.dumps([list(address) for address in listens]),
                    ready_when,
                    int(template.own_network),
                ),
            )
        return template, None if old is None else CheckpointId(old["checkpoint"])

    def get(self, name: str) -> Template:
        with self.records.transaction() as db:
            row = db.execute("SELECT * FROM templates WHERE name=?", (name,)).fetchone()
        if row is None:
            raise TemplateNotFound(f"no template named '{name}' (see 'torpor template ls')")
        return _template(row)

    def find(self, name: str) -> Template | None:
        try:
            return self.get(name)
        except TemplateNotFound:
            return None

    def all(self) -> list[Template]:
        with self.records.transaction() as db:
            rows = db.execute("SELECT * FROM templates ORDER BY created_at").fetchall()
        return [_template(row) for row in rows]

    def delete(self, name: str, checkpoint: CheckpointId | None = None) -> None:
        """Forget template ``name`` (only while it is still the one of ``checkpoint``, when given)."""
        with self.records.transaction() as db:
            if checkpoint is None:
                db.execute("DELETE FROM templates WHERE name=?", (name,))
            else:
                db.execute("DELETE FROM templates WHERE name=? AND checkpoint=?", (name, checkpoint))

    def users(self, name: str) -> list[JobName]:
        """The jobs that were started from template ``name`` and are still on record."""
        with self.records.transaction() as db:
            rows = db.execute("SELECT job FROM origins WHERE template=?", (name,)).fetchall()
        return [JobName(row["job"]) for row in rows]

    # -- origins --------------------------------------------------------------------------------------

    def set_origin(self, origin: Origin) -> None:
        with self.records.transaction() as db:
            db.execute(
                "INSERT INTO origins(job, template, warm, ready_when, address) VALUES (?,?,?,?,?)"
                " ON CONFLICT(job) DO UPDATE SET template=excluded.template, warm=excluded.warm,"
                " ready_when=excluded.ready_when, address=excluded.address",
                (origin.job, origin.template, origin.warm, origin.ready_when, origin.address),
            )

    def origin(self, job: str) -> Origin | None:
        with self.records.transaction() as db:
            row = db.execute("SELECT * FROM origins WHERE job=?", (job,)).fetchone()
        return None if row is None else _origin(row)

    def origins(self) -> dict[JobName, Origin]:
        with self.records.transaction() as db:
            rows = db.execute("SELECT * FROM origins").fetchall()
        return {JobName(row["job"]): _origin(row) for row in rows}

    def addresses(self) -> set[str]:
        """The addresses of the jobs that have a network of their own."""
        with self.records.transaction() as db:
            rows = db.execute("SELECT address FROM origins WHERE address IS NOT NULL").fetchall()
        return {row["address"] for row in rows}


def _template(row: sqlite3.Row) -> Template:
    return Template(
        name=row["name"],
        checkpoint=CheckpointId(row["checkpoint"]),
        source_job=JobName(row["source_job"]),
        created_at=row["created_at"],
        size_bytes=row["size_bytes"],
        freeze_s=row["freeze_s"],
        criu_version=row["criu_version"],
        command=json.loads(row["command"]),
        cwd=row["cwd"],
        log_path=row["log_path"],
        files=tuple(FileStamp.from_list(raw) for raw in json.loads(row["files"])),
        listens=tuple((str(host), int(port)) for host, port in json.loads(row["listens"])),
        ready_when=row["ready_when"],
        own_network=bool(row["own_network"]),
    )


def _origin(row: sqlite3.Row) -> Origin:
    return Origin(
        job=JobName(row["job"]),
        template=row["template"],
        warm=row["warm"],
        ready_when=row["ready_when"],
        address=row["address"],
    )


def refuse_taken_ports(image_dir: Path, template: Template) -> None:
    """Refuse a copy whose server would listen on a port that something here listens on already.

    CRIU would bind it all the same (it restores sockets with the kernel's forced reuse), and the copy
    would listen without ever being connected to. A socket the program made with SO_REUSEPORT shares its
    port with the others that did, as the program asked: that one is let through.
    """
    for listener in tcp_listeners(image_dir):
        if listener.reuseport:
            continue
        holders = sockets.port_listeners(listener.port)
        if holders:
            holder = holders[0]
            raise UsageError(
                f"port {listener.port}, which it listens on, is taken here by process {holder.pid} "
                f"({holder.name}): start the copy with --own-network to give it an address of "
                "its own, or have the server set SO_REUSEPORT so that its copies share the port"
            )


def restart_template(records: Records, job: Job) -> Template | None:
    """The template job ``job`` restarts from when it has no checkpoint of its own: the one it was started
    from, or its warm-start one; None when it has neither. A stale one is refused, saying why."""
    templates = Templates(records)
    origin = templates.origin(job.name)
    name = origin.warm or origin.template if origin is not None else None
    template = templates.find(name) if name else None
    if template is None:
        return None
    why = stale_summary(stale_reasons(template.files, stamps_now(template)))
    if why:
        raise CheckpointNotFound(
            f"job '{job.name}' has no checkpoint of its own, and its template '{template.name}' is stale "
            f"({why}): 'torpor rm {job.name}' and start it again"
        )
    return template
