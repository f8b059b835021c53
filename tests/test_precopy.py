"""Pre-copied checkpoints (torpor.core.precopy): the helpers that make the image whole, and a real job
whose memory changes in every way while its rounds run, checkpointed and restored with real CRIU."""

from __future__ import annotations

import os
import random
import signal
import struct
import time
from pathlib import Path

import pytest

from conftest import Torpor, python_job
from torpor.adapters import writetrack
from torpor.core import precopy


def test_subtract_and_split() -> None:
    assert list(precopy._subtract([(0, 100)], [(10, 20), (50, 60)])) == [(0, 10), (20, 50), (60, 100)]
    assert list(precopy._subtract([(10, 20)], [(0, 100)])) == []
    held = [(0, 8192), (16384, 20480)]
    assert list(precopy._split_held(4096, 20480, held)) == [
        (4096, 8192, True),
        (8192, 16384, False),
        (16384, 20480, True),
    ]
    assert precopy._clip(0, 100, [(10, 20), (90, 200)]) == [(10, 20), (90, 100)]


def test_round_one_lays_pages_out_in_address_order_and_later_pages_find_their_place() -> None:
    layout = precopy._Layout()
    page = precopy.PAGE_SIZE
    assert layout.add(10 * page, 2 * page) == 0
    assert layout.add(12 * page, page) == 2 * page  # meets the run before: one run
    assert layout.add(20 * page, page) == 3 * page
    assert (layout.starts, layout.offsets, layout.size) == ([10 * page, 20 * page], [0, 3 * page], 4 * page)
    assert list(layout.split(8 * page, 22 * page)) == [
        (8 * page, 10 * page, None),
        (10 * page, 13 * page, 0),
        (13 * page, 20 * page, None),
        (20 * page, 21 * page, 3 * page),
        (21 * page, 22 * page, None),
    ]
    assert list(layout.split(11 * page, 12 * page)) == [(11 * page, 12 * page, page)]
    with pytest.raises(ValueError):
        layout.add(page, page)
    # what a round copies is in address order, a range given twice copied once
    ranges = [
        writetrack.Range(5 * page, 2 * page),
        writetrack.Range(page, page),
        writetrack.Range(6 * page, 3 * page),
    ]
    assert writetrack.merged(ranges) == [writetrack.Range(page, page), writetrack.Range(5 * page, 4 * page)]


@pytest.mark.parametrize("seed", range(40))
def test_the_copy_file_becomes_the_pages_file_in_place_whatever_came_and_went(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 1's pages, some gone since, some rewritten by the dump, new ones between them: moved in
    place (through a buffer smaller than a run, so that a run overlaps itself), the file holds exactly
    the image's pages in address order, each with its own content."""
    rng = random.Random(seed)
    page = precopy.PAGE_SIZE
    monkeypatch.setattr(precopy, "_CHUNK", 3 * page)
    slots = sorted(rng.sample(range(200), rng.randint(1, 120)))
    copy = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT, 0o600)
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)
    for index, vaddr in enumerate(slots):  # round 1: page at vaddr holds "c<vaddr>"
        os.pwrite(copy, f"c{vaddr}".encode().ljust(page, b"."), index * page)
    kept = [v for v in slots if rng.random() < 0.7]
    new = [v for v in range(200) if v not in slots and rng.random() < 0.15]
    rewritten = [v for v in kept if rng.random() < 0.2]
    runs, want = [], {}
    for offset, vaddr in enumerate(sorted(new + rewritten)):  # the dump's and the extra file's pages
        os.pwrite(other, f"o{vaddr}".encode().ljust(page, b"."), offset * page)
        runs.append(precopy._Run(vaddr * page, 1, other, offset * page, 1))
        want[vaddr] = f"o{vaddr}"
    for vaddr in kept:
        if vaddr not in rewritten:
            runs.append(precopy._Run(vaddr * page, 1, copy, slots.index(vaddr) * page, 1))
            want[vaddr] = f"c{vaddr}"
    runs = _joined(sorted(runs, key=lambda run: run.vaddr))
    assert seed or max(run.pages for run in runs) > 3  # (at least one run longer than the buffer)
    precopy._assemble(runs, copy)
    data = (tmp_path / "copy").read_bytes()
    assert len(data) == len(want) * page
    assert [data[i : i + page].rstrip(b".").decode() for i in range(0, len(data), page)] == [
        want[v] for v in sorted(want)
    ]


def _joined(runs: list[precopy._Run]) -> list[precopy._Run]:
    """Runs that meet in memory and in their source made one, as the layout gives them."""
    joined: list[precopy._Run] = []
    for run in runs:
        last = joined[-1] if joined else None
        if (
            last is not None
            and last.source == run.source
            and last.vaddr + last.pages * precopy.PAGE_SIZE == run.vaddr
            and last.offset + last.pages * precopy.PAGE_SIZE == run.offset
        ):
            joined[-1] = precopy._Run(last.vaddr, last.pages + run.pages, run.source, last.offset, run.flags)
        else:
            joined.append(run)
    return joined


def test_found_regions_scanned_twice_are_merged(tmp_path: Path) -> None:
    found = tmp_path / "found-1"
    found.write_bytes(
        b"".join(struct.pack("<QQQ", *r) for r in [(8192, 16384, 8), (0, 4096, 8), (8192, 12288, 2)])
    )
    assert precopy._read_found(found) == [(0, 4096, 8), (8192, 16384, 10)]
    found.write_bytes(b"\0" * 10)
    with pytest.raises(precopy.Incomplete):
        precopy._read_found(found)


def _checks(result: Path) -> dict[str, str]:
    return {
        path.name: path.read_text()
        for path in result.parent.glob(result.name + "*")
        if ".new" not in path.name
    }


@pytest.mark.criu
@pytest.mark.root
def test_a_pre_copied_checkpoint_restores_the_memory_of_the_freeze(torpor: Torpor, tmp_path: Path) -> None:
    """The job writes a running sequence, maps, unmaps and drops memory, starts threads and forks a
    child while the rounds run; restored, every page of every process is what it was at the freeze."""
    if writetrack.probe() is not None:
        pytest.skip(f"this machine cannot track writes: {writetrack.probe()}")
    torpor.env["TORPOR_PRECOPY"] = "1"
    result = tmp_path / "result"
    torpor.run("run", "--name", "pc", *python_job("precopy_job.py", "64", "5000", str(result)))
    torpor.wait_log("pc", "ready")
    out = torpor.run("checkpoint", "pc")
    assert "pre-copied in" in out.stderr, out.stderr
    assert "came from the copy" in out.stderr, out.stderr
    assert ", after pre-copying " in out.stdout, out.stdout
    record = torpor.json("checkpoints", "pc")[-1]
    checkpoint = record["id"]
    # the rounds are kept with the checkpoint: the first copied all 64 MiB of the sequence
    assert record["rounds"] and record["rounds"][0][0] >= 64 << 20, record
    assert "B in " in torpor.run("checkpoints", "pc").stdout
    time.sleep(0.5)  # the job goes on past its checkpoint: the restore must take it back
    torpor.run("restore", "pc", "--from", checkpoint, "--force")
    job = torpor.job("pc")
    members = [
        job["pid"],
        *(int(c) for c in Path(f"/proc/{job['pid']}/task/{job['pid']}/children").read_text().split()),
    ]
    for pid in members:
        os.kill(pid, signal.SIGUSR1)
    # the threads answer before the main thread does, the child after it
    torpor.wait_for(lambda: {"result", "result.child"} <= set(_checks(result)), 30, "every process's check")
    checks = _checks(result)
    assert any(name.startswith("result.thread-") for name in checks), checks
    assert checks == {name: "ok" for name in checks}


@pytest.mark.criu
@pytest.mark.root
def test_without_precopy_the_checkpoint_says_nothing_of_it(torpor: Torpor, tmp_path: Path) -> None:
    torpor.env["TORPOR_PRECOPY"] = "0"
    torpor.run("run", "--name", "plain", *python_job("precopy_job.py", "4", "100", str(tmp_path / "r")))
    torpor.wait_log("plain", "ready")
    out = torpor.run("checkpoint", "plain")
    assert "pre-cop" not in out.stderr + out.stdout
    assert torpor.json("checkpoints", "plain")[-1]["rounds"] == []
