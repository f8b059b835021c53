"""Which slot of its identity a starting pod takes (torpor.core.pod.Slot.take, deciding by
torpor.policy.pod.choose_slot), with real locks in a real folder: no cluster, no CRIU."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torpor.core.pod import Slot


def _held(folder: Path, n: int, **info: object) -> int:
    """Slot ``n`` held by another pod (a lock it keeps), which wrote ``info`` of itself."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"slot-{n}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (folder / f"slot-{n}.json").write_text(json.dumps(info))
    return fd


def _taken(folder: Path) -> int:
    with Slot.take(folder, True, lambda _text: None) as slot:
        return slot.n


def test_a_replacement_waits_for_the_slot_whose_pod_is_hibernating_its_job(tmp_path: Path) -> None:
    folder = tmp_path / "replicaset-api/main"
    fd = _held(folder, 0, pod="pod a on node1", stopping_at=1.0)
    said: list[str] = []
    got: list[int] = []

    def start() -> None:
        with Slot.take(folder, True, said.append) as slot:
            got.append(slot.n)

    thread = threading.Thread(target=start)
    thread.start()
    time.sleep(0.5)
    assert got == [] and said == ["waiting for pod a on node1 to hibernate its job, to continue it"]
    (folder / "slot-0.json").write_text(json.dumps({"pod": "pod a on node1", "hibernated": "c1"}))
    os.close(fd)  # hibernated: the pod exits
    thread.join(10)
    assert got == [0]  # its job, not a new slot started cold beside it


def test_a_pod_takes_a_slot_with_a_job_to_continue_then_a_free_one_then_a_new_one(tmp_path: Path) -> None:
    folder = tmp_path / "replicaset-api/main"
    running = _held(folder, 0, pod="pod a")  # running, not stopping: not waited for
    assert _taken(folder) == 1  # a new slot
    (folder / "slot-1.json").write_text(json.dumps({"pod": "pod b", "ended": 0}))
    (folder / "slot-2.lock").touch()
    (folder / "slot-2.json").write_text(json.dumps({"pod": "pod c", "hibernated": "c9"}))
    assert _taken(folder) == 2  # the free slot with a hibernated job, before the empty free one
    (folder / "slot-2.json").write_text(json.dumps({"pod": "pod c", "ended": 0}))
    assert _taken(folder) == 1  # the first free one
    os.close(running)
    assert _taken(folder) == 0  # what pod a left (it went away without ending its job) is continued


def test_a_pod_that_is_not_interchangeable_waits_for_slot_zero(tmp_path: Path) -> None:
    folder = tmp_path / "web-0"
    fd = _held(folder, 0, pod="pod a")
    said: list[str] = []
    thread = threading.Thread(target=lambda: Slot.take(folder, False, said.append).__enter__())
    thread.daemon = True
    thread.start()
    time.sleep(0.3)
    assert said == ["waiting for pod a to let go of this identity"]
    os.close(fd)
    thread.join(10)
    assert not thread.is_alive()


def test_a_replacement_waits_for_the_slot_whose_pod_is_being_deleted_before_it_is_told_to_stop(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "replicaset-api/main"
    fd = _held(folder, 0, pod="pod a on node1", name="api-a", uid="uid-a")  # no stopping_at yet
    asked: list[dict[str, Any]] = []
    got: list[int] = []

    def deleting(holder: dict[str, Any]) -> bool:
        asked.append(holder)
        return holder.get("uid") == "uid-a"

    thread = threading.Thread(target=lambda: got.append(_take(folder, deleting)))
    thread.start()
    time.sleep(0.5)
    assert got == [] and asked[0]["name"] == "api-a"
    os.close(fd)  # hibernated: the pod exits
    thread.join(10)
    assert got == [0]
    # a holder that is not being deleted is not waited for: a new slot
    fd = _held(folder, 0, pod="pod b on node2", name="api-b", uid="uid-b")
    assert _take(folder, deleting) == 1
    os.close(fd)


def _take(folder: Path, deleting: Callable[[dict[str, Any]], bool]) -> int:
    with Slot.take(folder, True, lambda _text: None, deleting) as slot:
        return slot.n
