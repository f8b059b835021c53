"""CRIU's image-streamer protocol, both ways: serve an image to ``criu restore --stream``
(:class:`ImageStreamer`), and take one from ``criu dump --stream`` (:class:`ImageCapture`).

With ``--stream`` CRIU opens no image file itself. It connects to a socket in its ``--images-dir``
(``streamer-serve.sock`` to restore, ``streamer-capture.sock`` to dump) and, for each file, sends a
request (``criu/img-streamer.c``):

- request: ``u32`` length (little-endian), then protobuf ``img_streamer_request_entry``
  ``{required string filename = 1}``;
- restore only, an answer: ``u32`` length, then ``img_streamer_reply_entry`` ``{required bool exists = 1}``;
- if the file exists (a dump: always), CRIU sends one end of a new pipe (``SCM_RIGHTS``, one byte of
  data) and reads the file from the other end until end of file, or writes it there and closes it, front
  to back, with no seeking.

CRIU puts the socket's path together from ``--images-dir``, and a socket path holds at most 107 bytes:
:class:`~torpor.adapters.criu.Criu` therefore runs a streamed dump or restore inside the folder with
``--images-dir .``, and the streamer binds through ``/proc/self/fd``.

Confirmed against CRIU 4.2.1, restoring: a restore asks for each file once, in the order it restores,
and asks for files an image may lack (``memfd.img``, ``tty-info.img``…), to which the answer is "no". It
keeps the connection open until the tree runs, then closes it. A file cut short makes CRIU fail (it
reads exactly the pages its pagemap lists), so a writer that meets bad data stops writing and the
restore fails: no byte that was not handed over whole can end up in the tree.

:class:`ImageStreamer` answers from a folder (the files in it, spliced into the pipe without a copy)
plus named writers for files that are not in the folder (the memory pages, written as the store
fetches and verifies them). Each file is written by its own thread, since CRIU may hold several files
open and read them in turns (a pagemap and its pages).

Confirmed against CRIU 4.2.1, dumping (:class:`ImageCapture`): a dump sends each file once; it opens a
process's ``pagemap-PID.img`` (PID as the job's PID namespace numbers it) right before that process's
``pages-N.img``, and holds both open at once; ``stats-dump`` it writes into the folder itself, after the
tree runs again. The pages reach the pipe by reference (``splice`` of the pipe its parasite filled with
``vmsplice``): until torpor has read them they are the job's own memory, so the job must stay frozen
until then. CRIU runs its ``post-dump`` action script with every file closed and the tree still frozen;
:data:`CAPTURE_SCRIPT` waits there until torpor says every pipe was read to its end.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import mmap
import os
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from torpor.adapters.criuimage import fields
from torpor.adapters.system import disk, private

log = logging.getLogger(__name__)

SOCKET_NAME = "streamer-serve.sock"
CAPTURE_SOCKET_NAME = "streamer-capture.sock"
_LENGTH = struct.Struct("<I")
_F_SETPIPE_SZ = 1031
#: the pipe's size (the default is 64 KiB): restoring 1 GiB here was fastest with 1 MiB; 64 KiB, 256 KiB
#: and 8 MiB were all slower
PIPE_BYTES = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")

#: writes one file's content into a pipe (the fd; the caller closes it)
Writer = Callable[[int], None]


class _Session:
    """What both ways share: a socket listening in the image folder for CRIU's one connection, a thread
    serving it and a thread per file, and a stop that ends them all."""

    def __init__(self, folder: Path, socket_name: str) -> None:
        self.folder = folder
        self.path = folder / socket_name
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = False

    def _listen(self, name: str, converse: Callable[[socket.socket], None]) -> None:
        """Listen for CRIU, and ``converse`` with it over its connection in a thread called ``name``."""
        self._listener = _listen(self.folder, self.path.name)
        self._spawn(name, self._serve, name, converse)

    def _serve(self, name: str, converse: Callable[[socket.socket], None]) -> None:
        conn = self._accept()
        if conn is None:
            return
        try:
            with conn:
                converse(conn)
        except OSError as exc:
            log.debug("%s: connection ended: %s", name, exc)

    def _spawn(self, name: str, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> socket.socket | None:
        """CRIU's connection, once it comes; None when stopped first."""
        assert self._listener is not None
        ready, _, _ = select.select([self._listener.fileno(), self._stop_r], [], [])
        if self._stop_r in ready:
            return None
        conn, _ = self._listener.accept()
        with self._cond:
            self._conn = conn
        return conn

    def _close(self, timeout: float, files: tuple[Path, ...] = (), fds: tuple[int, ...] = ()) -> None:
        """End the session: wait (at most ``timeout`` seconds) for its threads; remove the socket and
        ``files``, close ``fds``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        with self._cond:
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fd in (*fds, self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in (self.path, *files):
            with contextlib.suppress(OSError):
                path.unlink()


class ImageStreamer(_Session):
    """Answers one ``criu restore --stream`` on ``folder``; start it before CRIU, stop it after."""

    def __init__(self, folder: Path, writers: Mapping[str, Writer] | None = None) -> None:
        super().__init__(folder, SOCKET_NAME)
        self.writers = dict(writers or {})
        self.served: list[str] = []
        self._errors: list[BaseException] = []

    @property
    def error(self) -> BaseException | None:
        """The first thing that went wrong writing a file (CRIU then failed, reading it short)."""
        with self._cond:
            return self._errors[0] if self._errors else None

    def start(self) -> None:
        self._listen("image-streamer", self._answer_requests)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop answering; wait (at most ``timeout`` seconds) for the file writers to finish. Idempotent."""
        self._close(timeout)

    # -- serving ----------------------------------------------------------------------------------------

    def _answer_requests(self, conn: socket.socket) -> None:
        while True:
            name = _request(conn)
            if name is None:
                return  # CRIU is done (or gone)
            writer = self._writer(name)
            conn.sendall(_reply(writer is not None))
            if writer is None:
                continue
            fd = _receive_fd(conn)
            with contextlib.suppress(OSError):  # only a hint to the kernel
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
            self.served.append(name)
            self._spawn(f"stream {name}", self._write, name, writer, fd)

    def _writer(self, name: str) -> Writer | None:
        if name in self.writers:
            return self.writers[name]
        if "/" in name or name.startswith("."):
            return None
        path = self.folder / name
        if not path.is_file() or path.is_symlink():
            return None
        return lambda fd: splice_file(path, fd)

    def _write(self, name: str, writer: Writer, fd: int) -> None:
        try:
            writer(fd)
        except BaseException as exc:  # CRIU reads the file short and fails; the caller reports why
            with self._cond:
                self._errors.append(exc)
            log.debug("writing %s to criu failed: %s", name, exc)
        finally:
            os.close(fd)


#: CRIU runs this at each step of a streamed dump (``--action-script``). At ``post-dump`` every image file
#: is closed and the tree is still frozen: it asks torpor (a line into the FIFO ``$TORPOR_CAPTURE_ASK``,
#: opened read-write so that it never blocks) whether every pipe was read to its end, and waits for the
#: answer. Any answer but ``complete``, or the death of the process that captures (``$TORPOR_CAPTURE_PID``),
#: makes CRIU fail the dump and let the tree run on as it was.
CAPTURE_SCRIPT = """#!/bin/sh
# torpor: keep a dumped tree frozen until torpor has read its pages (written by torpor; see adapters/imagestreamer.py)
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
echo ask 1<>"$TORPOR_CAPTURE_ASK"
while [ ! -e "$TORPOR_CAPTURE_VERDICT" ]; do
    kill -0 "$TORPOR_CAPTURE_PID" 2>/dev/null || [ -e "$TORPOR_CAPTURE_VERDICT" ] || exit 1
    sleep 0.001
done
read -r verdict < "$TORPOR_CAPTURE_VERDICT"
[ "$verdict" = complete ]
"""
#: torpor's own files in a capture's folder (dot files: the store leaves them out of the image)
ASK_NAME = ".capture-ask"
VERDICT_NAME = ".capture-verdict"
RESERVE_PREFIX = ".reserve-"
_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
_PAGES = re.compile(r"pages-\d+\.img")
#: at ``post-dump`` at most a pipe's worth (:data:`PIPE_BYTES`) of each file is left to read: far less
#: than this takes, unless something is wrong (then the dump fails and the job runs on)
DRAIN_TIMEOUT_S = 30.0


class ImageCapture(_Session):
    """Takes one ``criu dump --stream`` into ``folder``, each file as CRIU names it; start it before
    CRIU, stop it after (or use it as a context manager).

    Each file is read from its pipe by its own thread, into the file (``splice``: one copy, on whichever
    core is free while CRIU's goes on gathering pages). ``reserve``: bytes of memory to set aside for the
    pages of each process (by its PID in the job's namespace) in :meth:`start`, before anything is
    frozen: a hidden file written full of zeros, unless ``taken`` names a file in the folder that holds
    memory already (the pages of an older image of the same job, written over as they are). Memory set
    aside is also mapped into this process then, every page of it (``MAP_POPULATE``), and that process's
    pages are read from the pipe straight into the mapping: a plain copy, about twice as fast here as
    ``splice`` into a tmpfs file, which looks up and locks each page of the file as it writes it. The
    pages file is cut to its length at its end (the rest given back) and only then given its name:
    until then no reader of the folder sees it. ``taken`` needs no ``reserve``
    (a hibernation's: what it names is set aside, and nothing else). A reservation that does not fit is
    skipped (those pages take memory as they come). Files of ``taken`` no pages file used are removed
    when the capture stops.
    """

    def __init__(
        self,
        folder: Path,
        reserve: Mapping[int, int] | None = None,
        taken: Mapping[int, Path] | None = None,
        drain_timeout: float = DRAIN_TIMEOUT_S,
    ) -> None:
        super().__init__(folder, CAPTURE_SOCKET_NAME)
        self.drain_timeout = drain_timeout
        self.ask = folder / ASK_NAME
        self.verdict = folder / VERDICT_NAME
        #: the files CRIU sent, in its order
        self.captured: list[str] = []
        self._wanted = {pid: -(-size // _PAGE) * _PAGE for pid, size in (reserve or {}).items() if size > 0}
        self._taken = dict(taken or {})
        self._reserves: dict[int, _SetAside] = {}  # namespace pid -> its memory, not taken yet
        self._mapped: list[_SetAside] = []  # all of it, unmapped at stop (after the job runs again)
        self._last_pagemap: int | None = None
        self._open: set[str] = set()
        self._errors: list[str] = []
        self._verdict: str | None = None
        self._ask_fd = -1

    def __enter__(self) -> ImageCapture:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    @property
    def problem(self) -> str | None:
        """Why the capture failed the dump (CRIU then failed too); None while nothing went wrong."""
        with self._cond:
            if self._verdict is not None and self._verdict != "complete":
                return self._verdict
            return self._errors[0] if self._errors else None

    def env(self) -> dict[str, str]:
        """The environment :data:`CAPTURE_SCRIPT` needs, for CRIU to pass on to it."""
        return {
            "TORPOR_CAPTURE_ASK": str(self.ask),
            "TORPOR_CAPTURE_VERDICT": str(self.verdict),
            "TORPOR_CAPTURE_PID": str(os.getpid()),
        }

    def start(self) -> None:
        for pid, path in self._taken.items():
            if path.is_file() and not path.is_symlink():
                self._reserves[pid] = self._map(path)
        for pid, size in self._wanted.items():
            if pid not in self._reserves:
                self._reserve(pid, size)
        os.mkfifo(self.ask, 0o600)
        self._ask_fd = private.open_private(self.ask, os.O_RDONLY | os.O_NONBLOCK)
        self._listen("image-capture", self._take_files)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking files; wait (at most ``timeout`` seconds) for the readers; remove torpor's own files
        and the reservations no pages file took. Idempotent."""
        unused = (memory.path for memory in self._reserves.values())
        self._close(
            timeout, files=(self.ask, self.verdict, *unused, *self._taken.values()), fds=(self._ask_fd,)
        )
        for memory in self._mapped:
            memory.unmap()

    # -- before the dump ----------------------------------------------------------------------------------

    def _reserve(self, pid: int, size: int) -> None:
        path = self.folder / f"{RESERVE_PREFIX}{pid}"
        try:
            fd = private.open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as exc:
            log.debug("no reservation for process %d: %s", pid, exc)
            return
        try:
            disk.fill_with_zeros(fd, size)
        except OSError as exc:  # no room: its pages take memory as they come
            log.debug("no reservation of %d bytes for process %d: %s", size, pid, exc)
            path.unlink(missing_ok=True)
            return
        finally:
            os.close(fd)
        self._reserves[pid] = self._map(path)

    def _map(self, path: Path) -> _SetAside:
        memory = _SetAside.map(path)
        self._mapped.append(memory)
        return memory

    # -- serving ----------------------------------------------------------------------------------------

    def _take_files(self, conn: socket.socket) -> None:
        watched = [conn.fileno(), self._ask_fd, self._stop_r]
        while True:
            ready, _, _ = select.select(watched, [], [])
            if conn.fileno() in ready:
                # each request before the question: CRIU sent them all before it ran the script
                if not self._take(conn):
                    return  # CRIU is done (or gone)
            elif self._ask_fd in ready:
                os.read(self._ask_fd, 64)
                watched.remove(self._ask_fd)  # asked once: its writer is gone, it reads as ready
                self._answer()
            else:
                return

    def _take(self, conn: socket.socket) -> bool:
        """Take CRIU's next file: its name, its pipe, a thread to read it; False at the end."""
        name = _request(conn)
        if name is None:
            return False
        fd = _receive_fd(conn)
        with contextlib.suppress(OSError):  # only a hint to the kernel
            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        if "/" in name or name.startswith(".") or not name:
            os.close(fd)  # CRIU's own names are plain: fail the dump (its write meets a closed pipe)
            with self._cond:
                self._errors.append(f"criu sent a file named {name!r}")
            return True
        reserve = None
        if match := _PAGEMAP.fullmatch(name):
            self._last_pagemap = int(match.group(1))
        elif _PAGES.fullmatch(name):
            owner, self._last_pagemap = self._last_pagemap, None
            reserve = self._reserves.pop(owner, None) if owner is not None else None
        with self._cond:
            self.captured.append(name)
            self._open.add(name)
        self._spawn(f"capture {name}", self._read, name, fd, reserve)
        return True

    def _read(self, name: str, pipe: int, reserve: _SetAside | None) -> None:
        """Read file ``name`` from ``pipe`` to its end: into ``reserve``, then cut and named, if given."""
        path = self.folder / name
        try:
            out = private.open_private(
                reserve.path if reserve else path, os.O_WRONLY | os.O_CREAT | (0 if reserve else os.O_TRUNC)
            )
            try:
                written = reserve.fill(pipe) if reserve else 0
                os.lseek(out, written, os.SEEK_SET)  # past what the mapping held: written as it comes
                while moved := os.splice(pipe, out, PIPE_BYTES):
                    written += moved
                if reserve is not None:
                    os.ftruncate(out, written)
                    os.rename(reserve.path, path)
            finally:
                os.close(out)
        except OSError as exc:
            if reserve is not None:
                reserve.path.unlink(missing_ok=True)
            with self._cond:
                self._errors.append(f"writing {name}: {exc.strerror or exc}")
        finally:
            os.close(pipe)  # after an error, before its end: CRIU's next write fails, and the dump with it
            with self._cond:
                self._open.discard(name)
                self._cond.notify_all()

    def _answer(self) -> None:
        """CRIU's post-dump script asks: answer once every file is read to its end (or why not)."""
        with self._cond:
            drained = self._cond.wait_for(lambda: not self._open, timeout=self.drain_timeout)
            if self._errors:
                verdict = "failed: " + "; ".join(self._errors)
            elif not drained:
                left = ", ".join(sorted(self._open))
                verdict = f"failed: {left} not read to the end within {self.drain_timeout:g} s"
            else:
                verdict = "complete"
            self._verdict = verdict
        tmp = self.verdict.with_name(f"{self.verdict.name}.tmp")
        private.write_private(tmp, (verdict + "\n").encode())
        os.replace(tmp, self.verdict)  # whole or absent: the script never reads half a verdict


class _SetAside:
    """A file of memory set aside for one process's pages, and (unless mapping it failed) that memory
    mapped into this process, every page of it, before the freeze."""

    def __init__(self, path: Path, memory: mmap.mmap | None) -> None:
        self.path = path
        self._memory = memory

    @classmethod
    def map(cls, path: Path) -> _SetAside:
        """Map the file ``path`` with its pages in place (or leave it unmapped, to be written with
        ``splice``: a file of 0 bytes, or no room for the mapping)."""
        try:
            fd = private.open_private(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                memory = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE) if size else None
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            log.debug("memory set aside in %s not mapped: %s", path.name, exc)
            memory = None
        return cls(path, memory)

    def fill(self, pipe: int) -> int:
        """Read ``pipe`` into the mapping until its end or the mapping's; returns the bytes read."""
        if self._memory is None:
            return 0
        view = memoryview(self._memory)
        filled = 0
        try:
            while filled < len(view) and (moved := os.readv(pipe, [view[filled : filled + PIPE_BYTES]])):
                filled += moved
        finally:
            view.release()
        return filled

    def unmap(self) -> None:
        """Unmap the memory (not while the job is frozen: it holds this process's memory map ~60 ms per
        GiB, and with it any thread that takes a page fault, the one answering CRIU's question too)."""
        if self._memory is not None:
            self._memory.close()
            self._memory = None


def _listen(folder: Path, name: str) -> socket.socket:
    """A unix socket listening at ``folder/name``, bound through the folder's fd: a socket path holds at
    most 107 bytes, an image folder may not."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        (folder / name).unlink(missing_ok=True)
        listener.bind(f"/proc/self/fd/{fd}/{name}")
        listener.listen(1)
    except OSError:
        listener.close()
        raise
    finally:
        os.close(fd)
    return listener


def _request(conn: socket.socket) -> str | None:
    """The file name of CRIU's next request; None when it closed the connection, or sent no request."""
    head = _read_exactly(conn, _LENGTH.size)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    body = _read_exactly(conn, length)
    if body is None:
        return None
    try:
        name = fields(body).get(1)  # img_streamer_request_entry.filename
    except (ValueError, IndexError):
        return None  # not a request: end the session (CRIU then fails)
    return name.decode(errors="surrogateescape") if isinstance(name, bytes) else None


def splice_file(path: Path, fd: int) -> None:
    """Copy the file ``path`` into the pipe ``fd`` with splice (page references, no copy of the bytes)."""
    with open(path, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        offset = 0
        while offset < size:
            moved = os.splice(src.fileno(), fd, size - offset, offset_src=offset)
            if moved == 0:
                raise OSError(f"{path} ended early")
            offset += moved


# -- the wire format ----------------------------------------------------------------------------------


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            return None
        data += more
    return data


def _reply(exists: bool) -> bytes:
    """A length-prefixed ``img_streamer_reply_entry``: field 1, a varint (key byte 0x08), 0 or 1."""
    body = bytes([1 << 3, int(exists)])
    return _LENGTH.pack(len(body)) + body


def _receive_fd(conn: socket.socket) -> int:
    fds = array.array("i")
    _, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not fds:
        raise OSError("criu sent no pipe")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]
