"""The GPU stage of a checkpoint: the place in the order of operations where device state is handled.

:mod:`torpor.core.gpujobs` calls :meth:`GpuStage.before_dump` after the job is chosen, checked and
found to hold a GPU, and before CRIU runs, :meth:`GpuStage.after_dump` once CRIU is done (also after a
failed dump), and :meth:`GpuStage.after_restore` once CRIU has restored the tree. What it refuses, and
onto which GPUs a restore goes, are decided there (:mod:`torpor.policy.gpu`).

:class:`CudaStage` is NVIDIA's driver checkpoint API (:mod:`torpor.adapters.cuda`): lock every CUDA
process of the tree, move their device memory into host memory all at once, then CRIU; a job that runs
on gets its GPU state back and is unlocked. Its logic is tested against a stand-in for the driver; it
has not run on a GPU, hence the name of the setting that enables it (``TORPOR_GPU=unverified``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from torpor.adapters import cuda
from torpor.adapters.system import procfs
from torpor.errors import RestoreFailed

NVIDIA_DEVICE_PREFIX = "/dev/nvidia"

#: how long the driver may take to lock a process (let its CUDA calls in flight finish)
LOCK_TIMEOUT_MS = 10_000


class GpuStage(Protocol):
    def before_dump(self, pids: list[int]) -> None:
        """Bring the device state of those of ``pids`` that hold a GPU to host memory, for CRIU."""

    def after_dump(self, pids: list[int], leave_running: bool) -> None:
        """Give the device back to a job that keeps running (also after a failed dump)."""

    def after_restore(self, pids: list[int], pairs: Sequence[tuple[str, str]] = ()) -> None:
        """Put device state back after CRIU restored the tree; ``pairs``: (old, new) GPU UUIDs."""


class CudaStage:
    """Jobs that hold an NVIDIA GPU, through the driver's checkpoint API (``TORPOR_GPU=unverified``).

    ``driver`` loads the driver when a job first needs it (:func:`torpor.adapters.cuda.load`; tests pass a
    stand-in). Every lock comes before any checkpoint: a lock that fails unlocks those taken and the job
    runs on, untouched. The checkpoints then run all at once, one thread each (the driver's calls do
    not hold Python's lock); one that fails gives the others their state back, unlocks them all and
    fails the checkpoint before CRIU runs."""

    def __init__(
        self, driver: Callable[[], cuda.Driver] = cuda.load, lock_timeout_ms: int = LOCK_TIMEOUT_MS
    ) -> None:
        self._load = driver
        self._driver: cuda.Driver | None = None
        self._lock_timeout_ms = lock_timeout_ms
        #: the processes before_dump checkpointed, by the tree it was given, until after_dump
        self._held: dict[tuple[int, ...], list[int]] = {}

    def before_dump(self, pids: list[int]) -> None:
        self._held.pop(tree(pids), None)
        users = procfs.device_users(pids, NVIDIA_DEVICE_PREFIX)
        if not users:
            return
        driver = self._get()
        locked: list[int] = []
        try:
            for pid in users:
                driver.lock(pid, self._lock_timeout_ms)
                locked.append(pid)
        except cuda.CudaError as exc:
            _each(driver.unlock, locked)
            exc.details.append("the job runs on, its GPU untouched")
            raise
        done, failed = _all_at_once(driver.checkpoint, locked)
        if failed is not None:
            _each(driver.restore, done)
            _each(driver.unlock, locked)
            failed.details.append("the job runs on, its GPU state given back")
            raise failed
        self._held[tree(pids)] = locked

    def after_dump(self, pids: list[int], leave_running: bool) -> None:
        held = self._held.pop(tree(pids), [])
        if not held or not leave_running:
            return  # a hibernated job is gone: its GPU memory went with it
        driver = self._get()
        restored, failed = _all_at_once(driver.restore, held)
        _each(driver.unlock, restored)
        if failed is not None:
            stuck = sorted(set(held) - set(restored))
            failed.details.append(
                f"process(es) {', '.join(map(str, stuck))} keep their GPU state in host memory"
            )
            raise failed

    def after_restore(self, pids: list[int], pairs: Sequence[tuple[str, str]] = ()) -> None:
        driver = self._get()
        waiting = [pid for pid in pids if driver.state(pid) == "checkpointed"]
        restored, failed = _all_at_once(lambda pid: driver.restore(pid, pairs), waiting)
        _each(driver.unlock, restored)
        if failed is not None:
            raise RestoreFailed(failed.message, details=failed.details) from failed

    def _get(self) -> cuda.Driver:
        if self._driver is None:
            self._driver = self._load()
        return self._driver


def tree(pids: Sequence[int]) -> tuple[int, ...]:
    """A process tree as a key: what the dump's stages name it by, whatever order its PIDs come in."""
    return tuple(sorted(pids))


def _all_at_once(call: Callable[[int], None], pids: Sequence[int]) -> tuple[list[int], cuda.CudaError | None]:
    """``call`` for each of ``pids`` at the same time: those it succeeded for, and the first failure."""
    if not pids:
        return [], None
    with ThreadPoolExecutor(len(pids), "torpor-gpu") as pool:
        futures = {pid: pool.submit(call, pid) for pid in pids}
    done: list[int] = []
    failed: cuda.CudaError | None = None
    for pid, future in futures.items():
        error = future.exception()
        if error is None:
            done.append(pid)
        elif isinstance(error, cuda.CudaError):
            failed = failed or error
        else:
            raise error
    return done, failed


def _each(call: Callable[[int], None], pids: Sequence[int]) -> None:
    """``call`` for each of ``pids``, on past a failure (undoing: the first failure is not the cause)."""
    for pid in pids:
        try:
            call(pid)
        except cuda.CudaError:
            continue


def gpu_minors(pids: list[int]) -> set[int]:
    """N of each ``/dev/nvidiaN`` any of ``pids`` holds open or mapped: the GPUs they use."""
    found = set()
    for path in procfs.device_files(pids, NVIDIA_DEVICE_PREFIX):
        tail = path[len(NVIDIA_DEVICE_PREFIX) :]
        if tail.isdigit():
            found.add(int(tail))
    return found


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, or None when there is none."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word[:1].isdigit() and "." in word:
            return word
    return text.splitlines()[0].strip() if text else None
