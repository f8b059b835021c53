"""A job's own IPC namespace: its SysV shared memory, semaphores and message queues survive checkpoint,
hibernate and resume (CRIU dumps them only with their namespace), a restore gets a fresh namespace, and
the job cannot see the host's SysV objects — nor leave its own behind.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import uuid

import pytest

from conftest import Torpor, python_job

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]

libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT, IPC_EXCL, IPC_RMID = 0o1000, 0o2000, 0


def ipc_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/ipc")


def steps(log: str) -> list[tuple[int, int, int, str]]:
    found = re.findall(r"^step (\d+) shm=(\d+) sem=(\d+) digest=(\w+)$", log, re.M)
    return [(int(n), int(shm), int(sem), digest) for n, shm, sem, digest in found]


def test_sysv_shared_memory_semaphores_and_queues_survive_checkpoint_hibernate_resume(torpor: Torpor) -> None:
    torpor.run("run", "--name", "ipc", *python_job("sysv_shm.py", "30"))
    torpor.wait_log("ipc", "step 2")
    first_pid = torpor.job("ipc")["pid"]
    assert ipc_namespace(first_pid) != ipc_namespace(os.getpid())
    inside = subprocess.run(
        ["nsenter", "-t", str(first_pid), "-i", "cat", "/proc/sysvipc/shm"], capture_output=True, text=True
    )
    assert " 4194304 " in inside.stdout, inside  # the job's segment, in the job's namespace

    torpor.run("checkpoint", "ipc")  # the job keeps running, its objects untouched
    torpor.wait_for(lambda: steps(torpor.log("ipc"))[-1][0] >= 8, what="steps after the checkpoint")
    torpor.run("hibernate", "ipc")
    at_hibernate = steps(torpor.log("ipc"))[-1][0]
    torpor.run("resume", "ipc")
    resumed_pid = torpor.job("ipc")["pid"]
    assert ipc_namespace(resumed_pid) != ipc_namespace(os.getpid())  # CRIU made the job a new one

    job = torpor.wait_state("ipc", "exited", "failed")
    log = torpor.log("ipc")
    assert job["exit_code"] == 0, log
    seen = steps(log)
    # every step once, in order, and the segment, the semaphore and the counter agree on each
    assert [n for n, *_ in seen] == list(range(1, 31)), log
    assert all(shm == n and sem == n for n, shm, sem, _ in seen), log
    assert len({digest for *_, digest in seen}) == 1, "the segment's contents changed"
    assert at_hibernate < 30
    assert log.rstrip().endswith("message queued before")  # the message queue came back with its message


def test_a_job_does_not_see_the_hosts_sysv_objects(torpor: Torpor) -> None:
    key = int.from_bytes(uuid.uuid4().bytes[:4], "little") & 0x7FFFFFFF or 1
    shm = libc.shmget(key, 4096, IPC_CREAT | IPC_EXCL | 0o600)
    assert shm >= 0, os.strerror(ctypes.get_errno())
    try:
        torpor.run("run", "--name", "look", "--", "ipcs", "-m")
        log = torpor.wait_log("look", "Shared Memory Segments")
        torpor.wait_state("look", "exited")
        host = subprocess.run(["ipcs", "-m"], capture_output=True, text=True, check=True).stdout
        assert f"0x{key:08x}" in host
        assert f"0x{key:08x}" not in log
    finally:
        libc.shmctl(shm, IPC_RMID, None)
