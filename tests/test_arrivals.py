"""core/arrivals: the files a job writes, carried with it to a peer (issue 30), checked when they arrive
and put in their places only when the job is handed over. A real state directory and store; no CRIU
(an arrival of no checkpoint)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import Torpor
from torpor.core.arrivals import Arrivals
from torpor.core.rewind import STOPPED_FILE
from torpor.errors import TorporError, UsageError, WrongState

MTIME = 1_700_000_000_123_456_789


def spec(*files: dict[str, Any], stopped: dict[str, Any] | None = None) -> dict[str, Any]:
    """An arrival's records with no checkpoint, carrying ``files``."""
    return {"command": ["true"], "cwd": "/", "log_path": "/nowhere.log", "checkpoints": [], "files": list(files),
            "stopped": stopped}  # fmt: skip


def carried(path: Path, size: int, **changes: Any) -> dict[str, Any]:
    return {"path": str(path), "size": size, "mtime_ns": MTIME, "mode": 0o640, "uid": os.getuid(),
            "gid": os.getgid(), **changes}  # fmt: skip


def test_a_carried_file_is_put_in_its_place_only_at_go_with_its_mode_time_and_the_records_inode(
    torpor: Torpor, tmp_path: Path
) -> None:
    arrivals = Arrivals(torpor.engine())
    target = tmp_path / "out" / "metrics.txt"
    target.parent.mkdir()
    target.write_text("the peer's older copy\n")
    arrivals.put_file("j", 0, 0, b"line 0\n")
    arrivals.put_file("j", 0, 7, b"line 1\n")
    with pytest.raises(UsageError, match="is 14 bytes here, not 3"):
        arrivals.put_file("j", 0, 3, b"x")
    at_stop = {
        "format": 1,
        "checkpoint": "abc123",
        "files": {str(target): {"size": 14, "mtime_ns": MTIME, "ino": 1}},
    }
    arrivals.arrive("j", 1, "node1", spec(carried(target, 14), stopped=at_stop))
    assert target.read_text() == "the peer's older copy\n"  # arriving: nothing of the peer's is touched yet

    arrivals.go("j", 1)
    assert target.read_text() == "line 0\nline 1\n"
    info = target.stat()
    assert (info.st_mode & 0o7777, info.st_mtime_ns) == (0o640, MTIME)
    assert [p.name for p in target.parent.iterdir()] == ["metrics.txt"]  # no copy left beside it
    record = json.loads((torpor.engine().settings.job_dir("j") / STOPPED_FILE).read_text())
    assert record["files"][str(target)]["ino"] == info.st_ino  # a restore takes it for the job's own

    arrivals.go("j", 1)  # sent again: it is the peer's already, nothing is put twice
    assert target.stat().st_ino == info.st_ino


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("relative/file", "must be absolute and plain"),
        ("/tmp/../etc/passwd", "must be absolute and plain"),
        ("HOME/torpor.db", "may not be in torpor's own folder"),
    ],
)
def test_an_arrival_naming_a_file_badly_is_refused_whole(torpor: Torpor, path: str, problem: str) -> None:
    arrivals = Arrivals(torpor.engine())
    arrivals.put_file("j", 0, 0, b"x")
    bad = carried(Path(path.replace("HOME", str(torpor.home))), 1)
    with pytest.raises(UsageError, match=problem):
        arrivals.arrive("j", 1, "node1", spec(bad))
    assert torpor.json("ps") == []


def test_a_file_that_did_not_arrive_whole_refuses_the_arrival(torpor: Torpor, tmp_path: Path) -> None:
    arrivals = Arrivals(torpor.engine())
    arrivals.put_file("j", 0, 0, b"half")
    with pytest.raises(UsageError, match="did not arrive whole"):
        arrivals.arrive("j", 1, "node1", spec(carried(tmp_path / "f", 8)))
    with pytest.raises(UsageError, match="did not arrive whole"):  # never sent at all
        arrivals.arrive("j", 1, "node1", spec(carried(tmp_path / "f", 4), carried(tmp_path / "g", 1)))
    with pytest.raises(UsageError, match="out of range"):
        arrivals.put_file("j", -1, 0, b"")


def test_another_users_file_in_the_way_fails_the_hand_off_and_is_left_as_it_was(
    torpor: Torpor, tmp_path: Path
) -> None:
    arrivals = Arrivals(torpor.engine())
    target = tmp_path / "theirs.txt"
    target.write_text("someone else's\n")
    arrivals.put_file("j", 0, 0, b"job's\n")
    arrivals.arrive("j", 1, "node1", spec(carried(target, 6, uid=os.getuid() + 1)))
    with pytest.raises(WrongState, match="belongs to another user here"):
        arrivals.go("j", 1)
    assert target.read_text() == "someone else's\n"
    # not handed over: the source still holds the job, and may ask again
    incoming, _ = arrivals.moves.incoming("j")
    assert incoming.state.name == "ARRIVING"


def test_a_folder_gone_since_the_look_fails_the_hand_off_in_one_line(torpor: Torpor, tmp_path: Path) -> None:
    arrivals = Arrivals(torpor.engine())
    arrivals.put_file("j", 0, 0, b"x")
    arrivals.arrive("j", 1, "node1", spec(carried(tmp_path / "gone" / "f", 1)))
    with pytest.raises(
        TorporError, match=r"cannot put .*/gone/f in its place here: No such file or directory"
    ):
        arrivals.go("j", 1)


def test_a_file_is_not_put_through_a_link_nor_where_its_owner_could_not_have_made_it(
    torpor: Torpor, tmp_path: Path
) -> None:
    arrivals = Arrivals(torpor.engine())
    shut = tmp_path / "shut"
    shut.mkdir(mode=0o755)
    if os.getuid() == 0:
        os.chown(shut, 54321, 54321)  # another user's folder, shut to the job's user (12345)
    else:
        shut.chmod(0o555)
    (tmp_path / "link").symlink_to(shut)
    arrivals.put_file("j", 0, 0, b"x")
    arrivals.arrive("j", 1, "node1", spec(carried(tmp_path / "link" / "f", 1)))
    with pytest.raises(WrongState, match="reached through a symbolic link here"):
        arrivals.go("j", 1)
    arrivals.put_file("j", 0, 0, b"x")
    arrivals.arrive("j", 1, "node1", spec(carried(shut / "f", 1, uid=12345, gid=12345)))
    with pytest.raises(WrongState, match="is not the job's user's to write in here"):
        arrivals.go("j", 1)
    assert list(shut.iterdir()) == []
