"""The GPU part of a checkpoint and of a restore: what is refused, what the image keeps, where it goes.

A job none of whose processes holds ``/dev/nvidia*`` passes through untouched. For one that does:

- **checkpoint** (:meth:`GpuJobs.before_dump`): refused unless ``TORPOR_GPU=unverified``; then refused,
  before anything is locked or frozen, when :func:`torpor.policy.gpu.checkpoint_refusal` says so (a
  driver older than r570, a GPU in MIG mode, an MPS server). Else the stage (:class:`~torpor.adapters.gpu.
  CudaStage`) locks and checkpoints the CUDA processes, and the image keeps the facts of the GPUs they
  used (:data:`GPUS_FILE`: UUID, name, memory, and the driver's version);
- **restore** (:meth:`GpuJobs.before_restore`, before CRIU runs): an image with GPU facts is refused
  onto GPUs of another type or fewer of them, else mapped onto this machine's by UUID
  (:func:`torpor.policy.gpu.place`), which :meth:`GpuJobs.after_restore` hands to the driver.

NVML (:mod:`torpor.adapters.nvml`) is opened only for a job that holds a GPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torpor.adapters import cuda, gpu, nvml
from torpor.adapters.system import procfs
from torpor.errors import CheckpointFailed, CudaError, RestoreFailed
from torpor.policy import gpu as policy
from torpor.settings import GPU_UNVERIFIED

#: the file in a GPU job's image that keeps its GPUs' facts and the driver's version
GPUS_FILE = "torpor-gpus.json"

#: a restore's map of GPUs: (old UUID, new UUID) pairs, () for none moved; None: the image has no GPU state
Pairs = tuple[tuple[str, str], ...] | None


def facts(device: nvml.Device) -> policy.Gpu:
    """A GPU as the policy sees it."""
    return policy.Gpu(device.uuid, device.name, device.memory_bytes, mig=device.mig)


class GpuJobs:
    """The GPU part of checkpoints and restores, for ``choice`` (``TORPOR_GPU``) and ``stage``.

    ``nvml_loader`` opens NVML and ``mps`` says whether an MPS server runs; tests pass stand-ins."""

    def __init__(
        self,
        choice: str,
        stage: gpu.GpuStage | None = None,
        nvml_loader: Callable[[], nvml.Nvml] = nvml.load,
        mps: Callable[[], bool] = nvml.mps_running,
    ) -> None:
        self.enabled = choice == GPU_UNVERIFIED
        self.stage: gpu.GpuStage = stage or gpu.CudaStage()
        self._load_nvml = nvml_loader
        self._nvml: nvml.Nvml | None = None
        self._mps = mps
        #: what before_dump found of each tree's GPUs, until after_dump writes it into the image
        self._noted: dict[tuple[int, ...], dict[str, object]] = {}

    def before_dump(self, pids: list[int]) -> str | None:
        """Refuse, or bring the GPU state of ``pids`` to host memory; what was done, in words for the
        progress line (None for a job without a GPU)."""
        users = procfs.device_users(pids, gpu.NVIDIA_DEVICE_PREFIX)
        if not users:
            return None
        if not self.enabled:
            raise CheckpointFailed(
                "this job uses an NVIDIA GPU; GPU checkpointing is not supported yet (CPU jobs only; "
                "TORPOR_GPU=unverified tries NVIDIA's checkpoint API, not verified on a GPU)"
            )
        reader = self._reader()
        version = reader.driver_version()
        minors = gpu.gpu_minors(users)
        used = [facts(device) for device in reader.gpus() if device.minor in minors]
        refusal = policy.checkpoint_refusal(version, used, self._mps())
        if refusal is not None:
            raise CheckpointFailed(refusal, details=["the job runs on, its GPU untouched"])
        started = time.monotonic()
        self.stage.before_dump(pids)  # keeps what it did by the whole tree, as after_dump names it
        took = time.monotonic() - started
        self._noted[gpu.tree(pids)] = {
            "driver": version,
            "gpus": [each.to_json() for each in used],
            "gpu_stage_s": took,
        }
        return f"GPU stage: {len(users)} CUDA process(es) locked and checkpointed in {took:.2f} s"

    def after_dump(self, pids: list[int], leave_running: bool, image_dir: Path | None) -> None:
        """Give the GPU back to a job that runs on; ``image_dir``: the dump went through, into there, and
        its image keeps the GPUs' facts (:data:`GPUS_FILE`). Not written earlier: a dump tried again
        starts from an empty folder."""
        noted = self._noted.pop(gpu.tree(pids), None)
        if noted is not None and image_dir is not None:
            (image_dir / GPUS_FILE).write_text(json.dumps(noted, indent=1) + "\n")
        if self.enabled:
            self.stage.after_dump(pids, leave_running)

    def before_restore(self, image_dir: Path) -> Pairs:
        """The map of GPUs for restoring ``image_dir`` here (None: no GPU state in it); RestoreFailed
        when it cannot be restored here."""
        saved = saved_gpus(image_dir)
        if saved is None:
            return None
        if not self.enabled:
            raise RestoreFailed(
                "this checkpoint holds a job's GPU state: restoring it needs TORPOR_GPU=unverified"
            )
        try:
            reader = self._reader()
            refusal = policy.checkpoint_refusal(reader.driver_version(), [], self._mps())
            placement = policy.place(saved, [facts(device) for device in reader.gpus()])
        except CudaError as exc:
            raise RestoreFailed(f"this checkpoint holds GPU state, but {exc.message}") from None
        refusal = refusal or placement.refusal
        if refusal is not None:
            raise RestoreFailed(f"cannot restore this GPU job here: {refusal}")
        return placement.pairs

    def after_restore(self, pids: list[int], pairs: Pairs) -> None:
        if pairs is not None:
            self.stage.after_restore(pids, pairs)

    def _reader(self) -> nvml.Nvml:
        if self._nvml is None:
            self._nvml = self._load_nvml()
        return self._nvml


def saved_gpus(image_dir: Path) -> Sequence[policy.Gpu] | None:
    """The GPUs a checkpoint's job used (:data:`GPUS_FILE`), or None for an image without GPU state."""
    try:
        noted = json.loads((image_dir / GPUS_FILE).read_text())
        saved = [policy.Gpu.from_json(each) for each in noted["gpus"]]
        for each in saved:
            cuda.uuid_bytes(each.uuid)  # the driver is told them: a UUID that is not one fails here
        return saved
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RestoreFailed(f"the image's {GPUS_FILE} cannot be read: {exc}") from None
