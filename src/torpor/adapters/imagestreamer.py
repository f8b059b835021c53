"""Serve an image to ``criu restore --stream``: CRIU reads every image file through a pipe torpor fills.

With ``--stream`` CRIU opens no image file itself. It connects to ``<images-dir>/streamer-serve.sock``
and, for each file it wants, sends a request and reads the answer (``criu/img-streamer.c``):

- request: ``u32`` length (little-endian), then protobuf ``img_streamer_request_entry``
  ``{required string filename = 1}``;
- answer: ``u32`` length, then ``img_streamer_reply_entry`` ``{required bool exists = 1}``;
- if the file exists, CRIU sends the write end of a new pipe (``SCM_RIGHTS``, one byte of data) and
  reads the file from the read end until end of file, front to back, with no seeking.

CRIU puts the socket's path together from ``--images-dir``, and a socket path holds at most 107 bytes:
:meth:`Criu.restore <torpor.adapters.criu.Criu.restore>` therefore runs a streamed restore inside the
folder with ``--images-dir .``, and the streamer binds through ``/proc/self/fd``.

Confirmed against CRIU 4.2.1: a restore asks for each file once, in the order it restores, and asks for
files an image may lack (``memfd.img``, ``tty-info.img``…), to which the answer is "no". It keeps the
connection open until the tree runs, then closes it. A file cut short makes CRIU fail (it reads exactly
the pages its pagemap lists), so a writer that meets bad data stops writing and the restore fails: no
byte that was not handed over whole can end up in the tree.

:class:`ImageStreamer` answers from a folder (the files in it, spliced into the pipe without a copy)
plus named writers for files that are not in the folder (the memory pages, written as the store
fetches and verifies them). Each file is written by its own thread, since CRIU may hold several files
open and read them in turns (a pagemap and its pages).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from torpor.adapters.criuimage import fields

log = logging.getLogger(__name__)

SOCKET_NAME = "streamer-serve.sock"
_LENGTH = struct.Struct("<I")
_F_SETPIPE_SZ = 1031
#: the pipe's size (the default is 64 KiB): restoring 1 GiB here was fastest with 1 MiB; 64 KiB, 256 KiB
#: and 8 MiB were all slower
PIPE_BYTES = 1 << 20

#: writes one file's content into a pipe (the fd; the caller closes it)
Writer = Callable[[int], None]


class ImageStreamer:
    """Answers one ``criu restore --stream`` on ``folder``; start it before CRIU, stop it after."""

    def __init__(self, folder: Path, writers: Mapping[str, Writer] | None = None) -> None:
        self.folder = folder
        self.writers = dict(writers or {})
        self.path = folder / SOCKET_NAME
        self.served: list[str] = []
        self._errors: list[BaseException] = []
        self._listener: socket.socket | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._threads: list[threading.Thread] = []
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def error(self) -> BaseException | None:
        """The first thing that went wrong writing a file (CRIU then failed, reading it short)."""
        with self._lock:
            return self._errors[0] if self._errors else None

    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        folder = os.open(self.folder, os.O_PATH | os.O_DIRECTORY)
        try:
            self.path.unlink(missing_ok=True)
            # through the folder's fd: a socket path holds at most 107 bytes, a restore folder may not
            listener.bind(f"/proc/self/fd/{folder}/{SOCKET_NAME}")
            listener.listen(1)
        except OSError:
            listener.close()
            raise
        finally:
            os.close(folder)
        self._listener = listener
        thread = threading.Thread(target=self._serve, name="image-streamer", daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop answering; wait (at most ``timeout`` seconds) for the file writers to finish. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        with self._lock:
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
        with contextlib.suppress(OSError):
            self.path.unlink()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- serving ----------------------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._listener is not None
        ready, _, _ = select.select([self._listener.fileno(), self._stop_r], [], [])
        if self._stop_r in ready:
            return
        conn, _ = self._listener.accept()
        with self._lock:
            self._conn = conn
        try:
            with conn:
                while True:
                    name = self._request(conn)
                    if name is None:
                        return  # CRIU is done (or gone)
                    writer = self._writer(name)
                    conn.sendall(_reply(writer is not None))
                    if writer is None:
                        continue
                    fd = _receive_fd(conn)
                    with contextlib.suppress(OSError):  # only a hint to the kernel
                        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
                    thread = threading.Thread(
                        target=self._write, args=(name, writer, fd), name=f"stream {name}", daemon=True
                    )
                    self._threads.append(thread)
                    self.served.append(name)
                    thread.start()
        except OSError as exc:
            log.debug("image streamer connection ended: %s", exc)

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
            with self._lock:
                self._errors.append(exc)
            log.debug("writing %s to criu failed: %s", name, exc)
        finally:
            os.close(fd)

    @staticmethod
    def _request(conn: socket.socket) -> str | None:
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
