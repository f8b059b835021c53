"""Whether a GPU job may be checkpointed here, and onto which GPUs its checkpoint may be restored.

NVIDIA's checkpoint API brings a process's device memory back only onto GPUs of the type it left, as
many as it used; it refuses MIG slices and processes served by MPS, and it came with driver r570. These
functions decide from plain facts (:class:`Gpu`, read through NVML by :mod:`torpor.adapters.nvml`) and
do nothing themselves: :class:`torpor.adapters.gpu.CudaStage` acts on what they say, before anything is
frozen or restored.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: the first driver branch with the checkpoint API (CUDA 12.8; NVML-using programs such as PyTorch need it)
MIN_DRIVER = 570


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML names it: its UUID (``GPU-…``), product name and memory; ``mig``: MIG mode is on."""

    uuid: str
    name: str
    memory_bytes: int
    mig: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "name": self.name, "memory_bytes": self.memory_bytes}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Gpu:
        """A GPU as a checkpoint's metadata keeps it; ValueError for anything else."""
        uuid, name, memory = data.get("uuid"), data.get("name"), data.get("memory_bytes")
        if not isinstance(uuid, str) or not isinstance(name, str) or not isinstance(memory, int):
            raise ValueError(f"not a GPU's facts: {dict(data)!r}")
        return cls(uuid, name, memory)

    def describe(self) -> str:
        return f"{self.name} ({self.memory_bytes / 2**30:.0f} GiB)"


def driver_major(version: str | None) -> int | None:
    """570 of ``"570.86.15"``; None for no driver or a version that does not read as one."""
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def checkpoint_refusal(driver: str | None, used: Sequence[Gpu], mps: bool) -> str | None:
    """Why a job on the GPUs ``used`` cannot be checkpointed here (None: it can).

    ``driver``: the kernel driver's version; ``mps``: an MPS server runs on this machine (its clients'
    state lives in the server, which the API does not checkpoint)."""
    major = driver_major(driver)
    if major is None or major < MIN_DRIVER:
        return (
            f"NVIDIA driver {driver or '(none)'} has no checkpoint API: it needs r{MIN_DRIVER} or later "
            "(CUDA 12.8)"
        )
    sliced = [gpu.uuid for gpu in used if gpu.mig]
    if sliced:
        return f"the job uses a GPU in MIG mode ({sliced[0]}): NVIDIA's checkpoint API does not support MIG"
    if mps:
        return "an MPS server runs on this machine: NVIDIA's checkpoint API does not support MPS clients"
    return None


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint's GPUs go here: ``pairs`` (old UUID, new UUID) for each of them when any
    moves, else () (each comes back on the GPU it left); ``refusal``: why none fits (no pairs then)."""

    pairs: tuple[tuple[str, str], ...] = ()
    refusal: str | None = None


def place(saved: Sequence[Gpu], here: Sequence[Gpu]) -> Placement:
    """Onto which of the GPUs ``here`` the checkpoint's GPUs ``saved`` are restored.

    Each goes back onto the GPU of the same UUID when this machine has it, else onto another one of the
    same product name with as much memory, each GPU here taken once. The driver remaps by UUID; when any
    GPU moves, every one is named (the driver is told the whole map, not a part of it)."""
    free = [gpu for gpu in here if not gpu.mig]
    chosen: dict[str, Gpu] = {}
    for old in saved:  # the same GPU first, so that another GPU's search cannot take it
        same = next((gpu for gpu in free if gpu.uuid == old.uuid and _fits(old, gpu)), None)
        if same is not None:
            chosen[old.uuid] = same
            free.remove(same)
    for old in saved:
        if old.uuid in chosen:
            continue
        other = next((gpu for gpu in free if _fits(old, gpu)), None)
        if other is None:
            return Placement(refusal=_no_room(saved, here))
        chosen[old.uuid] = other
        free.remove(other)
    if all(chosen[old.uuid].uuid == old.uuid for old in saved):
        return Placement()
    return Placement(pairs=tuple((old.uuid, chosen[old.uuid].uuid) for old in saved))


def _fits(old: Gpu, new: Gpu) -> bool:
    return new.name == old.name and new.memory_bytes >= old.memory_bytes


def _no_room(saved: Sequence[Gpu], here: Sequence[Gpu]) -> str:
    usable = [gpu for gpu in here if not gpu.mig]
    return (
        f"the checkpoint ran on {_count(saved)}; this machine has {_count(usable) if usable else 'no GPU'}"
        f"{' usable (the others are in MIG mode)' if len(usable) < len(here) else ''}: a GPU job is "
        "restored onto GPUs of the type it ran on, as many"
    )


def _count(gpus: Sequence[Gpu]) -> str:
    kinds: dict[str, int] = {}
    for gpu in gpus:
        kinds[gpu.describe()] = kinds.get(gpu.describe(), 0) + 1
    return ", ".join(f"{n} × {kind}" for kind, n in kinds.items())
