"""The store under real checkpoints: real CRIU dumps of small real processes, through the CLI —
durable checkpoints restored from the cold tier alone, dedup between checkpoints, a flipped byte, several
jobs checkpointed at once while gc runs, and an encrypted S3 cold tier on a real S3 server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import TORPOR, Torpor, holders, python_job
from torpor.adapters.folder import FolderBackend
from torpor.core.store.repository import Repository
from torpor.settings import Settings

from .conftest import chunks_cached_share, drop_chunk, flip_chunk_bit, in_memory_only

pytestmark = [pytest.mark.criu, pytest.mark.timeout(240)]


@pytest.fixture
def hot(torpor: Torpor) -> Iterator[Path]:
    """The job's hot tier: torpor's own folder inside the TORPOR_HOT_DIR the test gives it."""
    parent = Path("/dev/shm") / f"torpor-test-{uuid.uuid4().hex[:8]}"
    torpor.env["TORPOR_HOT_DIR"] = str(parent)
    yield Settings(home=torpor.home.absolute(), hot_dir=parent).hot_path
    shutil.rmtree(parent, ignore_errors=True)


def last_step(log: str) -> int:
    return max(int(n) for n in re.findall(r"^step (\d+)$", log, re.M))


def drop_hot_copies(hot: Path) -> None:
    for entry in hot.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)


def states(torpor: Torpor, job: str) -> dict[str, dict[str, object]]:
    return {c["id"]: c for c in torpor.json("checkpoints", job)}


def test_a_durable_checkpoint_restores_from_the_cold_tier_alone(torpor: Torpor, hot: Path) -> None:
    torpor.run("run", "--name", "c", *python_job("counter.py"))
    torpor.wait_log("c", "step 3")
    out = torpor.run("checkpoint", "c", "--wait").stdout
    assert re.search(r"is durable: .* new in the store", out)
    first = torpor.json("checkpoints", "c")[0]
    assert first["state"] == "durable" and first["stored_bytes"] < first["size_bytes"]
    assert re.search(r"durable$", torpor.run("checkpoints").stdout, re.M)
    torpor.run("hibernate", "c", "--wait")
    at_hibernate = last_step(torpor.log("c"))
    drop_hot_copies(hot)
    torpor.run("resume", "c")
    torpor.wait_for(lambda: last_step(torpor.log("c")) > at_hibernate + 3, what="progress after resume")


def test_a_hibernated_image_leaves_ram_once_durable(torpor: Torpor, hot: Path) -> None:
    """Hibernation frees memory: the image must not stay in the RAM hot tier once it is on disk, nor the
    job's last checkpoint (the hibernation wrote its pages over that copy's memory); other jobs keep theirs."""
    for name in ("h", "o"):
        torpor.run("run", "--name", name, *python_job("counter.py"))
        torpor.wait_log(name, "step 3")
    other = torpor.json("checkpoint", "o", "--wait")["id"]
    kept = torpor.json("checkpoint", "h", "--wait")["id"]
    hibernated = torpor.json("hibernate", "h", "--wait")["id"]
    torpor.wait_for(lambda: not (hot / hibernated).exists(), what="the hibernated image to leave RAM")
    assert not (hot / kept).exists() and (hot / other).exists()  # a plain checkpoint stays hot
    torpor.run("resume", "h")
    torpor.wait_log("h", f"step {last_step(torpor.log('h')) + 2}")
    torpor.run("restore", "h", "--from", kept, "--force")  # its memory went; the cold tier has it
    torpor.wait_log("h", f"step {last_step(torpor.log('h')) + 2}")


def test_only_the_newest_durable_checkpoint_of_a_job_stays_in_ram(torpor: Torpor, hot: Path) -> None:
    """Older copies of a job only hold RAM once a newer one is durable; other jobs keep theirs."""
    for name in ("a", "b"):
        torpor.run("run", "--name", name, *python_job("counter.py"))
        torpor.wait_log(name, "step 3")
    first = torpor.json("checkpoint", "a", "--wait")["id"]
    other = torpor.json("checkpoint", "b", "--wait")["id"]
    second = torpor.json("checkpoint", "a", "--wait")["id"]
    torpor.wait_for(lambda: not (hot / first).exists(), what="the older copy of job a to leave RAM")
    assert (hot / second).exists() and (hot / other).exists()
    assert {c["id"]: c["state"] for c in torpor.json("checkpoints", "a")} == {
        first: "durable",
        second: "durable",
    }
    torpor.run("restore", "a", "--from", first, "--force")  # a rollback reads the cold tier
    torpor.wait_log("a", f"step {last_step(torpor.log('a')) + 2}")


def test_a_second_checkpoint_stores_only_what_changed(torpor: Torpor, hot: Path) -> None:
    job = str(Path(__file__).parent / "jobs" / "memory_check.py")
    torpor.run("run", "--name", "d", "--", sys.executable, "-u", job, "48")
    torpor.wait_log("d", "digest")
    first = json.loads(torpor.run("checkpoint", "d", "--wait", "--json").stdout)
    second = json.loads(torpor.run("checkpoint", "d", "--wait", "--json").stdout)
    assert first["stored_bytes"] > 48 << 20  # random memory does not compress
    assert second["stored_bytes"] < first["stored_bytes"] / 8


def cached_share(repo: Repository, checkpoint: str) -> float:
    """The share of a checkpoint's stored memory pages that the page cache holds."""
    pages = (f for f in repo.manifest(checkpoint).files if f.name.startswith("pages-"))
    return chunks_cached_share(repo, {c for entry in pages for _, _, c in entry.extents if c})


def test_only_a_hibernation_leaves_its_stored_memory_in_the_page_cache(torpor: Torpor, hot: Path) -> None:
    """A checkpoint stays in RAM, where a restore reads it: its chunks go to the disk around the page
    cache, not into memory a second time. A hibernation leaves RAM, and its resume reads the cold tier:
    its chunks stay in the page cache."""
    job = str(Path(__file__).parent / "jobs" / "memory_check.py")
    for name in ("c", "h"):  # random memory of their own: neither's chunks are the other's
        torpor.run("run", "--name", name, "--", sys.executable, "-u", job, "24")
        torpor.wait_log(name, "digest")
    checkpoint = torpor.json("checkpoint", "c", "--wait")["id"]
    hibernated = torpor.json("hibernate", "h", "--wait")["id"]
    if in_memory_only(torpor.home / "images"):
        pytest.skip("the cold tier is a file system in memory")
    repo = Repository(FolderBackend(torpor.home / "images"))
    assert cached_share(repo, checkpoint) < 0.1
    assert cached_share(repo, hibernated) > 0.9
    assert (hot / checkpoint).is_dir()
    digests = torpor.log("h").count("digest")
    torpor.run("resume", "h")
    torpor.wait_for(lambda: torpor.log("h").count("digest") > digests, what="h to go on after its resume")
    assert len(set(re.findall(r"^digest (\w+)$", torpor.log("h"), re.M))) == 1  # its memory, whole


def test_a_flipped_byte_is_refused_and_the_job_stays_hibernated(torpor: Torpor, hot: Path) -> None:
    torpor.run("run", "--name", "f", *python_job("counter.py"))
    torpor.wait_log("f", "step 3")
    torpor.run("hibernate", "f", "--wait")
    checkpoint = torpor.json("checkpoints", "f")[0]["id"]
    drop_hot_copies(hot)
    repo = Repository(FolderBackend(torpor.home / "images"))
    pages = next(f for f in repo.manifest(checkpoint).files if f.name.startswith("pages-"))
    chunk = next(c for _, _, c in pages.extents if c)
    flip_chunk_bit(repo, chunk, mask=0x10)
    result = torpor.run("resume", "f", check=False)
    assert result.returncode == 6
    assert "Traceback" not in result.stderr
    assert f"torpor: error: checkpoint {checkpoint} is damaged" in result.stderr
    assert torpor.job("f")["state"] == "hibernated"


def hibernate_then_flip_a_memory_byte(torpor: Torpor, hot: Path, name: str) -> str:
    """Run a job holding 32 MiB of random memory, hibernate it to the cold tier alone, and flip a byte of
    its biggest memory chunk (stored raw: random data does not compress); returns the checkpoint id."""
    job = str(Path(__file__).parent / "jobs" / "memory_check.py")
    torpor.run("run", "--name", name, "--", sys.executable, "-u", job, "32")
    torpor.wait_log(name, "digest")
    torpor.run("hibernate", name, "--wait")
    checkpoint: str = torpor.json("checkpoints", name)[0]["id"]
    drop_hot_copies(hot)
    repo = Repository(FolderBackend(torpor.home / "images"))
    pages = next(f for f in repo.manifest(checkpoint).files if f.name.startswith("pages-"))
    sizes = {c: n for _, n, c in pages.extents if c}
    flip_chunk_bit(repo, max(sizes, key=lambda c: sizes[c]), -100, 0x10)
    return checkpoint


@pytest.mark.parametrize("stream", ["1", "0"], ids=["streamed", "whole-image"])
def test_a_flipped_byte_in_raw_memory_stops_the_restored_job_before_it_runs(
    torpor: Torpor, hot: Path, stream: str
) -> None:
    """Random memory is stored uncompressed: only the hash check, run while CRIU reads, catches it.

    Streamed, the chunk is checked before CRIU gets a byte of it; restoring from a whole copy of the
    image, CRIU reads it while it is checked, and the job is held until the verdict.
    """
    torpor.env["TORPOR_STREAM_RESTORE"] = stream
    checkpoint = hibernate_then_flip_a_memory_byte(torpor, hot, "g")
    log = torpor.home / "jobs" / "g" / "output.log"
    before = log.read_bytes()
    result = torpor.run("resume", "g", check=False)
    assert result.returncode == 6, result.stderr
    assert "Traceback" not in result.stderr
    assert f"torpor: error: checkpoint {checkpoint} is damaged: pages-" in result.stderr
    assert torpor.job("g")["state"] == "hibernated"
    # once no process has its log open, nothing can write to it: had the job run a moment, it would have
    torpor.wait_for(lambda: not holders(log), what="no process to hold the job's log")
    assert log.read_bytes() == before


def test_several_jobs_checkpointed_at_once_while_gc_runs(torpor: Torpor, hot: Path) -> None:
    names = ["j0", "j1", "j2"]
    for name in names:
        torpor.run("run", "--name", name, *python_job("counter.py"))
    for name in names:
        torpor.wait_log(name, "step 2")
    procs = [
        subprocess.Popen([TORPOR, "checkpoint", name, "--wait", "-q"], env=torpor.env, stderr=subprocess.PIPE)
        for name in names
    ]
    procs += [
        subprocess.Popen([TORPOR, "gc", "-q"], env=torpor.env, stderr=subprocess.PIPE) for _ in range(3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    torpor.run("gc")
    drop_hot_copies(hot)
    for name in names:
        checkpoint = torpor.json("checkpoints", name)[0]
        assert checkpoint["state"] == "durable"
        torpor.run("stop", name, "--timeout", "0.1")
        lines = torpor.log(name).count("\n")
        torpor.run("restore", name, "--from", checkpoint["id"])
        torpor.wait_for(lambda n=name, b=lines: torpor.log(n).count("\n") > b + 2, what=f"{name} to continue")


@pytest.mark.s3
def test_an_encrypted_s3_cold_tier(torpor: Torpor, hot: Path, s3_endpoint: str, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    torpor.env.update(
        TORPOR_STORE=f"s3://torpor-{uuid.uuid4().hex[:8]}/node-a",
        TORPOR_S3_ENDPOINT=s3_endpoint,
        TORPOR_KEY_FILE=str(key),
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    torpor.run("run", "--name", "s", *python_job("counter.py"))
    torpor.wait_log("s", "step 3")
    torpor.run("hibernate", "s", "--wait")
    at_hibernate = last_step(torpor.log("s"))
    drop_hot_copies(hot)
    assert not (torpor.home / "images").exists()
    wrong = tmp_path / "wrong"
    wrong.write_bytes(os.urandom(32))
    # another key file in the environment than the state directory's: refused before anything is read
    refused = Torpor(torpor.home, {**torpor.env, "TORPOR_KEY_FILE": str(wrong)}).run(
        "resume", "s", check=False
    )
    assert refused.returncode == 2 and "torpor store set --key-file" in refused.stderr
    # the configured key file now holds another key: the store says it is not its key
    right = key.read_bytes()
    key.write_bytes(wrong.read_bytes())
    refused = torpor.run("resume", "s", check=False)
    assert refused.returncode == 6 and "is not the key of the store" in refused.stderr
    assert torpor.job("s")["state"] == "hibernated"
    key.write_bytes(right)
    torpor.run("resume", "s")
    torpor.wait_for(lambda: last_step(torpor.log("s")) > at_hibernate + 3, what="progress after resume")


def test_lazy_resume(torpor: Torpor, hot: Path) -> None:
    torpor.run("run", "--name", "l", *python_job("counter.py"))
    torpor.wait_log("l", "step 3")
    torpor.run("hibernate", "l", "--wait")
    at_hibernate = last_step(torpor.log("l"))
    drop_hot_copies(hot)  # from the cold tier, verified, then its memory served on demand
    resumed = torpor.run("resume", "l", "--lazy")
    assert "all of its memory is in" in resumed.stderr
    torpor.wait_for(
        lambda: last_step(torpor.log("l")) > at_hibernate + 3, what="progress after a lazy resume"
    )
    assert any((torpor.home / "jobs" / "l" / "criu").glob("lazy-pages-*.log"))
    # the restore folder goes once the lazy-pages daemon has every page in
    torpor.wait_for(lambda: not any(p.name.startswith("restore-") for p in hot.iterdir()), what="cleanup")


def test_a_corrupt_chunk_met_by_a_lazy_resume_kills_the_job_with_the_reason(
    torpor: Torpor, hot: Path
) -> None:
    # the byte is in the random bytearray: lazy memory, read only through the page server
    hibernate_then_flip_a_memory_byte(torpor, hot, "z")
    digests = torpor.log("z").count("digest")
    result = torpor.run("resume", "z", "--lazy", check=False)
    assert "does not match its content hash" in result.stderr and "Traceback" not in result.stderr
    if result.returncode == 6:
        # the bad chunk was met while criu restore still ran (CI saw it): CRIU failed before the tree
        # was handed over and killed it itself, so nothing ran and the job is as it was
        assert "job 'z' stays hibernated; its checkpoints are untouched" in result.stderr
        assert torpor.job("z")["state"] == "hibernated"
    else:
        assert result.returncode == 5, result.stderr
        assert "the lazily restored job 'z' was killed" in result.stderr
        assert torpor.job("z")["state"] == "failed"  # it said so once the job was gone
        assert "lazy restore failed, the job was killed" in torpor.job("z")["message"]
        assert "does not match its content hash" in torpor.job("z")["message"]
        assert "z: lazy restore failed, the job was killed" in torpor.run("ps").stdout
    assert torpor.log("z").count("digest") == digests  # it never printed a digest of wrong memory


def test_a_checkpoint_right_after_a_lazy_resume_loses_no_memory(torpor: Torpor, hot: Path) -> None:
    job = str(Path(__file__).parent / "jobs" / "memory_check.py")
    torpor.run("run", "--name", "m", "--", sys.executable, "-u", job, "1024")
    torpor.wait_log("m", "digest")
    torpor.run("hibernate", "m", "--wait")
    torpor.run("resume", "m", "--lazy")
    torpor.run("hibernate", "m")  # while lazy-pages may still be bringing memory in
    torpor.run("resume", "m")
    lines = torpor.log("m").count("\n")
    torpor.wait_for(lambda: torpor.log("m").count("\n") > lines, what="a digest after the resume")
    digests = set(re.findall(r"^digest (\w+)$", torpor.log("m"), re.M))
    assert len(digests) == 1


def test_retention_keeps_the_last_n_and_pinned_ones_and_gc_frees_the_rest(torpor: Torpor, hot: Path) -> None:
    torpor.env["TORPOR_KEEP_LAST"] = "2"
    torpor.run("run", "--name", "k", *python_job("counter.py"))
    torpor.wait_log("k", "step 2")
    first = json.loads(torpor.run("checkpoint", "k", "--wait", "--json").stdout)["id"]
    assert f"pinned {first}" in torpor.run("pin", "k", first[:6]).stdout
    ids = [json.loads(torpor.run("checkpoint", "k", "--wait", "--json").stdout)["id"] for _ in range(3)]
    listed = {c["id"]: c for c in torpor.json("checkpoints", "k")}
    assert set(listed) == {first, ids[1], ids[2]} and listed[first]["pinned"]
    store = Repository(FolderBackend(torpor.home / "images"))
    before = store.stored_chunks()
    out = torpor.run("gc").stdout
    assert re.search(r"retention removed 0 checkpoint\(s\); [1-9]\d* unreferenced chunk\(s\) deleted", out)
    assert store.stored_chunks() < before
    torpor.run("stop", "k", "--timeout", "0.1")
    drop_hot_copies(hot)
    lines = torpor.log("k").count("\n")
    torpor.run("restore", "k", "--from", first)
    torpor.wait_for(lambda: torpor.log("k").count("\n") > lines + 2, what="the pinned checkpoint to run")


@pytest.mark.parametrize("damage", ["small file", "missing chunk", "empty id"])
def test_restore_force_refuses_a_damaged_or_empty_checkpoint_before_it_stops_the_job(
    torpor: Torpor, hot: Path, damage: str
) -> None:
    """--force stops the job: what can be checked (manifest, chunks present, small files) is, first."""
    torpor.run("run", "--name", "f", *python_job("counter.py"))
    torpor.wait_log("f", "step 3")
    bad = torpor.json("checkpoint", "f", "--wait")["id"]
    drop_hot_copies(hot)
    repo = Repository(FolderBackend(torpor.home / "images"))
    files = repo.manifest(bad).files
    if damage == "small file":
        small = next(f for f in files if not f.name.startswith("pages-") and f.extents and f.extents[0][2])
        flip_chunk_bit(repo, str(small.extents[0][2]))
    elif damage == "missing chunk":
        pages = next(f for f in files if f.name.startswith("pages-"))
        drop_chunk(repo, str(max(pages.extents, key=lambda e: e[1])[2]))
    pid = torpor.job("f")["pid"]
    result = torpor.run("restore", "f", "--from", "" if damage == "empty id" else bad, "--force", check=False)
    assert result.returncode == (2 if damage == "empty id" else 6), result.stderr
    assert ("empty checkpoint id" if damage == "empty id" else "is damaged") in result.stderr
    assert "Traceback" not in result.stderr
    job = torpor.job("f")
    assert job["state"] == "running" and job["pid"] == pid
    lines = torpor.log("f").count("\n")
    torpor.wait_for(lambda: torpor.log("f").count("\n") > lines + 2, what="the job to go on")
