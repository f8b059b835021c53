"""One settings object, read at the edge (CLI flags and environment) and passed down explicitly.

Nothing below the CLI reads the environment: the launcher gets its settings as arguments. The store
settings (where images go, the key, retention) are not among them: they are the state directory's
(``HOME/store.json``, :mod:`torpor.core.store.config`), the same for every process. The environment's
store variables are only kept here, raw, to write that file on a fresh state directory or to check
that they agree with it.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from torpor.errors import UsageError

DEFAULT_ROOT_HOME = Path("/var/lib/torpor")

#: the environment variable of each field of the store configuration (torpor.core.store.config)
STORE_VARIABLES = {
    "url": "TORPOR_STORE",
    "s3_endpoint": "TORPOR_S3_ENDPOINT",
    "key_file": "TORPOR_KEY_FILE",
    "keep_last": "TORPOR_KEEP_LAST",
}


@dataclass(frozen=True)
class Settings:
    """Where torpor keeps its state and which tools it drives."""

    #: state directory: job records (SQLite), logs, launcher sockets, checkpoint images
    home: Path
    #: the criu binary to run; ``None`` when none was found (commands that need it say so)
    criu: Path | None = None
    #: how long ``restore`` waits for the previous incarnation's processes to be gone
    pid_wait_s: float = 10.0
    #: grace period between SIGTERM and SIGKILL when stopping a job
    stop_grace_s: float = 5.0
    #: extra options for every CRIU run (kept for experiments; empty by default)
    criu_extra: tuple[str, ...] = field(default_factory=tuple)
    #: where the hot tier CRIU dumps into lives: a folder in RAM (tmpfs, e.g. bound to a CXL node with
    #: ``mpol=bind:N``), in which torpor makes its own private folder ``torpor-<hash of home>``;
    #: ``None``: that folder is ``/dev/shm/torpor-<hash of home>``, a tmpfs of torpor's own
    hot_dir: Path | None = None
    #: most bytes of images the hot tier keeps; ``None``: half of its file system
    hot_capacity_bytes: int | None = None
    #: the store variables (``STORE_VARIABLES``) this process's environment sets, as given: they write
    #: the state directory's store configuration when it has none, and must agree with it otherwise;
    #: never handed to another process (``to_dict`` leaves them out)
    store_env: Mapping[str, str] = field(default_factory=dict)
    #: threads that hash, compress, store and fetch chunks
    store_workers: int = 4
    #: restore from the cold tier by streaming the memory pages into ``criu restore --stream`` (no copy
    #: into RAM first); off: the whole image is written into a restore folder, then CRIU reads it
    stream_restore: bool = True
    #: dump through ``criu dump --stream``: CRIU hands the pages to torpor by reference and torpor copies
    #: them into memory set aside before the freeze (the job's last copy in RAM, or for a checkpoint
    #: zeros written then; the job is frozen about half as long here); off: CRIU writes every image file
    #: itself
    stream_dump: bool = True
    #: keep the CPUs out of slow idle states while CRIU dumps or restores (a PM QoS request of 0 µs on
    #: /dev/cpu_dma_latency, :func:`torpor.adapters.system.ownprocess.cpu_wakeups_held`); off: leave them be
    hold_cpu_wakeups: bool = True
    #: copy a checkpoint's memory while the job runs, in rounds, so that the freeze dumps only what it
    #: wrote since the last round (:mod:`torpor.core.precopy`; where this machine can track writes);
    #: TORPOR_PRECOPY=0: the whole memory is dumped while the job is frozen, as before
    precopy: bool = True
    #: TORPOR_GPU: "" refuses jobs that hold an NVIDIA GPU; "unverified" checkpoints them through the
    #: driver's checkpoint API (:class:`torpor.adapters.gpu.CudaStage`), not yet verified on a GPU
    gpu: str = ""
    #: the umask a job starts with: its caller's (the CLI reads it as it sets its own to 0o077, so that
    #: torpor's files and CRIU's images are private); ``None``: the launcher's as it started
    job_umask: int | None = None
    #: the bridge and subnet of the jobs that have a network of their own (``--own-network``)
    net_bridge: str = "torpor0"
    net_subnet: str = "10.213.0.0/24"

    @property
    def db_path(self) -> Path:
        return self.home / "torpor.db"

    @property
    def jobs_dir(self) -> Path:
        return self.home / "jobs"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def images_dir(self) -> Path:
        return self.home / "images"

    @property
    def tmp_dir(self) -> Path:
        return self.home / "tmp"

    @property
    def staging_dir(self) -> Path:
        """Where a dump that does not fit in the hot tier is written, on disk, until it is stored."""
        return self.home / "staging"

    @property
    def hot_path(self) -> Path:
        """The hot tier's folder, named after the home so that two homes never share one."""
        return (self.hot_dir or DEFAULT_HOT_PARENT) / hot_name(self.home)

    def to_dict(self) -> dict[str, object]:
        """A JSON-able form, to hand the same settings to a launcher or destager process.

        The store variables stay out: the other process takes the store configuration from the state
        directory, as it is at each use, not as this process's environment had it.
        """
        out: dict[str, object] = {}
        for name, value in asdict(self).items():
            if name == "store_env":
                continue
            out[name] = (
                str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
            )
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Settings:
        paths = {"home", "criu", "hot_dir"}
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data and f.name != "store_env":
                value = data[f.name]
                if f.name in paths and value is not None:
                    value = Path(value)
                elif f.name == "criu_extra":
                    value = tuple(value or ())
                values[f.name] = value
        return cls(**values)

    def job_dir(self, name: str) -> Path:
        return self.jobs_dir / name

    def socket_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.sock"

    @classmethod
    def from_environment(cls, home: str | None = None, criu: str | None = None) -> Settings:
        """Settings for the CLI: flags first, then ``TORPOR_HOME`` / ``TORPOR_CRIU``, then defaults."""
        home = home or os.environ.get("TORPOR_HOME")
        if home:
            home_path = Path(home)
        elif os.geteuid() == 0:
            home_path = DEFAULT_ROOT_HOME
        else:
            base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
            home_path = Path(base) / "torpor"
        criu = criu or os.environ.get("TORPOR_CRIU")
        env = os.environ
        hot = env.get("TORPOR_HOT_DIR")
        capacity = env.get("TORPOR_HOT_CAPACITY")
        return cls(
            home=home_path.absolute(),
            criu=find_criu(Path(criu) if criu else None),
            hot_dir=Path(hot).absolute() if hot else None,
            hot_capacity_bytes=parse_bytes(capacity, "TORPOR_HOT_CAPACITY") if capacity else None,
            store_env={name: env[name] for name in STORE_VARIABLES.values() if env.get(name)},
            store_workers=_env_int("TORPOR_STORE_WORKERS", 4, least=1),
            stream_restore=_env_bool("TORPOR_STREAM_RESTORE", True),
            stream_dump=_env_bool("TORPOR_STREAM_DUMP", True),
            hold_cpu_wakeups=_env_bool("TORPOR_HOLD_CPU_WAKEUPS", True),
            precopy=_env_bool("TORPOR_PRECOPY", True),
            gpu=_env_gpu(),
            net_bridge=env.get("TORPOR_BRIDGE") or "torpor0",
            net_subnet=env.get("TORPOR_SUBNET") or "10.213.0.0/24",
        )


#: where the hot tiers are when TORPOR_HOT_DIR is not set
DEFAULT_HOT_PARENT = Path("/dev/shm")


def hot_name(home: Path) -> str:
    """The name of the hot tier's folder of state directory ``home``: ``torpor-`` and 12 hex digits."""
    return "torpor-" + hashlib.sha256(str(home).encode()).hexdigest()[:12]


def _env_int(name: str, default: int, least: int = 0) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a whole number") from None
    if value < least:
        raise UsageError(f"{name}={text!r}: must be at least {least}")
    return value


def parse_bytes(text: str, name: str | None = None) -> int:
    """``"8G"``, ``"512M"``, ``"1.5GiB"`` or a plain number of bytes; ``name`` (a variable) is named
    when ``text`` is not a finite size of 0 or more."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (cleaned[:-1], cleaned[-1]) if cleaned and cleaned[-1] in units else (cleaned, "")
    shown = f"{name}={text!r}" if name else repr(text)
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise UsageError(f"{shown} is not a size (e.g. 8G, 512M, 1.5GiB)") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{shown} is not a size: it must be a finite number of bytes, 0 or more")
    return int(value)


def find_criu(configured: Path | None) -> Path | None:
    """The criu to use: the configured one, the one installed beside this Python (``.venv/bin``), or PATH."""
    if configured is not None:
        return configured
    beside = Path(sys.prefix) / "bin" / "criu"
    if beside.exists():
        return beside
    found = shutil.which("criu", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    return Path(found) if found else None


#: TORPOR_GPU's value that checkpoints GPU jobs through NVIDIA's driver API, not yet verified on a GPU
GPU_UNVERIFIED = "unverified"


def _env_gpu() -> str:
    text = os.environ.get("TORPOR_GPU", "").strip().lower()
    if text not in ("", GPU_UNVERIFIED):
        raise UsageError(f"TORPOR_GPU={text!r} must be empty (GPU jobs refused) or 'unverified'")
    return text


def _env_bool(name: str, default: bool) -> bool:
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "yes", "true", "on"):
        return True
    if text in ("0", "no", "false", "off"):
        return False
    raise UsageError(f"{name}={text!r} must be 1 or 0 (yes/no, true/false, on/off)")
