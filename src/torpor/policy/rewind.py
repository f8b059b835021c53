"""What a restore does with each file the job had open for writing: leave it, cut it back, or refuse.

A restored job continues from its checkpoint, so it writes again what followed it: a file it wrote after
the checkpoint (it kept running, or ran on before it was stopped or rolled back) is cut back to its size
at the checkpoint, the later bytes saved first. That is the job's own work, and the common case.

A file someone else changed once the job stopped is another matter: hibernation releases the job's file
locks, so another program may write its database meanwhile, and a job that continues on it may damage
it. Such a file is never cut silently: the restore is refused, naming the file and what changed, unless
the user asked for ``--rewind`` (cut it back anyway, the later bytes saved first). What "changed once the
job stopped" means depends on what is known:

1. the file's state (size, mtime, inode) recorded when the job last stopped — at its hibernation,
   while it could no longer write: any difference is someone else's;
2. otherwise the time the job's processes ended (they were stopped, killed or exited): a file modified
   after it was not modified by the job;
3. otherwise (an older record) the file is taken as the job's own, as before.

A file that is gone though it was there when the job stopped cannot be given back to the job: that is
refused, ``--rewind`` or not. One missing with nothing recorded is left to CRIU (a file the job had
deleted itself is in the image, and CRIU recreates it). A file CRIU checks that is now shorter than at
the checkpoint cannot be made consistent either.

Cutting a file back undoes what was added to it, not what was changed inside it: a file the job opened
read-write (a database's pages) and modified after the checkpoint keeps those changes when the job is
rolled back or resumed after it ran on (:func:`changed_inside`: the restore warns of them).

The core gathers the states and acts
(:mod:`torpor.core.rewind`); nothing here touches a file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FileState:
    """What ``stat`` says of a file: enough to tell that it changed.

    No device number: on a network file system shared by the nodes (a Slurm job restored elsewhere) it
    differs from node to node for the same file, while the inode number and mtime do not.
    """

    size: int
    mtime_ns: int
    ino: int


@dataclass(frozen=True)
class WrittenFile:
    """A regular file the job had open for writing at the checkpoint."""

    path: str
    size: int  # its size at the checkpoint: what the restored job expects
    checked: bool  # CRIU refuses to restore unless the size is exactly that (not O_APPEND)
    now: FileState | None  # None: no file at that path now
    at_stop: FileState | None = None  # recorded when the job last stopped, if it was
    read_write: bool = False  # opened O_RDWR: it may have been written anywhere, not only at its end


@dataclass(frozen=True)
class Cut:
    """Cut ``path`` back to ``size`` bytes (save what follows first)."""

    path: str
    size: int
    foreign: bool  # someone else changed it: cut because the user passed --rewind


@dataclass(frozen=True)
class Refusal:
    """Why the restore must not proceed because of ``path``; ``rewindable``: ``--rewind`` would do."""

    path: str
    reason: str
    rewindable: bool
    foreign: bool  # changed by someone else (rather than a state torpor cannot fix at all)


@dataclass(frozen=True)
class Plan:
    """What to do with the job's written files; proceed only when ``refusals`` is empty."""

    cuts: tuple[Cut, ...]
    refusals: tuple[Refusal, ...]
    changed_elsewhere: tuple[str, ...]  # paths someone else changed that the restore proceeds on

    @property
    def proceed(self) -> bool:
        return not self.refusals


def changes(before: FileState, now: FileState) -> list[str]:
    """What differs between two states of one file, in words ("size 8192 → 12288 bytes", …)."""
    found = []
    if before.ino != now.ino:
        found.append("replaced (another inode)")
    if before.size != now.size:
        found.append(f"size {before.size} → {now.size} bytes")
    if before.mtime_ns != now.mtime_ns:
        found.append("modified (mtime)")
    return found


def _foreign(file: WrittenFile, stopped_ns: int | None) -> list[str]:
    """How someone other than the job changed the file since the job stopped; empty: nobody did."""
    assert file.now is not None
    if file.at_stop is not None:
        return changes(file.at_stop, file.now)
    if stopped_ns is not None and file.now.mtime_ns > stopped_ns:
        return ["modified after the job stopped (mtime)"]
    return []


def plan(files: list[WrittenFile], stopped_ns: int | None, rewind: bool) -> Plan:
    """Decide, for each file, what the restore does (see the module docstring).

    ``stopped_ns``: when the job's processes last ended (wall clock, ns; None: not known). ``rewind``:
    the user asked to cut files someone else changed anyway.
    """
    cuts: list[Cut] = []
    refusals: list[Refusal] = []
    elsewhere: list[str] = []
    for file in files:
        if file.now is None:
            if file.at_stop is not None:
                refusals.append(
                    Refusal(file.path, "deleted since the job stopped", rewindable=False, foreign=True)
                )
            continue
        foreign = _foreign(file, stopped_ns)
        if foreign and not rewind:
            refusals.append(Refusal(file.path, ", ".join(foreign), rewindable=True, foreign=True))
            continue
        if foreign:
            elsewhere.append(file.path)
        if file.now.size > file.size:
            cuts.append(Cut(file.path, file.size, foreign=bool(foreign)))
        elif file.now.size < file.size and file.checked:
            refusals.append(
                Refusal(
                    file.path,
                    f"shorter than at the checkpoint ({file.now.size} < {file.size} bytes): it was "
                    "truncated or replaced, so the job cannot be restored consistently",
                    rewindable=False,
                    foreign=bool(foreign),
                )
            )
    return Plan(tuple(cuts), tuple(refusals), tuple(elsewhere))


def changed_inside(files: list[WrittenFile], checkpoint_ns: int) -> list[str]:
    """The files opened read-write that were modified after the checkpoint (taken at ``checkpoint_ns``).

    A cut brings back their size, not the bytes the job (or anyone) rewrote in place since, so a job
    restored on them may find its files ahead of its memory: the restore warns of them. A file opened to
    append or write-only is written at its end, which the cut undoes exactly.
    """
    return [
        file.path
        for file in files
        if file.read_write and file.now is not None and file.now.mtime_ns > checkpoint_ns
    ]
