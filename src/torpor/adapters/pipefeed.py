"""Fill a pipe by reference: ``vmsplice(2)`` hands the pipe the writer's own pages, with no copy.

``write(2)`` into a pipe copies every byte into pages the pipe allocates for itself, 4 KiB at a time;
the reader then copies them out again. ``vmsplice`` instead puts references to the writer's pages into
the pipe, and the reader copies straight out of them. The price is that the writer must leave those
bytes alone until the reader has read them. To keep that promise a :class:`PipeFeed` puts only memory
it owns into the pipe: buffers it lends from a ring of page-aligned slots (:meth:`PipeFeed.buffer`),
each lent again only once the reader has read every byte put from it, and a mapping of zeros no one
writes to.

"Read" is measured with ``FIONREAD``: the bytes put so far, less those still in the pipe. The pipe's
lock covers both the reader's copy and that count, so a byte no longer counted has been copied out.
This holds for a reader that copies out (``read(2)``, as ``criu restore --stream`` does); one that
``splice``-d the pages on to somewhere else would take the references with it, and must not be fed
this way.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import mmap
import os
import select
import termios
import time

_PAGE = mmap.PAGESIZE
_F_GETPIPE_SZ = 1032
_LENT = -1  # a slot's end while it is lent and not yet put
_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc.vmsplice.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_size_t, ctypes.c_uint]
_libc.vmsplice.restype = ctypes.c_ssize_t


def _address(view: memoryview) -> int:
    """Where the first byte of ``view`` (writable memory) lives."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class PipeFeed:
    """Writes memory it lends into the pipe ``fd`` (its write end) by reference.

    Only memory the feed owns goes into the pipe: buffers from :meth:`buffer` (a ring of slots of
    ``slot_bytes``, rounded up to whole pages) and zeros (:meth:`put_zeros`). ``spare``: how many
    slots the ring has beyond what the pipe can hold at once, i.e. how many buffers a caller may
    fill ahead of the one it puts next. Call :meth:`finish` once everything is put: it returns when
    the reader has read it all.
    """

    def __init__(self, fd: int, slot_bytes: int, spare: int = 2) -> None:
        self.fd = fd
        self.capacity = fcntl.fcntl(fd, _F_GETPIPE_SZ)
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        count = -(-self.capacity // self.slot_bytes) + max(1, spare)
        self._ring = mmap.mmap(-1, count * self.slot_bytes)
        self._base = _address(memoryview(self._ring))
        self._slots = [
            memoryview(self._ring)[i * self.slot_bytes : (i + 1) * self.slot_bytes] for i in range(count)
        ]
        self._slot_ends = [0] * count  # for each slot: where the bytes last put from it end in the stream
        self._lent = 0  # slots lent so far
        self._zeros = memoryview(mmap.mmap(-1, self.slot_bytes))  # never written: reads as zeros
        self.written = 0  # bytes put so far
        self._poll = select.poll()
        self._poll.register(fd, select.POLLERR)

    def buffer(self) -> memoryview:
        """A page-aligned buffer of ``slot_bytes`` to fill, then :meth:`put` (all of it or a part).

        Slots are lent in turn; a slot is lent again once the reader has read what was put from it.
        """
        index = self._lent % len(self._slots)
        if self._slot_ends[index] == _LENT:
            raise RuntimeError(f"PipeFeed: more than {len(self._slots)} buffers lent and not put")
        self._lent += 1
        self._wait_read(self._slot_ends[index])
        self._slot_ends[index] = _LENT
        return self._slots[index]

    def put(self, piece: memoryview) -> None:
        """Put ``piece``, a part of a buffer this feed lent, into the pipe (blocks while it is full).

        Raises BrokenPipeError if the reader went away, ValueError for memory the feed does not own.
        An empty piece puts nothing (its buffer stays lent).
        """
        if not piece.nbytes:
            return
        offset = _address(piece) - self._base
        if not 0 <= offset <= len(self._ring) - piece.nbytes:
            raise ValueError("PipeFeed.put takes only memory from PipeFeed.buffer")
        self._splice(piece)
        self._slot_ends[offset // self.slot_bytes] = self.written

    def put_zeros(self, count: int) -> None:
        """Put ``count`` zero bytes into the pipe."""
        while count > 0:
            part = min(count, len(self._zeros))
            self._splice(self._zeros[:part])
            count -= part

    def finish(self) -> None:
        """Wait until the reader has read every byte put; raises BrokenPipeError if it went away."""
        self._wait_read(self.written)

    # -- inside --

    def _splice(self, piece: memoryview) -> None:
        iov = _IoVec(_address(piece), piece.nbytes)
        while iov.length:
            done = _libc.vmsplice(self.fd, ctypes.byref(iov), 1, 0)
            if done < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err == errno.EPIPE:
                    raise BrokenPipeError(err, "the reader of the pipe went away")
                raise OSError(err, f"vmsplice: {os.strerror(err)}")
            iov.base += done
            iov.length -= done
        self.written += piece.nbytes

    def _read_upto(self) -> int:
        """Bytes of the stream the reader has read: those put, less those still in the pipe."""
        count = array.array("i", [0])
        fcntl.ioctl(self.fd, termios.FIONREAD, count)
        return self.written - count[0]

    def _wait_read(self, upto: int) -> None:
        # the pipe holds at most `capacity` bytes: what lies that far back is read (no system call)
        if upto <= 0 or self.written - upto >= self.capacity:
            return
        while self._read_upto() < upto:
            if self._poll.poll(0):  # POLLERR: the read end is closed
                raise BrokenPipeError(errno.EPIPE, "the reader of the pipe went away")
            time.sleep(0.0002)
