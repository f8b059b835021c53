"""The hot tier's own folder: made private, checked to be torpor's own on every use, mounted, removed.

Whose folder it is. The default place, ``/dev/shm/torpor-<hash of home>``, is predictable, in a folder
everyone may write, and holds a job's memory: another user who made it first could read images, swap
them, or plant links where torpor writes. So the hot tier is torpor's only when it is a real folder (not a
link), owned by torpor's user and private to it (no group or other bits), below folders nobody else
can replace (:func:`torpor.adapters.system.private.replaceable_by_others`; ``/dev/shm`` is sticky).
:meth:`HotFolder.ensure` makes it so (``mkdir`` 0700, then torpor's tmpfs with ``mode=0700``) and checks it through an
``O_DIRECTORY|O_NOFOLLOW`` descriptor, before and after mounting; anything else is refused with
:class:`~torpor.errors.UnsafePath`, never ``chmod``-ed or ``chown``-ed, since someone else may have made
it. Readers check it too: fully once per folder (its device and inode are remembered), and with one
``lstat`` per call, which tells a folder replaced since (removed, then made again by someone else, even
on the same inode number: its owner or mode differ).

Files inside are not checked one by one: once the folder is verified nobody else can add an entry to it.
Every file torpor writes there is still opened with ``O_NOFOLLOW`` (:func:`torpor.adapters.system.private.
open_private`), so a link left there by anything (root itself, an older torpor's folder) redirects no
write, and CRIU's images are private because torpor's processes run with umask 0o077.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from pathlib import Path

from torpor.adapters.system import mounts, private
from torpor.errors import StoreError, UnsafePath

#: 4 KiB pages (``huge=never``, tmpfs's default). ``huge=within_size`` lets this kernel put CRIU's writes
#: in large folios (8 KiB to 1 MiB). Back to back on one process, CPUs held: 1 GiB dumps took 0.28-0.74 s
#: with them (median 0.41) against 0.55-0.82 s (0.58), 4 GiB ones 1.7-3.8 s (3.05) against 1.9-2.7 s
#: (2.14); with 5 GiB more in use by other processes, 0.59-3.66 s against 0.58-0.70 s, and 11.5-18.7 s
#: against 3.8-4.9 s at 4 GiB. A job's freeze must not depend on what else the machine holds.
#: ``huge=always`` was slower still and as erratic (it compacts memory for every 2 MiB page).
OWN_MOUNT_OPTIONS = "huge=never,mode=0700"
#: the file in the hot tier that names the state directory it belongs to: the hot tier lives outside it,
#: and this is how ``torpor doctor`` and ``torpor cleanup`` tell one whose state directory was deleted
HOME_MARKER = ".home"
#: longer than any path a marker holds: a bigger file is not torpor's
MARKER_MAX = 8192


def read_home_marker(fd: int) -> str | None:
    """The state directory the folder ``fd`` names in its :data:`HOME_MARKER`, if that is a small regular
    file holding an absolute path (as :meth:`HotFolder.ensure` writes it)."""
    try:
        marker = os.open(HOME_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None
    with os.fdopen(marker, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        text = handle.read(MARKER_MAX + 1)
    if len(text) > MARKER_MAX:
        return None
    home = text.decode(errors="replace").strip()
    return home if home.startswith("/") else None


def _folder_problem(st: os.stat_result) -> str | None:
    """What makes a folder (``lstat``-ed) not one torpor may keep images in; ``None``: nothing."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by torpor's user (uid {uid})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users (torpor makes it 0700)"
    return None


class HotFolder:
    """The folder the hot tier keeps its images in, as torpor made it, or refused."""

    def __init__(self, root: Path, own_mount: bool = False, home: Path | None = None) -> None:
        self.root = root
        #: mount a tmpfs of our own (huge pages) on ``root``: only for the default place in /dev/shm
        self.own_mount = own_mount
        #: the state directory the tier belongs to, written into it (:data:`HOME_MARKER`)
        self.home = home
        #: (device, inode) of the root folder once it was checked to be torpor's own
        self._verified: tuple[int, int] | None = None
        #: the folder whose marker is known to be written (device, inode)
        self._marked: tuple[int, int] | None = None

    def ensure(self) -> None:
        """Make the hot tier (0700, torpor's tmpfs on the default place) or check the one there is ours.

        Raises :class:`~torpor.errors.UnsafePath` for a folder torpor did not make as it makes them.
        """
        try:
            private.make_private_dirs(self.root.parent)  # a TORPOR_HOT_DIR may be missing still
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.root, 0o700)
        except OSError as exc:
            raise StoreError(f"cannot create the hot tier {self.root}: {exc.strerror}") from exc
        fd, _ = self._open_root()
        try:
            if self.own_mount and not os.path.ismount(self.root):
                self._mount(fd)
        finally:
            os.close(fd)
        fd, checked = self._open_root()  # what is there now: torpor's tmpfs, or the folder it was made on
        try:
            self._verified = (checked.st_dev, checked.st_ino)
            if self.home is not None and self._marked != self._verified:
                self._mark(fd)
                self._marked = self._verified
        finally:
            os.close(fd)

    def _mark(self, fd: int) -> None:
        """Write the home's path into the checked folder ``fd``, unless it is there (a tier of an older
        torpor's gets it on its first use by this one)."""
        try:
            marker = os.open(
                HOME_MARKER,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=fd,
            )
        except OSError:
            return  # there already; or the tier is full: the marker only helps cleanup, a dump comes first
        with contextlib.suppress(OSError), os.fdopen(marker, "w") as handle:
            handle.write(f"{self.home}\n")

    def exists(self) -> bool:
        """Whether the hot tier is there; raises :class:`~torpor.errors.UnsafePath` if it is not ours."""
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot look at the hot tier {self.root}: {exc.strerror}") from exc
        # a new inode, or the same one reused by a folder made since (its owner or mode then tells)
        if self._verified != (st.st_dev, st.st_ino) or _folder_problem(st) is not None:
            fd, checked = self._open_root()
            os.close(fd)
            self._verified = (checked.st_dev, checked.st_ino)
        return True

    def _open_root(self) -> tuple[int, os.stat_result]:
        """A descriptor of the root folder, checked (with its parent) to be torpor's own, and its stat."""
        problem = private.replaceable_by_others(self.root.parent)
        if problem is not None:
            raise UnsafePath(
                f"the hot tier {self.root} is not safe: {problem}; set TORPOR_HOT_DIR to a folder only "
                "torpor's user can change"
            )
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise StoreError(f"cannot open the hot tier {self.root}: {exc.strerror}") from exc
            try:
                st = os.lstat(self.root)
            except OSError:
                raise StoreError(f"cannot open the hot tier {self.root}: {exc.strerror}") from exc
            raise self._unsafe(_folder_problem(st) or "is not a folder") from exc
        st = os.fstat(fd)
        problem = _folder_problem(st)
        if problem is not None:
            os.close(fd)
            raise self._unsafe(problem)
        return fd, st

    def _unsafe(self, problem: str) -> UnsafePath:
        return UnsafePath(
            f"the hot tier {self.root} {problem}: another user may have made it to read or change "
            "checkpoints; torpor leaves it alone: remove it, or set TORPOR_HOT_DIR to a folder of your own"
        )

    def remove_all(self) -> None:
        """Delete the whole hot tier, images included, and unmount torpor's tmpfs if it has one.

        A link, or a folder of another user's, at the hot tier's place is not torpor's: it is left alone.
        """
        try:
            st = os.lstat(self.root)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(self.root, ignore_errors=True)  # empties a mount point, cannot remove it
            with contextlib.suppress(OSError):
                mounts.unmount(self.root)
            shutil.rmtree(self.root, ignore_errors=True)
        self._verified = None
        # the lock file an older torpor made beside the hot tier (unlink follows no link)
        with contextlib.suppress(OSError):
            (self.root.parent / f".{self.root.name}.mount-lock").unlink(missing_ok=True)

    def _mount(self, fd: int) -> None:
        """Mount our tmpfs on the (empty) hot folder ``fd``, once, even with several processes racing.

        The lock is the checked folder itself (flock on its descriptor): a lock file beside it, in
        world-writable /dev/shm, would be one more name another user could make first.
        """
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.ismount(self.root) or os.listdir(fd):
            return  # mounted by another process meanwhile, or an older plain hot tier in use
        parent = os.statvfs(self.root.parent)
        size = parent.f_blocks * parent.f_frsize  # the same limit as the file system it replaces
        with contextlib.suppress(OSError):  # not root, or no tmpfs: a plain folder works, slower
            mounts.mount_tmpfs(self.root, f"{OWN_MOUNT_OPTIONS},size={size}")
