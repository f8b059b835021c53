"""What torpor keeps of a job is private to torpor's user (issue 11): the state directory, the database,
the logs, CRIU's logs and images in the hot tier, the cold store and ``rewound/`` are 0700 folders and
0600 files; an older home is tightened; a hot tier someone else made first is refused. The job itself
still creates files with its caller's umask.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import TORPOR, Torpor, python_job
from torpor.core.context import Context
from torpor.errors import UnsafePath
from torpor.settings import Settings

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def hot_root(torpor: Torpor) -> Path:
    return Settings(home=torpor.home, hot_dir=Path(torpor.env["TORPOR_HOT_DIR"])).hot_path


def open_to_others(*roots: Path) -> dict[str, int]:
    """Every file and folder under ``roots`` that has a group or other bit, with its mode."""
    found = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            if not path.is_symlink() and mode(path) & 0o077:
                found[str(path)] = mode(path)
    return found


def test_a_new_home_and_its_database_are_private(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    Context(settings)
    for folder in (settings.home, settings.jobs_dir, settings.run_dir, settings.tmp_dir):
        assert mode(folder) == 0o700, folder
    assert mode(settings.db_path) == 0o600
    assert open_to_others(settings.home) == {}


def test_an_older_homes_own_folders_are_tightened_and_a_strangers_refused(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    Context(settings)
    for path, loose in ((settings.home, 0o755), (settings.jobs_dir, 0o755), (settings.db_path, 0o644)):
        path.chmod(loose)  # as an older torpor left them
    settings.images_dir.mkdir(mode=0o755)
    Context(settings)
    assert mode(settings.home) == 0o700 and mode(settings.jobs_dir) == 0o700
    assert mode(settings.images_dir) == 0o700 and mode(settings.db_path) == 0o600
    if os.geteuid() == 0:
        os.chown(settings.tmp_dir, NOBODY, NOBODY)
        with pytest.raises(UnsafePath, match=rf"{settings.tmp_dir} is owned by uid {NOBODY}"):
            Context(settings)


@pytest.mark.root("gives a folder to another user")
def test_a_home_another_user_could_replace_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A home in (or below) a folder a stranger owns, or may rename entries in, is theirs to swap."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, not sticky
    link_dir = tmp_path / "links"
    link_dir.mkdir()
    (link_dir / "home").symlink_to(tmp_path / "elsewhere")
    os.chown(link_dir / "home", NOBODY, NOBODY, follow_symlinks=False)
    for home, why in (
        (theirs / "home", f"{theirs} is owned by uid {NOBODY}"),
        (theirs / "deeper" / "home", f"{theirs} is owned by uid {NOBODY}"),
        (shared / "home", "other users could rename"),
        (link_dir / "home", f"{link_dir / 'home'} is owned by uid {NOBODY}"),
    ):
        with pytest.raises(UnsafePath, match=why):
            Context(Settings(home=home))
        assert not home.exists()
    shared.chmod(0o1777)  # sticky, as /tmp: nobody may rename what is not theirs
    Context(Settings(home=shared / "home"))
    assert mode(shared / "home") == 0o700


@pytest.mark.root("a job runs in its own PID namespace")
def test_the_job_keeps_its_callers_umask_while_its_log_is_private(torpor: Torpor, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    command = ["run", "--name", "um", "--", "sh", "-c", "touch made; umask"]
    subprocess.run(
        ["sh", "-c", 'umask 027 && exec "$0" "$@"', TORPOR, *command],
        cwd=work,
        env=torpor.env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    torpor.wait_state("um", "exited")
    assert mode(work / "made") == 0o640  # 0666 less the caller's 027
    assert torpor.log("um").strip() == "0027"
    job_dir = torpor.home / "jobs" / "um"
    assert mode(job_dir / "output.log") == 0o600 and mode(job_dir / "launcher.log") == 0o600
    assert open_to_others(torpor.home) == {}


@pytest.mark.criu
def test_images_logs_store_and_rewound_files_are_private(torpor: Torpor, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    torpor.run("run", "--name", "wr", *python_job("writer.py", str(data)))
    torpor.wait_log("wr", "step 3")
    checkpoint = torpor.json("checkpoint", "wr", "--wait")
    hot = hot_root(torpor)
    image = hot / checkpoint["id"]
    assert mode(hot) == 0o700 and mode(image) == 0o700
    assert {mode(p) for p in image.iterdir()} == {0o600}  # CRIU's images and torpor's record
    torpor.wait_log("wr", "step 10")
    torpor.run("stop", "wr", "--timeout", "0")
    assert "rewound 1 file" in torpor.run("resume", "wr").stderr
    torpor.wait_state("wr", "running")
    job_dir = torpor.home / "jobs" / "wr"
    (saved,) = [p for p in (job_dir / "rewound").rglob("*") if p.is_file()]
    assert mode(job_dir / "rewound") == 0o700 and mode(saved.parent) == 0o700 and mode(saved) == 0o600
    criu_logs = list((job_dir / "criu").iterdir())
    assert criu_logs and {mode(p) for p in criu_logs} == {0o600}
    chunks = [p for p in (torpor.home / "images").rglob("*") if p.is_file()]
    assert chunks and {mode(p) for p in chunks} == {0o600}
    assert mode(torpor.home) == 0o700 and mode(torpor.home / "torpor.db") == 0o600
    assert open_to_others(torpor.home, hot) == {}


@pytest.mark.criu
@pytest.mark.root("giving a folder to another user")
def test_a_hot_tier_another_user_made_first_is_refused_and_the_job_runs_on(torpor: Torpor) -> None:
    hot = hot_root(torpor)
    hot.parent.mkdir(mode=0o755)
    hot.mkdir()
    os.chown(hot, NOBODY, NOBODY)
    hot.chmod(0o777)
    torpor.run("run", "--name", "c", *python_job("counter.py"))
    torpor.wait_log("c", "step 2")
    result = torpor.run("checkpoint", "c", check=False)
    assert result.returncode == UnsafePath.exit_code
    assert f"the hot tier {hot} is owned by uid {NOBODY}" in result.stderr
    assert "remove it, or set TORPOR_HOT_DIR" in result.stderr
    assert list(hot.iterdir()) == []  # nothing of the job was written into it
    assert torpor.job("c")["state"] == "running"
