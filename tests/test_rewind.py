"""The files a job writes around a restore, beyond sqlite (tests/programs/test_sqlite.py): a file someone
else appended to after the job was stopped is refused, not cut; ``--rewind`` cuts it, its bytes saved
once however many attempts; and ``restore --from`` warns of files the job maps shared, which it cannot
roll back (their content is the file's, not the image's).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import Torpor, python_job
from torpor.core.rewind import Rewound, _cut, rewind_written_files


def saved_files(torpor: Torpor, name: str) -> list[Path]:
    return [p for p in (torpor.home / "jobs" / name / "rewound").rglob("*") if p.is_file()]


def test_cutting_the_same_bytes_twice_saves_them_once(tmp_path: Path) -> None:
    data, keep = tmp_path / "data.txt", tmp_path / "rewound"
    data.write_bytes(b"kept\n" + b"later\n" * 100)
    first = _cut(data, 5, keep)
    assert data.read_bytes() == b"kept\n" and first.created
    data.write_bytes(b"kept\n" + b"later\n" * 100)  # the job wrote the same again, and is rolled back again
    second = _cut(data, 5, keep)
    assert second.saved == first.saved and not second.created
    assert [p.read_bytes() for p in keep.iterdir()] == [b"later\n" * 100]


def test_undo_puts_back_content_size_and_mtime(tmp_path: Path) -> None:
    data, keep = tmp_path / "data.txt", tmp_path / "rewound"
    data.write_bytes(b"kept\n" + b"later\n" * 100)
    os.utime(data, ns=(1_000_000_123, 2_000_000_456))
    before = data.read_bytes(), data.stat().st_mtime_ns
    rewound = Rewound(done=[_cut(data, 5, keep)])
    assert data.read_bytes() == b"kept\n"
    assert rewound.undo() == []
    assert (data.read_bytes(), data.stat().st_mtime_ns) == before
    assert not keep.exists() or not any(keep.iterdir()), "the bytes put back are still saved"


def test_undo_leaves_a_file_that_changed_again_and_says_so(tmp_path: Path) -> None:
    data, keep = tmp_path / "data.txt", tmp_path / "rewound"
    data.write_bytes(b"kept\n" + b"later\n")
    rewound = Rewound(done=[_cut(data, 5, keep)])
    data.write_bytes(b"kept\nnew\n")  # e.g. the restored job ran and wrote before the restore failed
    (problem,) = rewound.undo()
    assert "changed again" in problem and data.read_bytes() == b"kept\nnew\n"
    assert [p.read_bytes() for p in keep.iterdir()] == [b"later\n"]


def test_nothing_to_rewind_without_an_image(tmp_path: Path) -> None:
    assert rewind_written_files(tmp_path, tmp_path / "rewound").paths == []


@pytest.mark.criu
@pytest.mark.timeout(120)
def test_a_file_appended_to_by_someone_else_after_a_stop_is_refused_then_rewound(
    torpor: Torpor, tmp_path: Path
) -> None:
    data = tmp_path / "metrics.txt"
    torpor.run("run", "--name", "fw", *python_job("writer.py", str(data)))
    torpor.wait_log("fw", "step 5")
    torpor.run("checkpoint", "fw")
    torpor.wait_log("fw", "step 20")
    torpor.run("stop", "fw", "--timeout", "0")
    with data.open("a") as other:  # another program, once the job is gone
        other.write("not the job's\n")
    before = data.read_bytes()
    result = torpor.run("resume", "fw", check=False)
    assert result.returncode == 2 and f"{data}: modified after the job stopped" in result.stderr, (
        result.stderr
    )
    assert data.read_bytes() == before and torpor.job("fw")["state"] == "failed"

    result = torpor.run("resume", "--rewind", "fw")
    assert "rewound 1 file" in result.stderr and "changed by someone else" in result.stderr
    (saved,) = saved_files(torpor, "fw")
    cut = saved.read_bytes()
    assert cut.endswith(b"not the job's\n") and before.endswith(cut) and len(cut) < len(before)
    torpor.wait_for(lambda: data.stat().st_size > len(before), what="the resumed job writing on")
    lines = data.read_text().splitlines()
    assert lines == [f"line {i}" for i in range(len(lines))], "the file has gaps, repeats or the foreign line"


@pytest.mark.criu
@pytest.mark.timeout(120)
def test_restore_from_warns_that_a_shared_mapped_file_is_not_rolled_back(
    torpor: Torpor, tmp_path: Path
) -> None:
    shared = tmp_path / "shared.bin"
    shared.write_bytes(bytes(4096))
    torpor.run("run", "--name", "sm", *python_job("shared_map.py", str(shared)))
    torpor.wait_log("sm", "step 3 ")
    checkpoint = torpor.json("checkpoint", "sm")["id"]
    torpor.wait_log("sm", "step 30 ")
    result = torpor.run("restore", "--from", checkpoint, "--force", "sm")
    assert "not rolled back" in result.stderr and str(shared) in result.stderr, result.stderr
    # what the warning says: the job's memory went back to the checkpoint, the file did not
    torpor.wait_for(lambda: len(since_restore(torpor.log("sm"))) >= 3, what="the restored job's steps")
    after = since_restore(torpor.log("sm"))
    assert all(file > step >= 3 for step, file in after), after


def since_restore(log: str) -> list[tuple[int, int]]:
    """The (step, file count) lines the restored job printed: from where the step went back."""
    steps = [(int(s), int(f)) for s, f in re.findall(r"^step (\d+) file (\d+)$", log, re.M)]
    back = next((i for i in range(1, len(steps)) if steps[i][0] <= steps[i - 1][0]), len(steps))
    return steps[back:]


@pytest.mark.criu
@pytest.mark.timeout(120)
def test_a_rollback_warns_of_files_rewritten_in_place_after_the_checkpoint(
    torpor: Torpor, tmp_path: Path
) -> None:
    data = tmp_path / "counter.db"
    data.write_bytes(bytes(8))
    torpor.run("run", "--name", "rw", *python_job("rewriter.py", str(data)))
    torpor.wait_log("rw", "step 3\n")
    hibernated = torpor.json("hibernate", "rw")["id"]
    # a resume of the hibernation: the file is as the job left it, nothing to warn of
    resumed = torpor.run("resume", "rw")
    assert "read-write" not in resumed.stderr, resumed.stderr
    torpor.wait_log("rw", "step 30\n")
    rolled = torpor.run("restore", "--from", hibernated, "--force", "rw")
    assert "opened read-write were modified after checkpoint" in rolled.stderr, rolled.stderr
    assert str(data) in rolled.stderr
