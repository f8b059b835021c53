"""The GPU stage of a checkpoint: the place in the order of operations where device state is handled.

The engine calls :meth:`GpuStage.before_dump` after the job is chosen and before CRIU runs, and
:meth:`GpuStage.after_restore` once CRIU has restored the tree. The CUDA implementation (driver checkpoint
API: lock, checkpoint to host, then CRIU; restore, unlock) arrives with its own issue. Until then
:class:`NoGpuStage` checkpoints CPU jobs and refuses, with a clear message, a job that holds an NVIDIA
device: CRIU cannot dump device memory and would fail obscurely.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from torpor.adapters.system import procfs
from torpor.errors import CheckpointFailed

NVIDIA_DEVICE_PREFIX = "/dev/nvidia"


class GpuStage(Protocol):
    def before_dump(self, pids: list[int]) -> None:
        """Bring device state to host memory so CRIU can dump it (or refuse)."""

    def after_dump(self, pids: list[int], leave_running: bool) -> None:
        """Give the device back to a job that keeps running (also after a failed dump)."""

    def after_restore(self, pids: list[int]) -> None:
        """Put device state back after CRIU restored the tree."""


class NoGpuStage:
    """CPU-only jobs: nothing to do; a job holding an NVIDIA device is refused."""

    def before_dump(self, pids: list[int]) -> None:
        if procfs.uses_device(pids, NVIDIA_DEVICE_PREFIX):
            raise CheckpointFailed(
                "this job uses an NVIDIA GPU; GPU checkpointing is not supported yet (CPU jobs only)"
            )

    def after_dump(self, pids: list[int], leave_running: bool) -> None:
        return None

    def after_restore(self, pids: list[int]) -> None:
        return None


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
