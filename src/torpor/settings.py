"""One settings object, read at the edge (CLI flags and environment) and passed down explicitly.

Nothing below the CLI reads the environment: the launcher gets its settings as arguments.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT_HOME = Path("/var/lib/torpor")


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
        return cls(home=home_path.absolute(), criu=find_criu(Path(criu) if criu else None))


def find_criu(configured: Path | None) -> Path | None:
    """The criu to use: the configured one, the one installed beside this Python (``.venv/bin``), or PATH."""
    if configured is not None:
        return configured
    beside = Path(sys.prefix) / "bin" / "criu"
    if beside.exists():
        return beside
    found = shutil.which("criu", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    return Path(found) if found else None
