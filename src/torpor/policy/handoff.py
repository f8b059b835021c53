"""The hand-off of a job from one machine to another: who owns it at each step, so that it never runs
twice and is never lost, whatever crashes or is cut (issue 30's protocol; :mod:`torpor.core.migrate` acts
on it, through :mod:`torpor.core.moves`).

Each side keeps one durable record of the move, in its own torpor.db, and acts only on what it has
written there; the *source* decides, in one transaction, whether the move happened:

1. The source hibernates the job (its image durable here), then records ``MOVING`` with a new
   generation ``g`` (one more than the job's last): from now on it does not resume the job by itself.
2. It sends the image and the job's records; the peer records ``ARRIVING g`` and does not run it.
3. The source records ``COMMITTED`` (to that peer, ``g``): the commit point. After it the source never
   runs the job again, and it keeps its image until the peer says it owns the job.
4. It sends *go g*; the peer records ``OWNED g``, restores the job and acknowledges; the source
   records ``GONE`` (it may delete the image; ``torpor ps`` says where the job went).

What each side does when a step fails, or when it starts again with a record half-way, is below; every
answer is a function of the durable records alone:

- :func:`source_on_restart`: ``MOVING`` (not committed) aborts — the job is hibernated here and the
  source owns it again; ``COMMITTED`` sends *go* again until the peer acknowledges.
- :func:`source_on_question`: a peer with ``ARRIVING g`` that starts again asks the source whether
  ``g`` was committed to it. The source answers from its record, and when it was still ``MOVING`` it
  aborts *before* it answers no (one transaction), so that a "no" can never be followed by a commit.
- :func:`peer_on_restart`: ``ARRIVING`` becomes ``OWNED`` on a yes, is dropped on a no, and waits
  (the job hibernated, its image on both sides) while the source cannot be asked: never two copies,
  and never none.
- :func:`peer_on_go`, :func:`peer_on_abort`, :func:`source_on_ack`: the messages, each idempotent and
  ignored when its generation is not the record's (a late message of an earlier attempt).

Pure: records in, records and an action out. ``tests/policy/test_handoff.py`` explores every
interleaving of the steps with crashes of either side and lost messages, and checks that at most one side
may run the job at any moment and that one always holds its image.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Source(StrEnum):
    """The source's record of the move."""

    HERE = "here"  # no move under way: the job is this machine's (running, or hibernated here)
    MOVING = "moving"  # hibernated for a move of generation ``gen``, not committed: not resumed here
    COMMITTED = "committed"  # moved to the peer (``gen``), not acknowledged yet: the image is kept
    GONE = "gone"  # the peer owns the job: this machine keeps a record that it moved, and where


class Incoming(StrEnum):
    """The peer's record of a job coming to it."""

    NONE = "none"
    ARRIVING = "arriving"  # its image and records are here (``gen``); it must not run before it is owned
    OWNED = "owned"  # the job is this machine's (``gen``): it runs here


class Action(StrEnum):
    NOTHING = "nothing"
    ABORT = "abort"  # the source owns the job again (hibernated here); tell the peer to drop it
    SEND_GO = "send-go"  # the source tells the peer it owns the job
    RUN = "run"  # the peer restores the job (or resumes it, starting again) and acknowledges
    ACK = "ack"  # the peer acknowledges again, the job already its
    DROP = "drop"  # the peer deletes the arriving image and records
    WAIT = "wait"  # the peer keeps the arriving job hibernated and asks again later


@dataclass(frozen=True)
class SourceRecord:
    phase: Source = Source.HERE
    gen: int = 0


@dataclass(frozen=True)
class PeerRecord:
    state: Incoming = Incoming.NONE
    gen: int = 0


def source_may_resume(record: SourceRecord) -> bool:
    """Whether the source may run the job itself (resume it, or let its scheduler do so)."""
    return record.phase == Source.HERE


def current(outgoing: SourceRecord, incoming: PeerRecord) -> SourceRecord:
    """This machine's record of a job as a source, given both of its records of it: a job that came back
    (owned here in a later generation than the move that took it away) is this machine's again, and its
    next move is of a generation above both. The generation travels with the job that way, so that a
    late message of an earlier trip is never taken for one of this trip."""
    if incoming.state == Incoming.OWNED and incoming.gen > outgoing.gen:
        return SourceRecord(Source.HERE, incoming.gen)
    return outgoing


class Held(StrEnum):
    """Why this machine may not run a job it has a record of (see :func:`held`)."""

    MOVING = "moving"  # it hands the job to a peer: not resumed here until that is aborted
    MOVED = "moved"  # committed or gone to a peer: the peer's now
    ARRIVING = "arriving"  # its image came from a source, which has not handed it over yet


def held(outgoing: SourceRecord, incoming: PeerRecord) -> Held | None:
    """Why this machine may not run (resume, restore) the job, from its two records; None: it may."""
    if incoming.state == Incoming.ARRIVING and incoming.gen > outgoing.gen:
        return Held.ARRIVING
    record = current(outgoing, incoming)
    if record.phase == Source.MOVING:
        return Held.MOVING
    if record.phase in (Source.COMMITTED, Source.GONE):
        return Held.MOVED
    return None


def peer_may_run(record: PeerRecord) -> bool:
    """Whether the peer may run the job."""
    return record.state == Incoming.OWNED


def source_start(record: SourceRecord) -> SourceRecord | None:
    """Step 1, once the job is hibernated here: the record of a move of the next generation, or None if
    a move is under way already (one move at a time)."""
    if record.phase != Source.HERE:
        return None
    return SourceRecord(Source.MOVING, record.gen + 1)


def peer_on_arrival(record: PeerRecord, gen: int) -> PeerRecord | None:
    """Step 2: the peer's record once the image of generation ``gen`` is stored: unchanged for the same
    generation sent again, None (refused) for an earlier generation or one it dropped."""
    if gen == record.gen and record.state != Incoming.NONE:
        return record
    if gen <= record.gen:
        return None
    return PeerRecord(Incoming.ARRIVING, gen)


def source_commit(record: SourceRecord) -> SourceRecord | None:
    """Step 3, once the peer stored the job: the committed record, or None if the move was aborted."""
    if record.phase != Source.MOVING:
        return None
    return SourceRecord(Source.COMMITTED, record.gen)


def peer_on_go(record: PeerRecord, gen: int) -> tuple[PeerRecord, Action]:
    """Step 4 at the peer: *go* of generation ``gen``."""
    if record.gen != gen or record.state == Incoming.NONE:
        return record, Action.NOTHING  # an earlier attempt's, or one it never stored: no ack
    if record.state == Incoming.OWNED:
        return record, Action.ACK
    return PeerRecord(Incoming.OWNED, gen), Action.RUN


def source_on_ack(record: SourceRecord, gen: int) -> SourceRecord:
    """The peer owns generation ``gen``: the source's record says the job is gone."""
    if record.phase == Source.COMMITTED and record.gen == gen:
        return SourceRecord(Source.GONE, gen)
    return record


def source_abort(record: SourceRecord) -> SourceRecord:
    """A move that failed before its commit (the peer refused, could not be reached, the transfer broke):
    the source owns the job again, hibernated here. A committed move is never aborted."""
    if record.phase == Source.MOVING:
        return SourceRecord(Source.HERE, record.gen)
    return record


def peer_on_abort(record: PeerRecord, gen: int) -> tuple[PeerRecord, Action]:
    """The source aborted generation ``gen``: the peer drops it if it is still arriving."""
    if record.state == Incoming.ARRIVING and record.gen == gen:
        return PeerRecord(Incoming.NONE, record.gen), Action.DROP
    return record, Action.NOTHING


def source_on_restart(record: SourceRecord) -> tuple[SourceRecord, Action]:
    """What the source does with its record when it starts again."""
    if record.phase == Source.MOVING:
        return source_abort(record), Action.ABORT
    if record.phase == Source.COMMITTED:
        return record, Action.SEND_GO
    return record, Action.NOTHING


def source_on_question(record: SourceRecord, gen: int) -> tuple[SourceRecord, bool]:
    """The peer asks whether generation ``gen`` was committed to it: the record (aborted first if it was
    still moving: written before the answer goes) and the answer."""
    if record.gen == gen and record.phase in (Source.COMMITTED, Source.GONE):
        return record, True
    if record.gen == gen and record.phase == Source.MOVING:
        return source_abort(record), False
    return record, False


def peer_on_restart(record: PeerRecord, committed: bool | None) -> tuple[PeerRecord, Action]:
    """What the peer does with its record when it starts again, given the source's answer to
    :func:`source_on_question` (None: the source could not be asked)."""
    if record.state == Incoming.OWNED:
        return record, Action.RUN
    if record.state == Incoming.NONE:
        return record, Action.NOTHING
    if committed is None:
        return record, Action.WAIT
    if committed:
        return PeerRecord(Incoming.OWNED, record.gen), Action.RUN
    return PeerRecord(Incoming.NONE, record.gen), Action.DROP
