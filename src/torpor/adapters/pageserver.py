"""A page server for ``criu lazy-pages``: answers its page requests with memory torpor reads itself.

With ``criu lazy-pages --page-server --ps-socket FD`` the daemon that fills a lazily restored tree's memory
(through userfaultfd) asks a page server for every lazy page instead of reading ``pages-N.img``. This
module is that server, for one connected socket: each request is handed to a callback
``read_pages(pid, vaddr, nr_pages)`` and its answer is sent back, so memory can come from anywhere (the
store fetches and verifies it chunk by chunk, see :mod:`torpor.core.store.lazy`). Only the side CRIU's
lazy-pages client speaks is implemented; dumping through a page server is not.

The protocol, as CRIU 4.2.1 speaks it (``criu/page-xfer.c``, ``criu/uffd.c``; confirmed by logging
the bytes the installed daemon sends):

- Each request is one ``struct page_server_iov``: ``u32 cmd``, 4 bytes of padding (uninitialised: read,
  never trust), ``u64 nr_pages``, ``u64 vaddr``, ``u64 dst_id`` — 32 bytes, little-endian. Older
  CRIUs had a ``u32 nr_pages`` and a 24-byte struct; some forks and upstream's own history differ too,
  so the size is the one thing to re-check when CRIU is upgraded.
- ``cmd`` keeps the command in its low 16 bits and pagemap flags in the high ones.
- ``PS_IOV_GET`` (7) asks for ``nr_pages`` pages at ``vaddr`` of the process whose pid *in the image*
  (the N of ``pagemap-N.img``) is ``dst_id`` — the plain pid: the ``pid << 8 | type`` encoding is
  only used by the dump side's ``PS_IOV_OPEN2``. The answer is a header with ``cmd`` =
  ``PS_IOV_ADD_F | PE_PRESENT << 16``, the same ``vaddr`` and ``dst_id``, and ``nr_pages`` (CRIU accepts
  fewer pages than it asked for; this server always sends all of them), followed by the pages.
- The daemon reads answers asynchronously and may send several requests before reading one (page
  faults and its background copy of the remaining pages, in growing batches of 1, 16, 32… pages); it
  matches answers to requests in order, so they are sent in the order the requests came.
- When every page is in (or the tree is gone) the daemon sends ``PS_IOV_FORCE_CLOSE`` (0x1024; the
  plain ``PS_IOV_CLOSE``, 0x1023, when it connected by address), waits for an ``int32`` status (0) and
  closes the socket.
- The daemon sets ``TCP_CORK``/``TCP_NODELAY`` on the socket; on the unix socket pair used here that
  only logs two harmless warnings.

A read that fails must never let CRIU hand the tree other memory: when the daemon loses its page
server it exits, the kernel drops the tree's userfaultfd registrations, and every page not yet copied
reads as zeros (a restored Python process then died of SIGSEGV here). So on a failed read this server
stops answering, calls ``on_failure`` — which must kill the restored tree — and only then closes the
socket. Killing the tree is the caller's part: only it knows the tree's pid.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable

from torpor.errors import RestoreFailed

log = logging.getLogger(__name__)

PAGE_SIZE = 4096

#: struct page_server_iov of CRIU 4.2: u32 cmd, (4 bytes padding), u64 nr_pages, u64 vaddr, u64 dst_id
IOV = struct.Struct("<I4xQQQ")

PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
PS_CMD_MASK = (1 << PS_CMD_BITS) - 1
PE_PRESENT = 1 << 2

#: the most pages one request may ask for (CRIU's batches are far smaller): a guard against garbage
MAX_PAGES_PER_REQUEST = 1 << 18

#: (pid in the image, virtual address, number of pages) -> exactly nr_pages * 4096 bytes; may raise
ReadPages = Callable[[int, int, int], bytes | bytearray | memoryview]
#: called in the server's thread, before its socket closes, when serving failed
OnFailure = Callable[[BaseException], None]


class PageServer:
    """Serves ``criu lazy-pages`` on one connected socket, in a thread of its own.

    Use :meth:`pair` to get the server and the socket to hand to CRIU, :meth:`start` it, and
    :meth:`stop` it when the restore is over (or failed). :attr:`error` says why serving failed.
    """

    def __init__(
        self, sock: socket.socket, read_pages: ReadPages, *, on_failure: OnFailure | None = None
    ) -> None:
        self._sock = sock
        self._read_pages = read_pages
        self._on_failure = on_failure
        self._thread: threading.Thread | None = None
        self._stopping = False
        #: why serving failed (the reader's exception, or a protocol error), None while all is well
        self.error: BaseException | None = None
        #: the daemon said it has every page it wanted and closed the session properly
        self.finished = False
        self.requests = 0
        self.pages = 0

    @classmethod
    def pair(
        cls, read_pages: ReadPages, *, on_failure: OnFailure | None = None
    ) -> tuple[PageServer, socket.socket]:
        """A server and the other end of its socket, for ``criu lazy-pages --ps-socket FD``.

        The caller passes that end's ``fileno()`` to the daemon and closes it once the daemon started.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        return cls(ours, read_pages, on_failure=on_failure), theirs

    # -- running ------------------------------------------------------------------------------------

    def start(self) -> PageServer:
        self._thread = threading.Thread(target=self._run, name="page-server", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the session to end; True if it did."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """End the session now (e.g. the restore failed): nothing more is answered, the socket closes."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self.wait(timeout)
        self._sock.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- serving ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # every failure ends the session the same way
            if not self._stopping:
                self._fail(exc)
        finally:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        log.error("page server: %s; the lazily restored tree must not run on", exc)
        if self._on_failure is not None:
            try:
                self._on_failure(exc)
            except Exception:  # a failing handler must not keep the socket open forever
                log.exception("page server: on_failure failed")

    def _serve(self) -> None:
        while True:
            header = self._recv_exact(IOV.size)
            if header is None:
                if self._stopping:
                    return
                raise RestoreFailed(
                    "criu lazy-pages closed the page server connection before it had every page (see its log)"
                )
            raw_cmd, nr_pages, vaddr, dst_id = IOV.unpack(header)
            cmd = raw_cmd & PS_CMD_MASK
            if cmd == PS_IOV_GET:
                self._answer(nr_pages, vaddr, dst_id)
            elif cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self._sock.sendall(struct.pack("<i", 0))
                self.finished = True
                return
            else:
                raise RestoreFailed(f"criu lazy-pages sent page server command {raw_cmd:#x}, not a request")

    def _answer(self, nr_pages: int, vaddr: int, dst_id: int) -> None:
        if not 0 < nr_pages <= MAX_PAGES_PER_REQUEST or vaddr % PAGE_SIZE:
            raise RestoreFailed(f"criu lazy-pages asked for {nr_pages} pages at {vaddr:#x}: not a request")
        data = self._read_pages(dst_id, vaddr, nr_pages)
        if len(data) != nr_pages * PAGE_SIZE:
            raise RestoreFailed(
                f"{len(data)} bytes read for {nr_pages} pages at {vaddr:#x} of process {dst_id}"
            )
        header = IOV.pack(PS_IOV_ADD_F | PE_PRESENT << PS_CMD_BITS, nr_pages, vaddr, dst_id)
        self._sock.sendall(header)
        self._sock.sendall(data)
        self.requests += 1
        self.pages += nr_pages

    def _recv_exact(self, size: int) -> bytes | None:
        """``size`` bytes, or None at a clean end of stream before the first of them."""
        buf = bytearray()
        while len(buf) < size:
            part = self._sock.recv(size - len(buf))
            if not part:
                if buf:
                    raise RestoreFailed("criu lazy-pages sent half a page server request")
                return None
            buf += part
        return bytes(buf)
