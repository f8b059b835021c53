"""The in-pod supervisor (``torpor pod``) on this machine, with real CRIU: pods are played by processes
that share a store folder, as pods on two nodes share the store volume; with an S3 cold tier, against a
real S3-compatible server on loopback (moto). Kubernetes itself is in test_cluster.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import JOBS, S3_ENV, TORPOR
from torpor.core.store import config as store_config

pytestmark = [pytest.mark.criu, pytest.mark.slow]


class Pod:
    """One `torpor pod` process, its stdout (the job's output) and stderr (the supervisor's lines)."""

    def __init__(
        self, store: Path, env: dict[str, str], name: str, *command: str, extra: tuple[str, ...] = ()
    ) -> None:
        self.out = store.parent / f"{name}.out"
        self.err = store.parent / f"{name}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(
                [TORPOR, "pod", "--store", str(store), *extra, "--", *command],
                stdout=out,
                stderr=err,
                env={**env, "TORPOR_POD_NAME": name, "TORPOR_NODE_NAME": f"node-of-{name}"},
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text()

    def said(self) -> str:
        return self.err.read_text()

    def wait_output(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := re.search(pattern, self.output(), re.M):
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in the output: {self.output()[-500:]}\nsaid: {self.said()}")

    def stop(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^step (\d+)$", text, re.M)]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    hot = Path("/dev/shm") / f"torpor-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "TORPOR_HOT_DIR": str(hot),
        "PYTHONUNBUFFERED": "1",
        "TORPOR_IDENTITY": "team-a/web-0",
    }
    env.pop("TORPOR_HOME", None)
    yield tmp_path / "store", env
    for home in (tmp_path / "store").glob("**/slot-*/"):  # what a failed test left running
        jobs = subprocess.run(
            [TORPOR, "--home", str(home), "ps", "--json"], capture_output=True, text=True, env=env
        )
        for job in json.loads(jobs.stdout or "[]"):
            subprocess.run(
                [TORPOR, "--home", str(home), "rm", "--force", job["name"]], capture_output=True, env=env
            )
    shutil.rmtree(hot, ignore_errors=True)


def test_a_pod_stopped_hibernates_its_job_and_the_next_pod_of_its_identity_resumes_it(
    store: tuple[Path, dict[str, str]],
) -> None:
    folder, env = store
    first = Pod(folder, env, "a", "python3", "-u", str(JOBS / "counter.py"))
    first.wait_output(r"^step 5$")
    assert first.stop() == 0
    last = steps(first.output())[-1]
    assert "hibernated by torpor: checkpoint" in first.said()
    slot = json.loads((folder / "web-0/slot-0.json").read_text())
    assert slot["hibernated"] and slot["node"] == "node-of-a"

    second = Pod(folder, env, "b", "python3", "-u", str(JOBS / "counter.py"))
    second.wait_output(rf"^step {last + 3}$")
    assert steps(second.output())[0] == last + 1  # where it was: not from 0, nothing repeated
    assert re.search(r"resumed its hibernated job: restored from \w+ taken on node-of-a", second.said())
    # a third pod of the same identity waits while the second holds it: never two copies running
    third = Pod(folder, env, "c", "python3", "-u", str(JOBS / "counter.py"))
    deadline = time.monotonic() + 30
    while "waiting for" not in third.said() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "waiting for pod b on node-of-b" in third.said() and third.output() == ""
    assert second.stop() == 0
    after = steps(second.output())[-1]
    third.wait_output(rf"^step {after + 2}$")  # it took over once the second let go
    assert third.stop() == 0


def test_the_files_a_job_writes_in_its_pod_follow_it_to_the_next_pod_on_another_node(
    store: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The next pod's node has nothing of the first pod's own file system: without its file, the job
    could not be restored there (CRIU finds it missing) and would start over."""
    folder, env = store
    scratch = tmp_path / "container" / "work" / "scratch.txt"  # on the root file system: the pod's own
    scratch.parent.mkdir(parents=True)
    job = ("python3", "-u", str(JOBS / "scratch_writer.py"), str(scratch))
    first = Pod(folder, env, "a", *job)
    first.wait_output(r"^step 5$")
    assert first.stop() == 0
    assert "kept 1 file(s) the job writes in this pod" in first.said()
    written = scratch.read_text()
    shutil.rmtree(tmp_path / "container")  # the other node: none of it there

    second = Pod(folder, env, "b", *job)
    last = int(written.split()[-1])
    second.wait_output(rf"^step {last + 3}$")
    assert "put back 1 file(s) the job writes" in second.said()
    assert re.search(r"resumed its hibernated job: restored from \w+", second.said())
    assert second.stop() == 0
    numbers = [int(n) for n in scratch.read_text().split()]
    assert numbers == list(range(len(numbers))) and len(numbers) > last + 3  # no gap, nothing twice
    assert oct(scratch.stat().st_mode & 0o777) == oct(0o644 & ~os.umask(os.umask(0)))


def test_a_namespace_made_again_under_the_same_name_does_not_get_the_old_one_s_job(
    store: tuple[Path, dict[str, str]],
) -> None:
    """A namespace deleted (before the operator removed its checkpoints) and made again, maybe by
    someone else: its pods' store folder is the same, its UID is not."""
    folder, env = store
    first = Pod(
        folder, {**env, "TORPOR_POD_NAMESPACE_UID": "uid-old"}, "a", "python3", "-u", str(JOBS / "counter.py")
    )
    first.wait_output(r"^step 5$")
    assert first.stop() == 0
    second = Pod(
        folder, {**env, "TORPOR_POD_NAMESPACE_UID": "uid-new"}, "b", "python3", "-u", str(JOBS / "counter.py")
    )
    second.wait_output(r"^step 2$")
    assert steps(second.output())[0] == 0  # cold: not the old namespace's job
    assert "its checkpoints are of an earlier namespace of this name" in second.said()
    assert second.stop() == 0
    slot = json.loads((folder / "web-0/slot-0.json").read_text())
    assert slot["namespace_uid"] == "uid-new"
    # a pod that could not learn its namespace's UID continues the slot's job, and keeps its UID
    third = Pod(folder, env, "c", "python3", "-u", str(JOBS / "counter.py"))
    third.wait_output(r"resumed|step [3-9]", timeout=60)
    assert third.stop() == 0
    assert json.loads((folder / "web-0/slot-0.json").read_text())["namespace_uid"] == "uid-new"
    assert "resumed its hibernated job" in third.said()


def test_a_job_that_exits_ends_its_identity_with_its_exit_code(store: tuple[Path, dict[str, str]]) -> None:
    folder, env = store
    first = Pod(folder, env, "a", "python3", "-u", str(JOBS / "counter.py"), "3")
    assert first.process.wait(60) == 3
    assert steps(first.output()) == [0, 1, 2, 3, 4]
    assert "the job ended by itself (exit code 3" in first.said()
    second = Pod(folder, env, "b", "python3", "-u", str(JOBS / "counter.py"))
    second.wait_output(r"^step 2$")
    assert steps(second.output())[0] == 0  # started over: nothing of the ended job is restored
    assert second.stop() == 0


def test_a_pod_that_vanished_is_continued_from_its_last_periodic_checkpoint(
    store: tuple[Path, dict[str, str]],
) -> None:
    folder, env = store
    first = Pod(
        folder, env, "a", "python3", "-u", str(JOBS / "counter.py"), extra=("--checkpoint-every", "1s")
    )
    deadline = time.monotonic() + 60
    while "periodic checkpoint" not in first.said() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "periodic checkpoint" in first.said(), first.said()
    # the pod is gone at once, its job with it (its node died): no hibernation
    home = folder / "web-0/slot-0"
    job = json.loads(
        subprocess.run(
            [TORPOR, "--home", str(home), "ps", "--json"], capture_output=True, text=True, env=env
        ).stdout
    )[0]
    os.killpg(first.process.pid, signal.SIGKILL)
    os.kill(job["pid"], signal.SIGKILL)
    first.process.wait(10)
    seen = steps(first.output())

    second = Pod(folder, env, "b", "python3", "-u", str(JOBS / "counter.py"))
    found = second.wait_output(r"^step (\d+)$")
    assert 0 < int(found.group(1)) <= seen[-1] + 1  # from the checkpoint: some steps again, not from 0
    assert re.search(r"recovered: restored from \w+ taken on node-of-a", second.said())
    assert second.stop() == 0


def test_a_job_that_cannot_be_hibernated_is_stopped_the_plain_way_saying_why(
    store: tuple[Path, dict[str, str]],
) -> None:
    folder, env = store
    first = Pod(folder, env, "a", "python3", "-u", str(JOBS / "io_uring_job.py"), "fd")
    first.wait_output(r"^tick 3$")
    assert first.stop(timeout=30) == 143
    assert "cannot hibernate the job, stopping it instead" in first.said() and "io_uring" in first.said()
    # nothing to continue: the next pod starts the command again
    second = Pod(folder, env, "b", "python3", "-u", str(JOBS / "io_uring_job.py"), "fd")
    second.wait_output(r"^tick 1$")
    assert second.output().startswith("ready")
    assert second.stop(timeout=30) == 143


def test_a_pod_with_another_image_starts_cold_saying_why(store: tuple[Path, dict[str, str]]) -> None:
    folder, env = store
    old = {**env, "TORPOR_POD_NEEDS": json.dumps({"image": "counter:1", "volumes": []})}
    first = Pod(folder, old, "a", "python3", "-u", str(JOBS / "counter.py"))
    first.wait_output(r"^step 3$")
    assert first.stop() == 0
    new = {**env, "TORPOR_POD_NEEDS": json.dumps({"image": "counter:2", "volumes": []})}
    second = Pod(folder, new, "b", "python3", "-u", str(JOBS / "counter.py"))
    second.wait_output(r"^step 1$")
    assert steps(second.output())[0] == 0
    assert (
        "not restoring the job of pod a on node-of-a: its image differs (counter:1 then, counter:2 now)"
        in (second.said())
    )
    assert second.stop() == 0


@pytest.mark.s3
def test_with_an_s3_cold_tier_each_slot_s_images_are_in_its_own_prefix_and_the_next_pod_resumes_from_there(
    store: tuple[Path, dict[str, str]], s3_endpoint: str
) -> None:
    import boto3

    folder, env = store
    bucket = f"torpor-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=bucket)
    # torpor's credentials under its own names (the webhook's, from the namespace's Secret), and the
    # job's own AWS_* which must stay its own
    pods = {
        **{key: value for key, value in env.items() if key not in S3_ENV},
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ACCESS_KEY_ID": "the-job-s-own",
        "TORPOR_S3_ACCESS_KEY_ID": S3_ENV["AWS_ACCESS_KEY_ID"],
        "TORPOR_S3_SECRET_ACCESS_KEY": S3_ENV["AWS_SECRET_ACCESS_KEY"],
        "TORPOR_POD_S3": f"s3://{bucket}/torpor",
        "TORPOR_S3_ENDPOINT": s3_endpoint,
    }
    show = 'echo "job sees ${AWS_ACCESS_KEY_ID:-no key} ${TORPOR_S3_ACCESS_KEY_ID:-nothing of torpor}"'
    command = ("sh", "-c", f"{show}; exec python3 -u {JOBS / 'counter.py'}")
    first = Pod(folder, pods, "a", *command)
    first.wait_output(r"^step 5$")
    assert "job sees the-job-s-own nothing of torpor" in first.output()
    assert first.stop() == 0, first.said()
    last = steps(first.output())[-1]
    (checkpoint,) = re.findall(r"hibernated by torpor: checkpoint (\w+)", first.said())

    prefix = "torpor/team-a/web-0/slot-0/"
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    names = {item["Key"].removeprefix(prefix).split("/")[0] for item in listed}
    assert f"{prefix}manifests/{checkpoint}" in {item["Key"] for item in listed}
    assert names & {"packs", "chunks"}, names  # the memory pages are there too
    assert all(item["Key"].startswith(prefix) for item in s3.list_objects_v2(Bucket=bucket)["Contents"])
    slot = folder / "web-0/slot-0"
    # not in the store volume: the slot keeps its records only
    assert not (slot / "images").exists() and not list(slot.rglob("pages-*.img"))
    assert json.loads((slot / "store.json").read_text())["url"] == f"s3://{bucket}/{prefix.rstrip('/')}"

    # the next pod, on "another node": a hot tier of its own, and nothing left in the first one's
    shutil.rmtree(Path(env["TORPOR_HOT_DIR"]), ignore_errors=True)
    other_hot = Path("/dev/shm") / f"torpor-test-{uuid.uuid4().hex[:8]}"
    try:
        second = Pod(folder, {**pods, "TORPOR_HOT_DIR": str(other_hot)}, "b", *command)
        second.wait_output(rf"^step {last + 3}$")
        assert steps(second.output())[0] == last + 1, second.said()
        assert f"resumed its hibernated job: restored from {checkpoint}" in second.said()
        assert second.stop() == 0, second.said()
    finally:
        shutil.rmtree(other_hot, ignore_errors=True)

    # the webhook's s3_url changed: the slot's checkpoints are not left behind silently
    moved = Pod(folder, {**pods, "TORPOR_POD_S3": f"s3://{bucket}/elsewhere"}, "c", *command)
    assert moved.process.wait(60) != 0
    said = moved.said()
    assert f"were stored with s3://{bucket}/torpor/team-a/web-0/slot-0" in said, said
    assert f"TORPOR_STORE=s3://{bucket}/elsewhere/team-a/web-0/slot-0" in said and moved.output() == ""


@pytest.mark.s3
def test_a_slot_without_checkpoints_takes_the_new_s3_cold_tier(
    store: tuple[Path, dict[str, str]], s3_endpoint: str
) -> None:
    folder, env = store
    slot = folder / "web-0/slot-0"
    slot.mkdir(parents=True, mode=0o700)
    # the webhook's s3_url changed after a pod of this identity ended its job: nothing to lose
    store_config.save(slot, store_config.StoreConfig(url="s3://old-bucket/torpor/team-a/web-0/slot-0"))
    bucket = f"torpor-{uuid.uuid4().hex[:8]}"
    pods = {**env, "TORPOR_POD_S3": f"s3://{bucket}", "TORPOR_S3_ENDPOINT": s3_endpoint}
    pod = Pod(folder, pods, "a", "python3", "-u", str(JOBS / "counter.py"), "0")
    assert pod.process.wait(60) == 0, pod.said()
    assert store_config.load(slot) == store_config.StoreConfig(
        url=f"s3://{bucket}/team-a/web-0/slot-0", s3_endpoint=s3_endpoint
    )
