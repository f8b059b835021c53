"""NVIDIA's CUDA driver checkpoint API (``cuCheckpointProcess*`` in libcuda, driver r570 and later),
called through ctypes: lock a CUDA process, move its device memory into its host memory and release the
GPU, bring it back, unlock it.

This module is the seam where tests put a stand-in (:class:`Driver` is all the GPU stage uses): no
machine this project tests on has an NVIDIA GPU, so :class:`LibCuda` has not run against a real driver
here; what runs is the stage's logic above it (``adapters.gpu.CudaStage``). libcuda is loaded only when a
job that holds a GPU is checkpointed or restored, or by ``torpor doctor``: a machine without a GPU never
needs it.

Argument structures, per the driver API's reference (each 64 bytes, reserved fields zero):
``CUcheckpointLockArgs`` {u32 timeoutMs, u32 reserved0, u64 reserved1[7]};
``CUcheckpointCheckpointArgs`` and ``CUcheckpointUnlockArgs`` {u64 reserved[8]};
``CUcheckpointRestoreArgs`` {CUcheckpointGpuPair *gpuPairs, u32 gpuPairsCount, char reserved[44],
u64 reserved1}, where ``CUcheckpointGpuPair`` is {CUuuid oldUuid, CUuuid newUuid} (16 bytes each: the
UUID NVML writes as ``GPU-xxxxxxxx-…``, as bytes); no remapping: a null list.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Protocol

from torpor.errors import CudaError as CudaError  # raised here; callers name it cuda.CudaError

#: CUprocessState
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}

_ARGS = 64
_LIBRARY = "libcuda.so.1"
#: what the driver answers a process it cannot checkpoint (the lock reports it)
_NOT_SUPPORTED = "CUDA_ERROR_NOT_SUPPORTED"
_ENTRY_POINTS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class Driver(Protocol):
    """What the GPU stage asks of the driver, one process at a time (by PID on this machine)."""

    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, pairs: Sequence[tuple[str, str]] = ()) -> None:
        """Device memory back from host memory; ``pairs``: (old, new) GPU UUIDs, when GPUs change."""
        ...

    def unlock(self, pid: int) -> None: ...
    def state(self, pid: int) -> str | None:
        """The process's CUDA state (:data:`STATES`), or None for a process the driver does not know."""
        ...


class LibCuda:
    """:class:`Driver` through libcuda (:func:`load`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._cuda = library
        for name in _ENTRY_POINTS:
            getattr(library, name).argtypes = [ctypes.c_int, ctypes.c_void_p]
            getattr(library, name).restype = ctypes.c_int
        library.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        library.cuGetErrorName.restype = ctypes.c_int

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = ctypes.create_string_buffer(_ARGS)
        struct.pack_into("<I", args, 0, timeout_ms)
        self._call("cuCheckpointProcessLock", pid, args, "lock")

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, ctypes.create_string_buffer(_ARGS), "checkpoint")

    def restore(self, pid: int, pairs: Sequence[tuple[str, str]] = ()) -> None:
        args = ctypes.create_string_buffer(_ARGS)
        table = ctypes.create_string_buffer(b"".join(uuid_bytes(old) + uuid_bytes(new) for old, new in pairs))
        if pairs:  # the table lives until the call returns: this frame holds it
            struct.pack_into("<QI", args, 0, ctypes.addressof(table), len(pairs))
        self._call("cuCheckpointProcessRestore", pid, args, "restore")

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, ctypes.create_string_buffer(_ARGS), "unlock")

    def state(self, pid: int) -> str | None:
        value = ctypes.c_int()
        if self._cuda.cuCheckpointProcessGetState(pid, ctypes.byref(value)) != 0:
            return None
        return STATES.get(value.value, f"state {value.value}")

    def _call(self, name: str, pid: int, args: ctypes.Array[ctypes.c_char], what: str) -> None:
        code = getattr(self._cuda, name)(pid, args)
        if code != 0:
            name = self._name(code)
            hint = (
                " (the checkpoint API supports no UVM (managed) or CUDA IPC memory, MIG or MPS)"
                if name == _NOT_SUPPORTED
                else ""
            )
            raise CudaError(f"the CUDA driver could not {what} process {pid}: {name}{hint}")

    def _name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._cuda.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode(errors="replace")
        return f"error {code}"


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a GPU's UUID as NVML writes it (``GPU-6f3b…`` or ``MIG-…``); ValueError if not one."""
    digits = uuid.split("-", 1)[1].replace("-", "") if uuid[:4] in ("GPU-", "MIG-") else ""
    if len(digits) != 32:
        raise ValueError(f"not a GPU UUID: {uuid!r}")
    return bytes.fromhex(digits)


def load() -> LibCuda:
    """libcuda with the checkpoint API, initialised; raises :class:`CudaError` saying what is missing."""
    try:
        library = ctypes.CDLL(_LIBRARY)
    except OSError:
        raise CudaError(f"{_LIBRARY} cannot be loaded: the NVIDIA driver is not installed here") from None
    missing = [name for name in _ENTRY_POINTS if not hasattr(library, name)]
    if missing:
        raise CudaError(
            f"this NVIDIA driver has no checkpoint API ({missing[0]} is missing): it needs driver r570 or later"
        )
    library.cuInit.argtypes = [ctypes.c_uint]
    library.cuInit.restype = ctypes.c_int
    code = library.cuInit(0)
    driver = LibCuda(library)
    if code != 0:
        raise CudaError(f"the CUDA driver did not start: {driver._name(code)}")
    return driver
