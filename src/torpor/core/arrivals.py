"""A job moving here from a peer (issue 30): the receiving side of ``torpor migrate``, which the agent's
``/v1/arrivals`` routes call.

Its checkpoints come first, chunk by chunk (:mod:`torpor.core.store.transfer`: only what this store
lacks, encrypted again with this store's key; what was learnt of the source's chunk names is kept in
torpor.db, so that a second round, or a source that starts again, sends only the rest). Then its log,
then its records: :meth:`Arrivals.arrive` stores the manifests and writes the job here, hibernated and
recorded ``ARRIVING`` (:class:`~torpor.core.moves.Moves`) — no restore runs it until the source hands it
over (:meth:`Arrivals.go`; the agent resumes it then), or it is dropped (:meth:`Arrivals.abort`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from torpor.adapters.system import private
from torpor.core import carried, rewind
from torpor.core.engine import Engine
from torpor.core.moves import Moves
from torpor.core.naming import check_name
from torpor.core.recordtypes import Checkpoint, CheckpointId, CheckpointKind, JobName, JobState
from torpor.core.rewind import STOPPED_FILE
from torpor.core.store import TieredStore
from torpor.core.store.repository import Repository
from torpor.core.store.transfer import Receiver
from torpor.errors import StoreError, UsageError, WrongState
from torpor.policy import handoff
from torpor.policy.handoff import Action, Source
from torpor.policy.jobpolicy import JobPolicy

#: at most this many files the job writes come with it
MAX_FILES = 10_000


class Arrivals:
    """Jobs arriving in ``engine``'s state directory."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.records = engine.records
        self.moves = Moves(engine.records)

    @property
    def repo(self) -> Repository:
        store = self.engine.ctx.store
        if not isinstance(store, TieredStore):
            raise StoreError("this state directory's store cannot take a job from another machine")
        return store.repo

    def staging(self, job: str) -> Path:
        check_name(job)
        folder = self.engine.settings.home / "arrivals" / job
        private.make_private_dirs(folder)
        return folder

    # -- the checkpoints' chunks ------------------------------------------------------------------------

    def receiver(self, job: str) -> Receiver:
        with self.records.transaction() as db:
            rows = db.execute("SELECT theirs, ours FROM arrival_chunks WHERE job=?", (job,)).fetchall()
        return Receiver(self.repo, {row["theirs"]: row["ours"] for row in rows})

    def missing(self, job: str, chunks: list[str]) -> list[str]:
        """Which of the source's ``chunks`` of ``job`` this store lacks."""
        self._refuse_if_taken(job)
        return self.receiver(job).missing(chunks)

    def take(self, job: str, body: bytes | memoryview) -> int:
        """Store the chunks of ``body``'s frames; how many."""
        self._refuse_if_taken(job)
        learnt = self.receiver(job).take(body)
        with self.records.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO arrival_chunks(job, theirs, ours) VALUES (?,?,?)",
                [(job, theirs, ours) for theirs, ours in learnt.items()],
            )
        return len(learnt)

    def put_log(self, job: str, offset: int, data: bytes) -> None:
        """A piece of the job's output so far, at ``offset`` (0: the first, which starts the file anew):
        its log here starts with it."""
        self._refuse_if_taken(job)
        path = self.staging(job) / "output.log"
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0)
        with os.fdopen(private.open_private(path, flags), "wb") as out:
            if out.seek(0, os.SEEK_END) != offset:
                raise UsageError(
                    f"the log of '{job}' is {out.tell()} bytes here, not {offset}: send it from the start"
                )
            out.write(data)

    def put_file(self, job: str, index: int, offset: int, data: bytes) -> None:
        """A piece of the ``index``-th file the job writes (as the arrival's ``files`` will name it), at
        ``offset`` (0 starts it anew). It stays here, aside, until the job is handed over."""
        self._refuse_if_taken(job)
        if not 0 <= index < MAX_FILES:
            raise UsageError(f"file index {index} is out of range (a job carries at most {MAX_FILES} files)")
        folder = self.staging(job) / "files"
        private.make_private_dirs(folder)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0)
        with os.fdopen(private.open_private(folder / str(index), flags), "wb") as out:
            if out.seek(0, os.SEEK_END) != offset:
                raise UsageError(
                    f"file {index} of '{job}' is {out.tell()} bytes here, not {offset}: send it again"
                )
            out.write(data)

    # -- the records, the hand-off ----------------------------------------------------------------------

    def arrive(self, job: str, gen: int, source: str, spec: dict[str, Any]) -> None:
        """Store ``job``'s checkpoints' manifests and write it here, hibernated, not to run until handed
        over; WrongState if this machine has a job of that name of its own, or refused the generation."""
        self._refuse_if_taken(job)
        if not self.moves.arrived(job, gen, source):
            raise WrongState(
                f"job '{job}' of generation {gen} is not taken here: a later one came, or it was dropped"
            )
        files = self._staged_files(job, spec.get("files") or [])
        receiver = self.receiver(job)
        checkpoints = [_checkpoint(job, each) for each in spec["checkpoints"]]
        for record, each in zip(checkpoints, spec["checkpoints"], strict=True):
            receiver.write_manifest(str(each["manifest"]).encode(), record.id)
        self._drop_records(job)  # a stub of the job's earlier stay here, or an arrival sent again
        job_dir = self.engine.settings.job_dir(job)
        private.make_private_dirs(job_dir)
        log = job_dir / "output.log"
        staged = self.staging(job) / "output.log"
        if staged.exists():
            os.replace(staged, log)
        name = JobName(job)
        self.records.create_job(name, [str(a) for a in spec["command"]], str(spec["cwd"]), str(log))
        self.records.transition(
            name,
            {JobState.STARTING},
            JobState.HIBERNATED,
            started_at=spec.get("started_at"),
            ended_at=spec.get("ended_at"),
            message=f"arrived from {source}",
        )
        for record in checkpoints:
            self.records.add_checkpoint(record)
        if spec.get("policy"):
            self.records.set_policy(name, JobPolicy.from_dict(spec["policy"]))
        if spec.get("stopped"):
            (job_dir / STOPPED_FILE).write_text(json.dumps(spec["stopped"]))
        private.write_private(self.staging(job) / "files.json", json.dumps(files).encode())
        with self.records.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO moved_images(checkpoint, log_path) VALUES (?,?)",
                [(record.id, str(spec["log_path"])) for record in checkpoints],
            )

    def go(self, job: str, gen: int) -> None:
        """The source hands ``job`` over: it is this machine's now (sent again: it was already).
        WrongState if that generation did not arrive here; the caller resumes the job.

        The files the job writes that came with it are put in their places first: one that cannot be
        fails the hand-off (the source keeps the job and asks again), and none is put twice."""
        incoming, _ = self.moves.incoming(job)
        if handoff.peer_on_go(incoming, gen)[1] == Action.RUN:
            self._place_files(job, gen)
        action = self.moves.go(job, gen)
        if action == Action.NOTHING:
            raise WrongState(f"job '{job}' of generation {gen} did not arrive here (or was dropped)")
        if action == Action.RUN:
            self._forget_chunks(job)
            self.records.set_fields(JobName(job), message=None)

    def abort(self, job: str, gen: int) -> bool:
        """The source kept ``job``: whether what had arrived of generation ``gen`` was dropped."""
        if self.moves.aborted(job, gen) != Action.DROP:
            return False
        for checkpoint in self.records.checkpoints(job):
            self.engine.ctx.store.delete(checkpoint.id)
        self._drop_records(job)
        self._forget_chunks(job)
        return True

    # -- the files the job writes ----------------------------------------------------------------------

    def _staged_files(self, job: str, files: list[Any]) -> list[dict[str, Any]]:
        """The arrival's ``files``, checked: each an absolute path outside torpor's own folder, sent
        whole (its staged copy has its size). UsageError naming the first that is not."""
        if len(files) > MAX_FILES:
            raise UsageError(f"a job carries at most {MAX_FILES} files, not {len(files)}")
        home = os.path.realpath(self.engine.settings.home)
        checked = []
        for index, entry in enumerate(files):
            try:
                path = str(entry["path"])
                each = {
                    "path": path,
                    "size": int(entry["size"]),
                    "mtime_ns": int(entry["mtime_ns"]),
                    "mode": int(entry["mode"]) & 0o7777,
                    "uid": int(entry["uid"]),
                    "gid": int(entry["gid"]),
                }
            except (KeyError, TypeError, ValueError):
                raise UsageError(f"file {index} of '{job}' is not described as a carried file is") from None
            if not path.startswith("/") or "\0" in path or os.path.normpath(path) != path:
                raise UsageError(f"a carried file's path must be absolute and plain, not {path!r}")
            if path == home or path.startswith(home + "/"):
                raise UsageError(f"a carried file may not be in torpor's own folder: {path}")
            staged = self.staging(job) / "files" / str(index)
            if not staged.is_file() or staged.stat().st_size != each["size"]:
                raise UsageError(f"{path} did not arrive whole ({each['size']} bytes): send it again")
            checked.append(each)
        return checked

    def _place_files(self, job: str, gen: int) -> None:
        """Put each carried file in its place (a copy beside it, then renamed over it: a file there is
        replaced whole or not at all), with its owner, mode and modification time from the source; then
        the job's record of its files at the hibernation names them as they are here."""
        listed = self.staging(job) / "files.json"
        files = json.loads(listed.read_bytes()) if listed.exists() else []
        for index, each in enumerate(files):
            carried.place(Path(each["path"]), self.staging(job) / "files" / str(index), each, str(gen))
        rewind.adopt_stopped(self.engine.settings.job_dir(job))

    # -- helpers --------------------------------------------------------------------------------------

    def _refuse_if_taken(self, job: str) -> None:
        """UsageError if ``job`` names a job of this machine's own (not one that left, nor one arriving)."""
        check_name(job)
        try:
            self.records.job(job)
        except UsageError:
            return
        outgoing, _ = self.moves.outgoing(job)
        incoming, _ = self.moves.incoming(job)
        if handoff.held(outgoing, incoming) == handoff.Held.ARRIVING:
            return
        if handoff.current(outgoing, incoming).phase == Source.GONE:
            return
        raise WrongState(f"this machine has a job named '{job}' of its own")

    def _drop_records(self, job: str) -> None:
        try:
            self.records.job(job)
        except UsageError:
            return
        with self.records.transaction() as db:
            ids = [r["id"] for r in db.execute("SELECT id FROM checkpoints WHERE job=?", (job,))]
            db.executemany("DELETE FROM moved_images WHERE checkpoint=?", [(i,) for i in ids])
        self.records.delete_job(JobName(job))
        shutil.rmtree(self.engine.settings.job_dir(job), ignore_errors=True)

    def _forget_chunks(self, job: str) -> None:
        with self.records.transaction() as db:
            db.execute("DELETE FROM arrival_chunks WHERE job=?", (job,))
        shutil.rmtree(self.engine.settings.home / "arrivals" / job, ignore_errors=True)


_CHECKPOINT_ID = re.compile(r"[0-9a-f]{6,64}")


def _checkpoint(job: str, data: dict[str, Any]) -> Checkpoint:
    """A checkpoint's record as the source sent it; UsageError for an id that is not one."""
    if not isinstance(data.get("id"), str) or not _CHECKPOINT_ID.fullmatch(data["id"]):
        raise UsageError(f"bad checkpoint id {data.get('id')!r}")
    return Checkpoint(
        id=CheckpointId(data["id"]),
        job=JobName(job),
        kind=CheckpointKind(data["kind"]),
        created_at=float(data["created_at"]),
        freeze_s=float(data["freeze_s"]),
        total_s=float(data["total_s"]),
        size_bytes=int(data["size_bytes"]),
        criu_version=str(data["criu_version"]),
        parent=None if data.get("parent") is None else CheckpointId(str(data["parent"])),
    )
