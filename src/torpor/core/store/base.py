"""The contract every image store keeps (invariants 2 and 4 of DESIGN.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torpor.core.store.config import StoreConfig


class ImageState(StrEnum):
    """Where a checkpoint's image is on its way to the cold tier (each value is what is written down)."""

    #: a checkpoint's image is in the hot tier only, waiting for the destager
    STAGED = "staged"
    #: the destager is copying it into the cold tier
    DESTAGING = "destaging"
    #: its manifest is in the cold tier: it survives the machine
    DURABLE = "durable"


STAGED = ImageState.STAGED
DESTAGING = ImageState.DESTAGING
DURABLE = ImageState.DURABLE


class RestoreSource(StrEnum):
    """Where a restore reads the image from, chosen once up front by :meth:`ImageStore.restore_source`."""

    #: in the hot tier: linked into the restore folder (no copy); the pages verified while CRIU reads them
    HOT_LINKED = "hot-linked"
    #: cold tier, streamed: the small files fetched, the pages straight from the store into CRIU's pipe
    COLD_STREAMED = "cold-streamed"
    #: cold tier, whole: every file fetched; the pages verified while CRIU reads them
    COLD_WHOLE = "cold-whole"
    #: lazy, from the cold tier: memory served page by page by torpor's page server, each chunk verified
    LAZY_SERVED = "lazy-served"
    #: lazy, from a whole local copy (an image in RAM), verified first, served by CRIU's own daemon
    LAZY_LOCAL = "lazy-local"


#: verifies what :meth:`ImageStore.fetch` left unverified; raises CorruptImage
Check = Callable[[], None]


def is_bulk(name: str) -> bool:
    """Whether an image file holds memory pages: nearly all of an image's bytes, read by CRIU alone."""
    return name.startswith("pages-") and name.endswith(".img")


class PageSource(Protocol):
    """The memory of one checkpoint, handed out page by page for a lazy restore (thread-safe)."""

    def read_pages(self, pid: int, vaddr: int, nr_pages: int) -> bytes | bytearray:
        """``nr_pages`` pages of process ``pid`` (as in the image) from ``vaddr``, every byte verified."""

    def close(self) -> None: ...


class PageStream(Protocol):
    """The memory-page files of one checkpoint, for a restore that hands them to CRIU as they come."""

    #: the files it writes (the image's ``pages-N.img``)
    names: frozenset[str]

    def write(self, name: str, fd: int) -> None:
        """Write file ``name`` whole into ``fd`` (a pipe), front to back, each piece verified before.

        Raises CorruptImage at the first piece that does not match, having written nothing of it.
        """

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoredImage:
    """Where one checkpoint's image is now, how far it is on its way to durable, and why not if it is stuck."""

    checkpoint_id: str
    job: str
    size_bytes: int  # bytes of the CRIU image as dumped (logical size)
    stored_bytes: int  # bytes the store spent on it (new chunks); 0 until it is durable
    #: an :class:`ImageState`, or a word for a state that could not be read (e.g. ``unknown``)
    state: str = DURABLE
    #: how far destaging got, 0..1 (``None`` when not destaging)
    progress: float | None = None
    #: why the image is not durable yet (e.g. the cold tier is full); ``None`` when all is well
    error: str | None = None
    pinned: bool = False
    created_at: float = 0.0

    @property
    def state_text(self) -> str:
        if self.state not in tuple(ImageState):
            return self.state
        if self.state == DESTAGING and self.progress is not None:
            return f"destaging {self.progress * 100:.0f}%"
        return self.state + (" (not durable)" if self.error else "")


@dataclass(frozen=True)
class GcResult:
    """What a garbage collection kept and deleted."""

    checkpoints: int
    chunks_kept: int
    chunks_deleted: int


class ImageStore(Protocol):
    """What the engine asks of an image store; it never knows how images are kept."""

    @property
    def config(self) -> StoreConfig:
        """The state directory's store configuration as it is now (cold tier, key, retention)."""

    def retry(self) -> None:
        """Store again, in the background, the images a failure left in RAM only."""

    def staging_dir(
        self,
        checkpoint_id: str,
        size_hint: int | None = None,
        pids: Sequence[int] = (),
        kind: str | None = None,
    ) -> Path:
        """A new empty folder for CRIU to dump into, placed so that :meth:`put` is cheap.

        ``size_hint`` (the job's resident bytes) lets the store send a dump that would not fit into RAM
        straight to the cold tier. ``pids``: the processes being dumped, whose memory the store may
        read while CRIU holds them frozen (to store it before CRIU has written it). ``kind``: the
        checkpoint's (``hibernate``, ...), which tells how what is stored before the dump ends is kept.
        """

    def in_memory(self, image_dir: Path) -> bool:
        """Whether the staging folder ``image_dir`` is in RAM (the hot tier), not on a disk."""

    def take_over_memory(self, job: str, image_dir: Path) -> dict[int, Path]:
        """Files in the staging folder ``image_dir`` holding the memory of an older copy of ``job``'s
        image in RAM, for a dump to write over, by the PID (in the job's namespace) whose pages they held;
        that copy is dropped (it is durable: the cold tier still has it). Empty when there is none."""

    def put(
        self, checkpoint_id: str, job: str, image_dir: Path, meta: Mapping[str, Any] | None = None
    ) -> StoredImage:
        """Take ownership of a complete image folder (it is moved or consumed on success).

        An image kept in RAM, to be stored later, that the cold tier cannot take now (it cannot be
        opened, refuses the key or takes no writes) comes back with ``error`` saying why.

        The image becomes visible only when complete: a crash at any moment leaves it absent or whole.
        On failure ``image_dir`` is left as it was (the caller may still restore from it) and
        :class:`~torpor.errors.StorageFull` says when there was no room. ``meta`` (CRIU version, parent,
        job spec, timings) goes into the checkpoint's manifest.
        """

    def discard(self, image_dir: Path) -> None:
        """Remove a staging folder that will not be put (a failed dump, or a put that failed)."""

    def restore_dir(self, checkpoint_id: str) -> Path:
        """A path (not yet existing) to :meth:`get` an image into, placed so that restoring is fast."""

    def get(self, checkpoint_id: str, dest: Path) -> None:
        """Write the image's files into the empty folder ``dest``, each verified against its hash.

        Raises :class:`~torpor.errors.CorruptImage` on a mismatch and
        :class:`~torpor.errors.CheckpointNotFound` if there is no such image.
        """

    def fetch(self, checkpoint_id: str, dest: Path) -> Check:
        """:meth:`get`, except that the memory pages are verified by the check it returns.

        Everything else is verified when it returns. A restore runs the check while CRIU reads the
        pages and lets the job run only once it passed.
        """

    def precheck(self, checkpoint_id: str) -> None:
        """Verify what can be verified cheaply before a restore that must stop the job first.

        The image exists, every chunk it names is present, and every file but the memory pages reads
        back intact. Raises as :meth:`get` would; the memory pages are still verified by the restore.
        """

    def restore_source(self, checkpoint_id: str, lazy: bool, stream: bool) -> RestoreSource:
        """Where a restore (``lazy`` or not; ``stream``: the streamed-restore setting) reads the image from.

        Decided from what the store knows without reading the image; the method for the source then
        fetches it (:meth:`fetch` for HOT_LINKED and COLD_WHOLE, :meth:`stream_pages`,
        :meth:`prepare_lazy`, :meth:`get` for LAZY_LOCAL) and says what is missing or damaged.
        """

    def stream_pages(self, checkpoint_id: str, dest: Path) -> PageStream:
        """For COLD_STREAMED: write all but the memory pages into ``dest``, verified; stream those."""

    def prepare_lazy(self, checkpoint_id: str, dest: Path) -> None:
        """For LAZY_SERVED: write into ``dest`` every file of the image but its memory, verified.

        The memory comes from :meth:`page_source`.
        """

    def page_source(self, checkpoint_id: str, dest: Path) -> PageSource:
        """The memory of a folder :meth:`prepare_lazy` wrote: what CRIU reads itself written into ``dest``
        now, verified; the rest fetched and verified on demand. Close it when the restore is done."""

    def state(self, checkpoint_id: str) -> StoredImage:
        """Where the image is now (staged, destaging, durable); CheckpointNotFound if nowhere."""

    def wait_durable(
        self,
        checkpoint_id: str,
        progress: Callable[[StoredImage], None] | None = None,
        timeout: float | None = None,
    ) -> StoredImage:
        """Return once the image is durable; raise the destager's error if it cannot become so."""

    def list(self) -> list[StoredImage]:
        """Every complete image."""

    def delete(self, checkpoint_id: str) -> None:
        """Forget an image; deleting one that does not exist is not an error."""

    def set_pinned(self, checkpoint_id: str, pinned: bool) -> None:
        """Pinned images are kept by retention."""

    def pinned(self) -> set[str]: ...

    def gc(self) -> GcResult:
        """Delete stored data no image refers to; safe while other images are being written."""
