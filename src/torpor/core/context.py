"""What every operation needs, built once from :class:`Settings`: records, store, CRIU, GPU stage.

Both halves of the engine use it — the CLI's (:mod:`torpor.core.engine`) and the launcher's
(:mod:`torpor.core.checkpoint`, :mod:`torpor.core.restore`). It also makes the state directory private
before anything is written there. What an operation does with it is the caller's.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

from torpor.adapters import gpu
from torpor.adapters.criu import Criu, RestoreGate
from torpor.adapters.imagestreamer import CAPTURE_SCRIPT
from torpor.adapters.system import private
from torpor.core.gpujobs import GpuJobs
from torpor.core.records import Records
from torpor.core.recordtypes import CheckpointId, JobName
from torpor.core.store import ImageStore, open_store
from torpor.core.store import config as store_config
from torpor.errors import EnvironmentProblem, UnsafePath
from torpor.settings import Settings

#: told what a long operation is doing, one line at a time
Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """A :data:`Progress` that shows nothing."""
    return None


class Context:
    """What every operation needs, built from one :class:`Settings`.

    It writes the state directory's store configuration from ``settings.store_env`` if there is none
    yet, and refuses store variables that disagree with it unless ``check_store_env`` is off (for
    ``torpor store``, which shows and changes it).
    """

    def __init__(
        self, settings: Settings, gpu_stage: gpu.GpuStage | None = None, check_store_env: bool = True
    ) -> None:
        self.settings = settings
        self.gpu = GpuJobs(settings.gpu, gpu_stage)
        make_state_private(settings)
        if not os.access(settings.home, os.W_OK):
            raise EnvironmentProblem(
                f"{settings.home} is not writable; fix its permissions or set TORPOR_HOME"
            )
        store_config.establish(settings.home, settings.store_env, check=check_store_env)
        self.records = Records(settings.db_path)
        self.store: ImageStore = open_store(settings)
        #: in a launcher after a lazy restore: the ``criu lazy-pages`` still bringing memory in
        self.lazy_pages: subprocess.Popen[bytes] | None = None
        #: in a launcher: why torpor itself killed the job, for its record once it is gone
        self.killed_because: str | None = None

    @cached_property
    def criu(self) -> Criu:
        return Criu(self.settings.criu)

    def restore_gate(self, verdict: Path, writer_pid: int) -> RestoreGate:
        script = RestoreGate.install(self.settings.run_dir / "restore-gate.sh")
        return RestoreGate(script, verdict, writer_pid)

    def capture_script(self) -> Path:
        """The action script of a streamed dump (:data:`~torpor.adapters.imagestreamer.CAPTURE_SCRIPT`)."""
        return private.install_script(self.settings.run_dir / "dump-capture.sh", CAPTURE_SCRIPT)

    def criu_log(self, job: JobName, action: str, checkpoint_id: CheckpointId) -> Path:
        folder = self.settings.job_dir(job) / "criu"
        private.make_private_dirs(folder)
        return folder / f"{action}-{checkpoint_id}.log"


def make_state_private(settings: Settings) -> None:
    """Create the state directory's folders 0700, and tighten what an older torpor left open to all.

    Jobs' command lines, output and memory live here, so nobody but torpor's user may read any of it.
    A folder or file of torpor's (``jobs``, ``run``, ``tmp``, ``images``, ``staging``, the database) owned
    by this user loses its group and other bits; one owned by another user is refused: someone else made
    it, maybe to read what torpor puts there. What lies deeper keeps its mode, unreachable by others
    through these folders (opening every old image and log would cost each command a walk of the home).
    The home itself is tightened only when it holds torpor's database: a home the user made for more
    than torpor (or /tmp) is theirs to set.
    """
    problem = private.replaceable_by_others(settings.home)
    if problem is not None:
        raise UnsafePath(
            f"the state directory {settings.home} is not safe: {problem}; set TORPOR_HOME to a folder "
            "only torpor's user can change"
        )
    for folder in (settings.home, settings.jobs_dir, settings.run_dir, settings.tmp_dir):
        try:
            private.make_private_dirs(folder)
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot create {folder} ({exc.strerror}); make it writable or set TORPOR_HOME"
            ) from exc
    db = settings.db_path
    ours = [settings.jobs_dir, settings.run_dir, settings.tmp_dir, settings.images_dir, settings.staging_dir]
    ours += [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    if db.exists():
        ours.append(settings.home)
    uid = os.geteuid()
    for path in ours:
        try:
            found = path.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise EnvironmentProblem(
                f"cannot look at {path} ({exc.strerror}); fix it or set TORPOR_HOME"
            ) from exc
        if found.st_uid != uid:
            raise UnsafePath(
                f"{path} is owned by uid {found.st_uid}, not by torpor's user (uid {uid}): another user may "
                "have made it to read torpor's state; remove it or set TORPOR_HOME"
            )
        if found.st_mode & 0o077:
            try:
                path.chmod(stat.S_IMODE(found.st_mode) & 0o700)
            except OSError as exc:
                raise EnvironmentProblem(f"cannot make {path} private ({exc.strerror})") from exc
