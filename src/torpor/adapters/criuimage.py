"""Reading CRIU's image files: the records and protobuf fields of the few images torpor looks into.

A CRIU image is two u32 magics, then records of a u32 size and one protobuf message. torpor reads the
handful of fields it needs by hand (CRIU's Python bindings are not packaged for this setup): the open
files and bound unix sockets of ``files.img`` (for the engine's checks before a restore), the timings
of ``stats-dump``, and what :mod:`torpor.core.store.pagemap` and :mod:`torpor.adapters.imagestreamer`
decode themselves with :func:`fields` and :func:`records`. Running CRIU is :mod:`torpor.adapters.criu`'s
job; this module only reads what it wrote.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_FD_TYPE_REG = 1
_FD_TYPE_INETSK = 4
_FD_TYPE_UNIXSK = 5
_IPPROTO_TCP = 6
_TCP_LISTEN = 10  # TCP_LISTEN in the kernel's tcp_states
_O_ACCMODE = 3
_O_APPEND = 0o2000
_SOCK_DGRAM = 2
_USK_EXTERN = 1  # UnixSkEntry.uflags: a socket outside the tree, recorded only as a peer
_O_RDWR = 2
_PROT_WRITE = 2
_VMA_FILE_SHARED = 1 << 7  # CRIU's VMA_FILE_SHARED (criu/include/image.h)


@dataclass(frozen=True)
class DumpStats:
    """What CRIU measured during a dump (from its ``stats-dump`` image), in seconds and pages."""

    freezing_s: float
    frozen_s: float
    memdump_s: float
    memwrite_s: float
    pages_written: int


@dataclass(frozen=True)
class OpenFile:
    """A regular file the dumped tree had open, as recorded in ``files.img``."""

    path: str
    writable: bool
    size: int | None  # CRIU checks this size on restore; None when it does not (e.g. O_APPEND logs)
    append: bool = False  # opened with O_APPEND
    pos: int = 0  # the descriptor's file offset at the dump (for O_APPEND: the end at its last write)
    read_write: bool = False  # opened O_RDWR (a database's files): written anywhere, not only at the end


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    byte = buf[pos]
    if byte < 0x80:  # most keys and small numbers: one byte
        return byte, pos + 1
    result, shift = byte & 0x7F, 7
    while True:
        pos += 1
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos + 1
        shift += 7


def _value(buf: bytes, pos: int, wire: int) -> tuple[int | bytes, int]:
    """The value of wire type ``wire`` at ``pos``, and where the next key begins."""
    if wire == 0:
        return _varint(buf, pos)
    if wire == 2:
        length, pos = _varint(buf, pos)
        return buf[pos : pos + length], pos + length
    if wire in (1, 5):
        width = 8 if wire == 1 else 4
        return int.from_bytes(buf[pos : pos + width], "little"), pos + width
    raise ValueError(f"unsupported protobuf wire type {wire}")


def _values(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one protobuf message, in order."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        value, pos = _value(buf, pos, key & 7)
        yield key >> 3, value


def fields(buf: bytes) -> dict[int, int | bytes]:
    """Decode one protobuf message into {field number: value} (last value wins; enough for our needs).

    The same loop as :func:`_values`, without a generator: a pagemap of a few GiB has thousands of
    entries, read on the way to a lazy restore."""
    out: dict[int, int | bytes] = {}
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        out[key >> 3], pos = _value(buf, pos, key & 7)
    return out


def records(raw: bytes, partial: bool = False) -> list[bytes]:
    """The protobuf messages of a CRIU image: two u32 magics, then (u32 size, message) records.

    A record cut short at the end raises ValueError, unless ``partial`` (the image is still being
    written, or is read as far as it goes): then it is left out.
    """
    pos, out = 8, []
    while pos + 4 <= len(raw):
        size = int.from_bytes(raw[pos : pos + 4], "little")
        pos += 4
        if pos + size > len(raw):
            if partial:
                break
            raise ValueError("truncated record")
        out.append(raw[pos : pos + size])
        pos += size
    return out


def file_entries(images_dir: Path) -> list[dict[int, int | bytes]]:
    """The FileEntry messages of ``files.img`` (none when it is missing), as far as it goes."""
    try:
        raw = (images_dir / "files.img").read_bytes()
    except OSError:
        return []
    return [fields(record) for record in records(raw, partial=True)]


def unix_socket_paths(images_dir: Path) -> list[str]:
    """Filesystem paths of the unix sockets the tree had bound (FileEntry.usk=16, UnixSkEntry.name=11)."""
    paths = []
    for entry in file_entries(images_dir):
        usk = entry.get(16)
        if entry.get(1) != _FD_TYPE_UNIXSK or not isinstance(usk, bytes):
            continue
        name = fields(usk).get(11)
        if isinstance(name, bytes) and name.startswith(b"/"):
            paths.append(name.rstrip(b"\0").decode(errors="surrogateescape"))
    return paths


@dataclass(frozen=True)
class ExternalUnixPeer:
    """A unix socket of the dumped tree whose peer was outside it (dumped with ``--external unix[ino]``)."""

    ino: int  # the tree's socket: what ``--inherit-fd fd[N]:socket:[ino]`` names on restore
    type: int  # SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET
    peer_name: str  # the outside socket's address ("" when it has none)

    @property
    def reconnects(self) -> bool:
        """CRIU connects it to its peer's address again on restore (a datagram socket to a named peer)."""
        return self.type == _SOCK_DGRAM and bool(self.peer_name)


def external_unix_peers(images_dir: Path) -> list[ExternalUnixPeer]:
    """The tree's unix sockets connected to a socket outside it, from ``files.img``.

    UnixSkEntry{ino=2, type=3, uflags=6, peer=8, name=11}; the outside end is an entry of its own with
    ``uflags`` USK_EXTERN (and always type SOCK_DGRAM: the tree's end has the real type).
    """
    sockets: list[dict[int, int | bytes]] = []
    for entry in file_entries(images_dir):
        raw = entry.get(16)
        if entry.get(1) == _FD_TYPE_UNIXSK and isinstance(raw, bytes):
            sockets.append(fields(raw))
    outside: dict[int, bytes] = {}
    for usk in sockets:
        ino, flags, name = usk.get(2), usk.get(6, 0), usk.get(11, b"")
        if isinstance(ino, int) and isinstance(flags, int) and flags & _USK_EXTERN:
            outside[ino] = name if isinstance(name, bytes) else b""
    found = []
    for usk in sockets:
        ino, kind, flags, peer = usk.get(2), usk.get(3), usk.get(6, 0), usk.get(8, 0)
        if not isinstance(ino, int) or not isinstance(kind, int) or not isinstance(flags, int):
            continue
        if flags & _USK_EXTERN or not isinstance(peer, int) or peer not in outside:
            continue
        text = outside[peer].rstrip(b"\0").decode(errors="surrogateescape")
        found.append(ExternalUnixPeer(ino=ino, type=kind, peer_name=text))
    return found


def open_files(images_dir: Path) -> list[OpenFile]:
    """Regular files in ``files.img``.

    FileEntry{type=1, reg=3: RegFileEntry{flags=2, pos=3, name=6, size=8}}.
    """
    found = []
    for entry in file_entries(images_dir):
        reg = entry.get(3)
        if entry.get(1) != _FD_TYPE_REG or not isinstance(reg, bytes):
            continue
        reg_fields = fields(reg)
        name, flags, size, pos = (
            reg_fields.get(6),
            reg_fields.get(2, 0),
            reg_fields.get(8),
            reg_fields.get(3, 0),
        )
        if not isinstance(name, bytes) or not isinstance(flags, int):
            continue
        found.append(
            OpenFile(
                path=name.decode(errors="surrogateescape"),
                writable=(flags & _O_ACCMODE) != 0,
                size=size if isinstance(size, int) else None,
                append=bool(flags & _O_APPEND),
                pos=pos if isinstance(pos, int) else 0,
                read_write=(flags & _O_ACCMODE) == _O_RDWR,
            )
        )
    return found


@dataclass(frozen=True)
class ImageListener:
    """A TCP socket the dumped tree had listening: where, and whether it shares its port (SO_REUSEPORT)."""

    host: str
    port: int
    reuseport: bool


def tcp_listeners(images_dir: Path) -> list[ImageListener]:
    """The listening TCP sockets (v4 and v6) in ``files.img``.

    FileEntry{type=1 (INETSK is 4), isk=4: InetSkEntry{family=3, proto=5, state=6, src_port=7,
    src_addr=11 (repeated u32), opts=14: SkOptsEntry{so_reuseport=17}}}; state 10 is LISTEN.
    """
    found = []
    for entry in file_entries(images_dir):
        raw = entry.get(4)
        if entry.get(1) != _FD_TYPE_INETSK or not isinstance(raw, bytes):
            continue
        isk = fields(raw)
        if isk.get(5) != _IPPROTO_TCP or isk.get(6) != _TCP_LISTEN:
            continue
        words = [w for w in repeated(raw, 11) if isinstance(w, int)]
        packed = b"".join(w.to_bytes(4, "little") for w in words)
        host = str(ipaddress.ip_address(packed)) if len(packed) in (4, 16) else "0.0.0.0"
        opts = isk.get(14)
        reuseport = isinstance(opts, bytes) and bool(fields(opts).get(17, 0))
        port = isk.get(7)
        if isinstance(port, int):
            found.append(ImageListener(host, port, reuseport))
    return found


def has_ghost_files(images_dir: Path) -> bool:
    """Whether the image holds files that were deleted while open or mapped (``ghost-file-N.img``): CRIU
    brings each back at a path of its own making beside the original while it restores."""
    return any(images_dir.glob("ghost-file-*.img"))


def repeated(buf: bytes, number: int) -> list[int | bytes]:
    """Every value of field ``number`` in one protobuf message, in order (for repeated fields)."""
    return [value for field, value in _values(buf) if field == number]


def shared_file_mappings(images_dir: Path) -> list[str]:
    """Regular files the tree mapped ``MAP_SHARED`` and writable: CRIU keeps no copy of their content.

    Their pages are the file's own (CRIU maps the file again on restore), so a restore gives the job
    the file as it is now. MmEntry.vmas=14: VmaEntry{shmid=4 (the file's id in files.img), prot=5,
    status=7, fdflags=10}; FileEntry{id=2, reg=3: RegFileEntry{name=6}}.
    """
    names: dict[int, str] = {}
    for entry in file_entries(images_dir):
        reg, file_id = entry.get(3), entry.get(2)
        if entry.get(1) == _FD_TYPE_REG and isinstance(reg, bytes) and isinstance(file_id, int):
            name = fields(reg).get(6)
            if isinstance(name, bytes):
                text = name.decode(errors="surrogateescape")
                names[file_id] = text if text.startswith("/") else "/" + text
    found: list[str] = []
    for image in sorted(images_dir.glob("mm-*.img")):
        try:
            messages = records(image.read_bytes())
        except (OSError, ValueError):
            continue
        for message in messages:
            for vma in repeated(message, 14):
                if not isinstance(vma, bytes):
                    continue
                v = fields(vma)
                status, prot, fdflags, shmid = v.get(7, 0), v.get(5, 0), v.get(10, 0), v.get(4)
                if not (isinstance(status, int) and status & _VMA_FILE_SHARED):
                    continue
                writable = (isinstance(prot, int) and prot & _PROT_WRITE) or (
                    isinstance(fdflags, int) and fdflags & _O_ACCMODE == _O_RDWR
                )
                path = names.get(shmid) if isinstance(shmid, int) else None
                if writable and path is not None and path not in found:
                    found.append(path)
    return found


def read_dump_stats(images_dir: Path) -> DumpStats:
    """Parse ``stats-dump``; zeros when CRIU wrote none (never fail a good dump over statistics)."""
    try:
        raw = (images_dir / "stats-dump").read_bytes()
        size = int.from_bytes(raw[8:12], "little")
        entry = fields(raw[12 : 12 + size])
        dump = entry.get(1)
        stats = fields(dump) if isinstance(dump, bytes) else {}
    except (OSError, ValueError, IndexError):
        stats = {}

    def usec(number: int) -> float:
        value = stats.get(number, 0)
        return value / 1e6 if isinstance(value, int) else 0.0

    pages = stats.get(7, 0)
    return DumpStats(
        freezing_s=usec(1),
        frozen_s=usec(2),
        memdump_s=usec(3),
        memwrite_s=usec(4),
        pages_written=pages if isinstance(pages, int) else 0,
    )
