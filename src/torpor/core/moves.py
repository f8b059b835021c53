"""The durable records of jobs handed to and from peers: each step of :mod:`torpor.policy.handoff` in one
transaction of this state directory's torpor.db, so that what a side does next follows from what it
wrote, whatever was killed in between.

``moves_out`` holds the source's record of a job it moves (:class:`~torpor.policy.handoff.Source`, the
generation, the peer); ``moves_in`` the peer's record of a job coming to it (:class:`~torpor.policy.
handoff.Incoming`, the generation, the source). Each method reads the record, applies the policy's
function and writes what it returns before it returns: an answer (to a peer's question, above all) is
never given before the record it depends on is written. Every restore asks :meth:`Moves.refuse_if_held`
first, so that a job handed away, or not handed here yet, is never resumed here; ``torpor migrate``
(:mod:`torpor.core.migrate`, :mod:`torpor.core.arrivals`) writes these.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

from torpor.core.records import Records
from torpor.errors import UsageError, WrongState
from torpor.policy import handoff
from torpor.policy.handoff import Action, Incoming, PeerRecord, Source, SourceRecord

#: a step of the source's record, and one of the peer's that also says what to do
SourceStep = Callable[[SourceRecord], SourceRecord]
PeerStep = Callable[[PeerRecord], tuple[PeerRecord, Action]]


class Moves:
    """The hand-off records in ``records``."""

    def __init__(self, records: Records) -> None:
        self.records = records

    # -- this machine as the source ---------------------------------------------------------------------

    def outgoing(self, job: str) -> tuple[SourceRecord, str]:
        """The source's record of ``job`` and the peer it names ("" when it never moved)."""
        with self.records.transaction() as db:
            return _outgoing(db, job)

    def start(self, job: str, peer: str) -> int:
        """Step 1, the job hibernated here: a move of ``job`` to ``peer`` of the next generation, which
        is returned. UsageError while another move of it is under way."""
        with self.records.transaction() as db:
            record, there = _outgoing(db, job)
            record = handoff.current(record, _incoming(db, job)[0])  # a job that came back is here
            moving = handoff.source_start(record)
            if moving is None and record.phase == Source.GONE:
                raise UsageError(f"job '{job}' moved to peer {there}: it is that machine's now")
            if moving is None:
                raise UsageError(f"job '{job}' is being moved to peer {there} already")
            _write_out(db, job, moving, peer)
            return moving.gen

    def held(self, job: str) -> str | None:
        """Why this machine may not run ``job`` now, one line (None: it may): it is being moved, it moved,
        or it is arriving and not handed over yet (:func:`torpor.policy.handoff.held`)."""
        with self.records.transaction() as db:
            (outgoing, peer), (incoming, source) = _outgoing(db, job), _incoming(db, job)
        why = handoff.held(outgoing, incoming)
        if why == handoff.Held.MOVING:
            return f"job '{job}' is being moved to peer {peer}: it stays hibernated here unless that fails"
        if why == handoff.Held.MOVED:
            return f"job '{job}' moved to peer {peer}: it is that machine's now"
        if why == handoff.Held.ARRIVING:
            return (
                f"job '{job}' is arriving from {source}: it is not this machine's until {source} "
                "hands it over"
            )
        return None

    def moved(self) -> dict[str, str]:
        """The jobs this machine handed to a peer (committed or gone), each with the peer's name."""
        with self.records.transaction() as db:
            rows = db.execute(
                "SELECT job FROM moves_out WHERE phase IN (?, ?)", (Source.COMMITTED, Source.GONE)
            )
            found = {}
            for row in rows.fetchall():
                (outgoing, peer), (incoming, _) = _outgoing(db, row["job"]), _incoming(db, row["job"])
                if handoff.held(outgoing, incoming) == handoff.Held.MOVED:
                    found[str(row["job"])] = peer
        return found

    def refuse_if_held(self, job: str) -> None:
        """WrongState saying :meth:`held`'s reason, if there is one."""
        why = self.held(job)
        if why is not None:
            raise WrongState(why)

    def commit(self, job: str) -> bool:
        """Step 3: whether the move is committed now (False: it was aborted before)."""
        with self.records.transaction() as db:
            record, peer = _outgoing(db, job)
            committed = handoff.source_commit(record)
            if committed is None:
                return False
            _write_out(db, job, committed, peer)
            return True

    def acknowledged(self, job: str, gen: int) -> SourceRecord:
        """The peer owns generation ``gen``: the source's record after it (gone, if it was committed)."""
        return self._out(job, lambda record: handoff.source_on_ack(record, gen))

    def abort(self, job: str) -> SourceRecord:
        """The move failed before its commit: the source owns the job again (a committed one stays)."""
        return self._out(job, handoff.source_abort)

    def question(self, job: str, gen: int) -> bool:
        """A peer asks whether generation ``gen`` of ``job`` was committed to it: the answer, the move
        aborted first (in the same transaction) when it was not committed yet."""
        with self.records.transaction() as db:
            record, peer = _outgoing(db, job)
            after, answer = handoff.source_on_question(record, gen)
            if after != record:
                _write_out(db, job, after, peer)
            return answer

    def unfinished(self) -> list[tuple[str, str]]:
        """The moves from here whose hand-off is not over (:func:`~torpor.policy.handoff.source_on_restart`
        would act on them: one not committed, to abort; one committed, its *go* to send), as (job, peer).
        Nothing is rewritten: whoever finishes one holds its move's lock first (:func:`torpor.core.
        migrate.moving`), since a live ``torpor migrate`` may own it."""
        with self.records.transaction() as db:
            rows = db.execute("SELECT job FROM moves_out ORDER BY job").fetchall()
            found = [(str(row["job"]), *_outgoing(db, row["job"])) for row in rows]
        return [
            (job, peer)
            for job, record, peer in found
            if handoff.source_on_restart(record)[1] != Action.NOTHING
        ]

    def restart_outgoing(self) -> list[tuple[str, str, SourceRecord, Action]]:
        """What the source does with each record it finds when it starts again, the records rewritten
        first (an uncommitted move aborted): (job, peer, record, action)."""
        found: list[tuple[str, str, SourceRecord, Action]] = []
        with self.records.transaction() as db:
            for row in db.execute("SELECT job FROM moves_out ORDER BY job").fetchall():
                record, peer = _outgoing(db, row["job"])
                after, action = handoff.source_on_restart(record)
                if after != record:
                    _write_out(db, row["job"], after, peer)
                if action != Action.NOTHING:
                    found.append((row["job"], peer, after, action))
        return found

    def _out(self, job: str, step: SourceStep) -> SourceRecord:
        with self.records.transaction() as db:
            record, peer = _outgoing(db, job)
            after = step(record)
            if after != record:
                _write_out(db, job, after, peer)
            return after

    # -- this machine as the peer -----------------------------------------------------------------------

    def incoming(self, job: str) -> tuple[PeerRecord, str]:
        """The peer's record of ``job`` coming here and its source ("" when none ever came)."""
        with self.records.transaction() as db:
            return _incoming(db, job)

    def arrived(self, job: str, gen: int, source: str) -> bool:
        """Step 2, the image of generation ``gen`` stored here: whether it is recorded as arriving
        (False: refused, an earlier generation or one dropped already)."""
        with self.records.transaction() as db:
            record, _ = _incoming(db, job)
            arriving = handoff.peer_on_arrival(record, gen)
            if arriving is None:
                return False
            _write_in(db, job, arriving, source)
            return True

    def go(self, job: str, gen: int) -> Action:
        """Step 4 at the peer: RUN (it owns the job now), ACK (it did already) or NOTHING."""
        return self._in(job, lambda record: handoff.peer_on_go(record, gen))

    def aborted(self, job: str, gen: int) -> Action:
        """The source aborted generation ``gen``: DROP (the arriving image is to go) or NOTHING."""
        return self._in(job, lambda record: handoff.peer_on_abort(record, gen))

    def answered(self, job: str, committed: bool | None) -> Action:
        """The peer, started again with a record, got the source's answer (None: it could not ask)."""
        return self._in(job, lambda record: handoff.peer_on_restart(record, committed))

    def image_log(self, checkpoint_id: str) -> str | None:
        """The log an image that came from another machine writes to there (None: an image of here)."""
        with self.records.transaction() as db:
            row = db.execute(
                "SELECT log_path FROM moved_images WHERE checkpoint=?", (checkpoint_id,)
            ).fetchone()
        return None if row is None else str(row["log_path"])

    def _in(self, job: str, step: PeerStep) -> Action:
        with self.records.transaction() as db:
            record, source = _incoming(db, job)
            after, action = step(record)
            if after != record:
                _write_in(db, job, after, source)
            return action


def _outgoing(db: sqlite3.Connection, job: str) -> tuple[SourceRecord, str]:
    row = db.execute("SELECT phase, gen, peer FROM moves_out WHERE job=?", (job,)).fetchone()
    if row is None:
        return SourceRecord(), ""
    return SourceRecord(Source(row["phase"]), row["gen"]), row["peer"]


def _incoming(db: sqlite3.Connection, job: str) -> tuple[PeerRecord, str]:
    row = db.execute("SELECT state, gen, source FROM moves_in WHERE job=?", (job,)).fetchone()
    if row is None:
        return PeerRecord(), ""
    return PeerRecord(Incoming(row["state"]), row["gen"]), row["source"]


def _write_out(db: sqlite3.Connection, job: str, record: SourceRecord, peer: str) -> None:
    db.execute(
        "INSERT OR REPLACE INTO moves_out(job, phase, gen, peer, at) VALUES (?,?,?,?,?)",
        (job, record.phase.value, record.gen, peer, time.time()),
    )


def _write_in(db: sqlite3.Connection, job: str, record: PeerRecord, source: str) -> None:
    db.execute(
        "INSERT OR REPLACE INTO moves_in(job, state, gen, source, at) VALUES (?,?,?,?,?)",
        (job, record.state.value, record.gen, source, time.time()),
    )
