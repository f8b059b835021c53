"""Job and checkpoint records in SQLite: the one place that says what exists and in which state.

Several processes write here at once (CLI calls, one launcher per job), so every connection uses WAL and
a busy timeout, and every state change is one short ``BEGIN IMMEDIATE`` transaction whose ``WHERE``
clause checks the state it expects — two ``resume`` calls racing cannot both win. What the rows are
read into and written from (jobs, checkpoints, submissions…) is :mod:`torpor.core.recordtypes`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torpor.adapters.system import private
from torpor.core.recordtypes import (
    SUBMISSION_MARKS,
    Care,
    Checkpoint,
    CheckpointId,
    CheckpointKind,
    Event,
    Job,
    JobName,
    JobState,
    Quota,
    Submission,
    rounds_from,
)
from torpor.core.schema import SCHEMA, SCHEMA_VERSION
from torpor.errors import CheckpointNotFound, EnvironmentProblem, JobNotFound, UsageError, WrongState
from torpor.policy.jobpolicy import JobPolicy


class Records:
    """Access to ``torpor.db``; cheap to create, one short connection per operation."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            private.make_private_dirs(path.parent)
            # made 0600 before SQLite opens it: its -wal and -shm files take the database's mode
            os.close(private.open_private(path, os.O_RDWR | os.O_CREAT))
            db = self._connect()
            try:
                db.executescript(SCHEMA)
                db.execute(
                    "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
                version = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
            finally:
                db.close()  # no connection outlives an operation (a forked launcher relies on it)
        except (sqlite3.OperationalError, PermissionError, OSError) as exc:
            raise EnvironmentProblem(
                f"cannot open torpor's state in {path.parent} ({exc}); make it writable or set TORPOR_HOME"
            ) from exc
        if int(version) != SCHEMA_VERSION:
            raise EnvironmentProblem(
                f"{path} has schema version {version}, this torpor knows {SCHEMA_VERSION}; use a matching torpor"
            )

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=30000")
        return db

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            raise EnvironmentProblem(f"cannot write torpor's state in {self.path} ({exc})") from exc
        finally:
            db.close()

    # -- jobs -------------------------------------------------------------------------------------------

    def create_job(self, name: JobName, command: list[str], cwd: str, log_path: str) -> Job:
        with self.transaction() as db:
            if db.execute("SELECT 1 FROM jobs WHERE name=?", (name,)).fetchone():
                raise UsageError(
                    f"a job named '{name}' already exists: pick another --name or 'torpor rm {name}'"
                )
            queued = db.execute("SELECT 1 FROM submissions WHERE name=? AND started_at IS NULL", (name,))
            if queued.fetchone():  # the agent marks a submission started before it creates its job
                raise UsageError(
                    f"a job named '{name}' waits in the queue: pick another --name or 'torpor rm {name}'"
                )
            db.execute(
                "INSERT INTO jobs(name, command, cwd, state, log_path, created_at) VALUES (?,?,?,?,?,?)",
                (name, json.dumps(command), cwd, JobState.STARTING, log_path, time.time()),
            )
        return self.job(name)

    def job(self, name: str) -> Job:
        """The job named ``name`` (as typed by a user: JobNotFound if there is none)."""
        with self.transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE name=?", (name,)).fetchone()
        if row is None:
            raise JobNotFound(f"no job named '{name}' (see 'torpor ps')")
        return _job(row)

    def jobs(self) -> list[Job]:
        with self.transaction() as db:
            rows = db.execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        return [_job(row) for row in rows]

    def transition(
        self, name: JobName, expected: frozenset[JobState] | set[JobState], new: JobState, **fields: object
    ) -> Job:
        """Move ``name`` to ``new`` (and set ``fields``) only if it is in one of ``expected``.

        Returns the job as it was before; raises :class:`WrongState` if it was in another state.
        """
        allowed = {
            "pid",
            "pid_ticks",
            "launcher_pid",
            "started_at",
            "ended_at",
            "exit_code",
            "message",
            "restored_from",
        }
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown job fields {unknown}")
        with self.transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE name=?", (name,)).fetchone()
            if row is None:
                raise JobNotFound(f"no job named '{name}' (see 'torpor ps')")
            before = _job(row)
            if before.state not in expected:
                raise WrongState(
                    f"job '{name}' is {before.state}; this needs it to be "
                    + " or ".join(sorted(str(s) for s in expected))
                )
            assignments = ", ".join(["state=?", *(f"{key}=?" for key in fields)])
            db.execute(f"UPDATE jobs SET {assignments} WHERE name=?", (new, *fields.values(), name))
        return before

    def set_fields(self, name: JobName, **fields: object) -> None:
        if not fields:
            return
        assignments = ", ".join(f"{key}=?" for key in fields)
        with self.transaction() as db:
            db.execute(f"UPDATE jobs SET {assignments} WHERE name=?", (*fields.values(), name))

    def delete_job(self, name: JobName) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM checkpoints WHERE job=?", (name,))
            db.execute("DELETE FROM policies WHERE job=?", (name,))
            db.execute("DELETE FROM submissions WHERE name=?", (name,))
            db.execute("DELETE FROM origins WHERE job=?", (name,))
            _set_meta(db, _STOPPED_DUMP + name, None)
            db.execute("DELETE FROM jobs WHERE name=?", (name,))

    # -- checkpoints --------------------------------------------------------------------------------

    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO checkpoints(id, job, kind, created_at, freeze_s, total_s, size_bytes, criu_version, parent)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    checkpoint.id,
                    checkpoint.job,
                    checkpoint.kind,
                    checkpoint.created_at,
                    checkpoint.freeze_s,
                    checkpoint.total_s,
                    checkpoint.size_bytes,
                    checkpoint.criu_version,
                    checkpoint.parent,
                ),
            )
            if checkpoint.rounds:
                db.execute(
                    "INSERT INTO precopies(checkpoint, rounds) VALUES (?,?)",
                    (checkpoint.id, json.dumps(checkpoint.rounds)),
                )

    def checkpoints(self, job: str | None = None) -> list[Checkpoint]:
        with self.transaction() as db:
            if job is None:
                rows = db.execute(_CHECKPOINTS + " ORDER BY created_at").fetchall()
            else:
                rows = db.execute(_CHECKPOINTS + " WHERE job=? ORDER BY created_at", (job,)).fetchall()
        return [_checkpoint(row) for row in rows]

    def latest_checkpoint(self, job: JobName) -> Checkpoint | None:
        found = self.checkpoints(job)
        return found[-1] if found else None

    def find_checkpoint(self, job: str, ref: str) -> Checkpoint:
        """A checkpoint of ``job`` by its id or a unique prefix of it."""
        if not ref.strip():
            raise CheckpointNotFound(
                f"an empty checkpoint id names no checkpoint: give one from 'torpor checkpoints {job}'"
            )
        matches = [c for c in self.checkpoints(job) if c.id == ref or c.id.startswith(ref)]
        exact = [c for c in matches if c.id == ref]
        if exact:
            return exact[0]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise CheckpointNotFound(
                f"job '{job}' has no checkpoint '{ref}' (see 'torpor checkpoints {job}')"
            )
        raise CheckpointNotFound(
            f"'{ref}' matches {len(matches)} checkpoints of '{job}': give more of the id"
        )

    def delete_checkpoint(self, checkpoint_id: CheckpointId) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM checkpoints WHERE id=?", (checkpoint_id,))

    # -- the agent's: policies, marks, events, the node's state ------------------------------------

    def set_policy(self, name: JobName, policy: JobPolicy) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO policies(job, policy) VALUES (?, ?) ON CONFLICT(job) DO UPDATE SET policy=excluded.policy",
                (name, json.dumps(policy.to_dict())),
            )

    def care(self, name: str) -> Care:
        """The agent's record of job ``name`` (an empty policy when it has none)."""
        return self.cares().get(JobName(name), Care(JobPolicy()))

    def cares(self) -> dict[JobName, Care]:
        with self.transaction() as db:
            rows = db.execute("SELECT * FROM policies").fetchall()
        return {JobName(row["job"]): _care(row) for row in rows}

    def mark_hibernated(
        self, name: JobName, by: str | None, listened: tuple[tuple[str, int], ...] = ()
    ) -> None:
        """Say the agent hibernated ``name`` (``by``: why), or, with None, that it no longer holds it so."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO policies(job, policy, hibernated_by, listened) VALUES (?, ?, ?, ?) ON CONFLICT(job)"
                " DO UPDATE SET hibernated_by=excluded.hibernated_by, listened=excluded.listened",
                (name, json.dumps(JobPolicy().to_dict()), by, json.dumps([list(a) for a in listened])),
            )

    def add_event(self, job: str | None, action: str, reason: str, **detail: object) -> Event:
        at = time.time()
        with self.transaction() as db:
            cursor = db.execute(
                "INSERT INTO events(at, job, action, reason, detail) VALUES (?,?,?,?,?)",
                (at, job, action, reason, json.dumps(detail, default=str)),
            )
            event_id = cursor.lastrowid
        assert event_id is not None
        return Event(event_id, at, JobName(job) if job else None, action, reason, detail)

    def events(self, after: int = 0, job: str | None = None, limit: int | None = None) -> list[Event]:
        """Events with an id above ``after``, oldest first; with ``limit``, the newest ``limit`` of them."""
        query = "SELECT * FROM events WHERE id>?" + (" AND job=?" if job else "") + " ORDER BY id DESC"
        params: tuple[object, ...] = (after, job) if job else (after,)
        if limit is not None:
            query += " LIMIT ?"
            params = (*params, limit)
        with self.transaction() as db:
            rows = db.execute(query, params).fetchall()
        return [_event(row) for row in reversed(rows)]

    # -- the scheduler's: submissions and quotas -----------------------------------------------------

    def add_submission(self, submission: Submission) -> None:
        """Queue ``submission``; its name must be free among the jobs and the queue."""
        with self.transaction() as db:
            for table, column in (("jobs", "name"), ("submissions", "name")):
                if db.execute(f"SELECT 1 FROM {table} WHERE {column}=?", (submission.name,)).fetchone():
                    raise UsageError(
                        f"a job named '{submission.name}' already exists: pick another --name or "
                        f"'torpor rm {submission.name}'"
                    )
            db.execute(
                "INSERT INTO submissions(name, command, cwd, env, umask, memory, cpus, priority, project,"
                " submitted_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    submission.name,
                    json.dumps(submission.command),
                    submission.cwd,
                    json.dumps(submission.env),
                    submission.umask,
                    submission.memory,
                    submission.cpus,
                    submission.priority,
                    submission.project,
                    submission.submitted_at,
                ),
            )

    def submissions(self) -> dict[JobName, Submission]:
        """Every submission, queued or started, in the order they came."""
        with self.transaction() as db:
            rows = db.execute("SELECT * FROM submissions ORDER BY submitted_at, name").fetchall()
        return {JobName(row["name"]): _submission(row) for row in rows}

    def submission(self, name: str) -> Submission | None:
        with self.transaction() as db:
            row = db.execute("SELECT * FROM submissions WHERE name=?", (name,)).fetchone()
        return None if row is None else _submission(row)

    def update_submission(self, name: str, **marks: object) -> None:
        """Change the scheduler's marks on a submission (:data:`SUBMISSION_MARKS`); gone: nothing happens."""
        unknown = set(marks) - SUBMISSION_MARKS
        if unknown:
            raise ValueError(f"not a scheduler mark: {sorted(unknown)}")
        if not marks:
            return
        assignments = ", ".join(f"{key}=?" for key in marks)
        with self.transaction() as db:
            db.execute(f"UPDATE submissions SET {assignments} WHERE name=?", (*marks.values(), name))

    def delete_submission(self, name: str) -> bool:
        """Drop a submission that never started (``torpor rm``); False if there was none queued.

        A started one goes with its job (:meth:`delete_job`): the agent marks it started before it
        creates the job, so this never races a start into a job without its submission."""
        with self.transaction() as db:
            deleted = db.execute("DELETE FROM submissions WHERE name=? AND started_at IS NULL", (name,))
            return deleted.rowcount > 0

    def set_quota(self, quota: Quota) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO quotas(project, share, borrow_limit) VALUES (?,?,?) ON CONFLICT(project)"
                " DO UPDATE SET share=excluded.share, borrow_limit=excluded.borrow_limit",
                (quota.project, quota.share, quota.borrow_limit),
            )

    def delete_quota(self, project: str) -> bool:
        with self.transaction() as db:
            return db.execute("DELETE FROM quotas WHERE project=?", (project,)).rowcount > 0

    def quotas(self) -> dict[str, Quota]:
        with self.transaction() as db:
            rows = db.execute("SELECT * FROM quotas ORDER BY project").fetchall()
        return {row["project"]: Quota(row["project"], row["share"], row["borrow_limit"]) for row in rows}

    def mark_stopped_dump(self, name: JobName, checkpoint_id: CheckpointId | None) -> None:
        """Say that torpor stopped job ``name``'s processes (SIGSTOP) before dumping it into
        ``checkpoint_id`` (the scheduler does, for a job at its memory limit): a restore from that
        checkpoint continues them. None: no such mark."""
        with self.transaction() as db:
            _set_meta(db, _STOPPED_DUMP + name, checkpoint_id)

    def stopped_dump(self, name: str) -> CheckpointId | None:
        """The checkpoint of ``name`` that was dumped with its processes stopped by torpor, if any."""
        with self.transaction() as db:
            value = _meta(db, _STOPPED_DUMP + name)
        return None if value is None else CheckpointId(value)

    def node_flag(self, key: str) -> str | None:
        """A value the node keeps across restarts (``draining``: why it refuses new jobs)."""
        with self.transaction() as db:
            return _meta(db, _NODE + key)

    def set_node_flag(self, key: str, value: str | None) -> None:
        with self.transaction() as db:
            _set_meta(db, _NODE + key, value)


#: keys of the ``meta`` table: a job's stopped dump (``stopped-dump.NAME``), a node flag (``node.KEY``)
_STOPPED_DUMP = "stopped-dump."
_NODE = "node."


def _meta(db: sqlite3.Connection, key: str) -> str | None:
    row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return None if row is None else str(row[0])


def _set_meta(db: sqlite3.Connection, key: str, value: str | None) -> None:
    """Set ``key`` of the ``meta`` table to ``value``; None deletes it."""
    if value is None:
        db.execute("DELETE FROM meta WHERE key=?", (key,))
    else:
        db.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )


def _submission(row: sqlite3.Row) -> Submission:
    return Submission(
        JobName(row["name"]),
        json.loads(row["command"]),
        row["cwd"],
        json.loads(row["env"]),
        row["umask"],
        row["memory"],
        row["cpus"],
        row["priority"],
        row["project"],
        row["submitted_at"],
        row["started_at"],
        row["waited_s"],
        row["room_for"],
        row["hibernated_at"],
        row["usage_at_hibernation"],
        row["cgroup_usage_at_hibernation"],
        row["mem_limit"],
        row["why"],
    )


def _care(row: sqlite3.Row) -> Care:
    listened = tuple((str(host), int(port)) for host, port in json.loads(row["listened"] or "[]"))
    return Care(JobPolicy.from_dict(json.loads(row["policy"])), row["hibernated_by"], listened)


def _event(row: sqlite3.Row) -> Event:
    job = row["job"]
    return Event(
        row["id"],
        row["at"],
        JobName(job) if job else None,
        row["action"],
        row["reason"],
        json.loads(row["detail"]),
    )


def _job(row: sqlite3.Row) -> Job:
    return Job(
        name=JobName(row["name"]),
        command=json.loads(row["command"]),
        cwd=row["cwd"],
        state=JobState(row["state"]),
        pid=row["pid"],
        pid_ticks=row["pid_ticks"],
        launcher_pid=row["launcher_pid"],
        log_path=row["log_path"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
        exit_code=row["exit_code"],
        message=row["message"],
        restored_from=CheckpointId(row["restored_from"]) if row["restored_from"] else None,
    )


#: a checkpoint's row with its pre-copy's rounds, if it had any
_CHECKPOINTS = (
    "SELECT checkpoints.*, precopies.rounds AS rounds FROM checkpoints"
    " LEFT JOIN precopies ON precopies.checkpoint = checkpoints.id"
)


def _checkpoint(row: sqlite3.Row) -> Checkpoint:
    return Checkpoint(
        id=CheckpointId(row["id"]),
        job=JobName(row["job"]),
        kind=CheckpointKind(row["kind"]),
        created_at=row["created_at"],
        freeze_s=row["freeze_s"],
        total_s=row["total_s"],
        size_bytes=row["size_bytes"],
        criu_version=row["criu_version"],
        parent=CheckpointId(row["parent"]) if row["parent"] else None,
        rounds=rounds_from(json.loads(row["rounds"])) if row["rounds"] else (),
    )
