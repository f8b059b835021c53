"""The GPUs of this machine and their health, through NVML (``pynvml``, of the nvidia-ml-py package).

:func:`load` opens NVML (libnvidia-ml, which every NVIDIA driver installs); :class:`Nvml` is the seam
tests put a stand-in at: no machine this project tests on has an NVIDIA GPU, so :class:`PyNvml` has not
run against a real driver here. What it reads (:class:`Device`, :class:`Health`) is handed on as the
plain facts :mod:`torpor.policy.gpu` and :mod:`torpor.policy.gpuhealth` decide from.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from torpor.errors import CudaError

#: how the process names of NVIDIA's MPS daemons (nvidia-cuda-mps-control, -server) begin, as the
#: kernel keeps them (15 characters)
MPS_PROCESS = "nvidia-cuda-mps"


@dataclass(frozen=True)
class Device:
    """One GPU: its UUID (``GPU-…``), product name, memory, N of its ``/dev/nvidiaN``, MIG mode on."""

    uuid: str
    name: str
    memory_bytes: int
    minor: int
    mig: bool = False


@dataclass(frozen=True)
class Health:
    """One reading of a GPU (the fields of :class:`torpor.policy.gpuhealth.Reading`)."""

    uuid: str
    at: float
    temperature_c: float | None = None
    slowdown_c: float | None = None
    xids: tuple[int, ...] = ()
    ecc_uncorrected: int | None = None
    lost: bool = False


class Nvml(Protocol):
    def driver_version(self) -> str: ...
    def gpus(self) -> list[Device]: ...
    def read(self) -> list[Health]:
        """One reading of every GPU (with the XID events since the last call)."""
        ...


class PyNvml:
    """:class:`Nvml` through pynvml, initialised (:func:`load`)."""

    def __init__(self, module: Any) -> None:
        self._nvml = module
        self._guard = threading.Lock()
        self._events: Any = None  # the XID event set, made at the first read
        #: each GPU's UUID by its index, for naming one that has fallen off the bus
        self._uuids: dict[int, str] = {}

    def driver_version(self) -> str:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def gpus(self) -> list[Device]:
        nvml = self._nvml
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self._uuids[index] = _text(nvml.nvmlDeviceGetUUID(handle))
            found.append(
                Device(
                    uuid=self._uuids[index],
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    minor=int(nvml.nvmlDeviceGetMinorNumber(handle)),
                    mig=self._optional(lambda h=handle: nvml.nvmlDeviceGetMigMode(h)[0]) == 1,
                )
            )
        return found

    def read(self) -> list[Health]:
        try:
            return self._read()
        except self._nvml.NVMLError as exc:
            raise CudaError(f"NVML could not read the GPUs: {exc}") from None

    def _read(self) -> list[Health]:
        nvml = self._nvml
        now = time.time()
        with self._guard:
            xids = self._xids()
        readings = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    readings.append(Health(self._uuids.get(index, f"GPU {index}"), now, lost=True))
                continue
            try:
                temperature = self._optional(
                    lambda h=handle: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
                )
                slowdown = self._optional(
                    lambda h=handle: nvml.nvmlDeviceGetTemperatureThreshold(
                        h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
                    )
                )
                ecc = self._optional(
                    lambda h=handle: nvml.nvmlDeviceGetTotalEccErrors(
                        h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                    )
                )
                lost = False
            except nvml.NVMLError:  # only GPU_IS_LOST gets past _optional
                temperature = slowdown = ecc = None
                lost = True
            readings.append(
                Health(
                    uuid,
                    now,
                    temperature_c=None if temperature is None else float(temperature),
                    slowdown_c=None if slowdown is None else float(slowdown),
                    xids=tuple(xids.get(uuid, ())),
                    ecc_uncorrected=None if ecc is None else int(ecc),
                    lost=lost,
                )
            )
        return readings

    def _xids(self) -> dict[str, list[int]]:
        """The critical XID events since the last call, by GPU UUID (NVML's event set, not waited on)."""
        nvml = self._nvml
        if self._events is None:
            self._events = nvml.nvmlEventSetCreate()
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                self._optional(
                    lambda h=handle: nvml.nvmlDeviceRegisterEvents(
                        h, nvml.nvmlEventTypeXidCriticalError, self._events
                    )
                )
        found: dict[str, list[int]] = {}
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # a timeout: none left
                return found
            uuid = self._optional(lambda e=event: _text(nvml.nvmlDeviceGetUUID(e.device)))
            found.setdefault(uuid or "", []).append(int(event.eventData))

    def _optional(self, call: Any) -> Any:
        """``call()``, or None where this GPU does not support it; a lost GPU raises."""
        try:
            return call()
        except self._nvml.NVMLError as exc:
            if exc.value == self._nvml.NVML_ERROR_GPU_IS_LOST:
                raise
            return None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def load() -> PyNvml:
    """NVML, initialised; raises :class:`CudaError` saying what is missing."""
    try:
        module = importlib.import_module("pynvml")
    except ImportError:
        raise CudaError("pynvml cannot be imported: install nvidia-ml-py (torpor's dependency)") from None
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        raise CudaError(f"NVML did not start: {exc} (libnvidia-ml comes with the NVIDIA driver)") from None
    return PyNvml(module)


def mps_running(proc: str = "/proc") -> bool:
    """Whether an MPS daemon runs on this machine (its clients' GPU state is the server's)."""
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/comm") as comm:
                if comm.read().startswith(MPS_PROCESS):
                    return True
        except OSError:
            continue
    return False
