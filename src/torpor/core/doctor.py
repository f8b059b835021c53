"""What works on this machine for torpor: CRIU and its features, the kernel, the GPU driver, the state
directory, the store configuration, jobs of other users and the hot tiers deleted state directories left
in RAM — gathered for ``torpor doctor``.

It asks the adapters (CRIU, the GPU driver, the system) and returns plain data: the report's keys are
what ``torpor doctor --json`` prints. Every check is independent, so one failure does not hide the rest.
Rendering the report, and reading the store configuration's own report, are the CLI's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torpor import __version__
from torpor.adapters import cuda, gpu, nvml, writetrack
from torpor.adapters.criu import Criu
from torpor.adapters.system import disk, machine
from torpor.core.store import leftovers
from torpor.errors import TorporError
from torpor.settings import GPU_UNVERIFIED, Settings

#: the user (and group) of the process doctor dumps to try another user's: nobody/nogroup on Debian
PROBE_UID = 65534
_SLEEP = shutil.which("sleep") or "/bin/sleep"


def store_ok(store: Mapping[str, Any]) -> bool:
    """Whether a store configuration report (``torpor store --json``) lets torpor checkpoint."""
    return store["config"] is not None and not store["environment_disagrees"]


def _gpu_checkpoint(settings: Settings, driver: str | None) -> str:
    """What happens to a job that holds a GPU here, in words."""
    if settings.gpu != GPU_UNVERIFIED:
        return "not supported yet (CPU jobs only; TORPOR_GPU=unverified tries NVIDIA's checkpoint API)"
    if driver is None:
        return "TORPOR_GPU=unverified, but there is no NVIDIA driver here"
    try:
        cuda.load()
    except cuda.CudaError as exc:
        return f"TORPOR_GPU=unverified, but {exc.message}"
    return "NVIDIA's checkpoint API (TORPOR_GPU=unverified: not verified on a GPU yet)"


def _gpus(driver: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """This machine's GPUs through NVML (UUID, name, memory, MIG mode), and why not, if they cannot be read."""
    if driver is None:
        return [], None
    try:
        devices = nvml.load().gpus()
    except cuda.CudaError as exc:
        return [], exc.message
    return [asdict(device) for device in devices], None


def report(settings: Settings, store: Mapping[str, Any]) -> dict[str, Any]:
    """What works here; ``store`` is the store configuration's report, taken into the result as is."""
    result: dict[str, Any] = {"torpor": __version__, "home": str(settings.home)}
    criu = result["criu"] = _criu(settings)
    result["kernel"] = asdict(machine.kernel_features())
    result["gpu_driver"] = gpu.driver_version()
    result["gpu_checkpoint"] = _gpu_checkpoint(settings, result["gpu_driver"])
    result["gpus"], result["gpus_error"] = _gpus(result["gpu_driver"])
    home_ok = (
        os.access(settings.home, os.W_OK)
        if settings.home.exists()
        else os.access(_existing_parent(settings.home), os.W_OK)
    )
    result["home_writable"] = home_ok
    if settings.home.exists():
        result["home_free_bytes"] = disk.disk_free(settings.home)
    result["store"] = store
    result["other_users"] = _other_users(settings, bool(criu.get("check_ok")))
    # not a condition of ``ok``: a leftover holds RAM, it does not stop a checkpoint
    result["hot_tiers"] = [tier.to_dict() for tier in leftovers.survey(settings)]
    result["ok"] = bool(criu.get("check_ok")) and home_ok and store_ok(store)
    return result


def _other_users(settings: Settings, criu_ok: bool) -> dict[str, Any]:
    """Whether a job with processes of another user (``runuser -u postgres -- …``) can be checkpointed.

    CRIU reads each process's resource limits, which the kernel allows for another user's process only
    with CAP_SYS_RESOURCE. Where root lacks it, a dump of such a process, run as ``nobody``, says whether
    torpor's rlimit shim for criu (scripts/criu-rlimits.c) makes up for it. Not a condition of ``ok``:
    jobs of root's own still work.
    """
    cap = machine.has_capability(machine.CAP_SYS_RESOURCE)
    shim = Criu(settings.criu).rlimit_shim() if settings.criu else None
    result: dict[str, Any] = {
        "cap_sys_resource": cap,
        "rlimit_shim": str(shim) if shim else None,
        "checkpoint_ok": True if cap else None,
        "problem": None,
        "details": [],
    }
    if cap:
        return result
    if not criu_ok or os.geteuid() != 0:
        result["problem"] = (
            "jobs with processes of another user: not tried, criu does not work here (it needs root);"
            " root lacks CAP_SYS_RESOURCE, which CRIU needs for them unless torpor's rlimit shim is built"
        )
        return result
    try:
        with tempfile.TemporaryDirectory(prefix="torpor-doctor-") as images:
            details = Criu(settings.criu).probe_dump([_SLEEP, "60"], PROBE_UID, PROBE_UID, Path(images))
    except (OSError, TorporError) as exc:
        details = [str(exc)]
    result["checkpoint_ok"] = not details
    refused = [line for line in details if "Can't get rlimit" in line]
    result["details"] = refused or details
    if details:
        result["problem"] = (
            "jobs with processes of another user (e.g. 'runuser -u postgres -- ...') cannot be checkpointed"
            + (
                ": root here lacks CAP_SYS_RESOURCE, so CRIU may not read their resource limits; run"
                " 'make setup' (it builds torpor's rlimit shim for criu with gcc) or give root CAP_SYS_RESOURCE"
                if refused
                else ": a dump of such a process failed (see the details)"
            )
        )
    return result


def _criu(settings: Settings) -> dict[str, Any]:
    criu: dict[str, Any] = {"path": str(settings.criu) if settings.criu else None}
    try:
        tool = Criu(settings.criu)
        info = tool.require()
        ok, said = tool.check()
        criu.update(
            version=info.version,
            check_ok=ok,
            check=said,
            dirty_tracking=tool.has_feature("mem_dirty_track"),
            write_tracking=_write_tracking(),
            lazy_pages=tool.has_feature("uffd-noncoop"),
            nftables_lock=tool.has_feature("nftables"),
        )
    except TorporError as exc:
        criu.update(check_ok=False, error=exc.message)
    return criu


def _write_tracking() -> dict[str, Any]:
    """Whether a running process's writes can be tracked from outside it here (userfaultfd
    write-protection, asynchronous: :mod:`torpor.adapters.writetrack`), or why not."""
    if os.geteuid() != 0:
        return {"uffd_wp_async": None, "problem": "not tried: tracking another process needs root"}
    problem = writetrack.probe()
    return {"uffd_wp_async": problem is None, "problem": problem}


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
