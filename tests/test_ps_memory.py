"""`torpor ps` counts memory the job's processes share once (the sum of their PSS), not once per process.

A job maps a shared anonymous region and touches private memory before forking children (copy-on-write):
its processes' RSS add up to several times what it allocated, its memory column to about that once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import Torpor, python_job
from torpor.adapters.system import procfs

pytestmark = [pytest.mark.root("to run a job in its own PID namespace"), pytest.mark.timeout(60)]

SHARED_MIB, PRIVATE_MIB, CHILDREN = 200, 100, 4
#: what each of the job's Python processes may add of its own (interpreter, heap), beyond the regions
PER_PROCESS_MIB = 20


def test_ps_counts_shared_memory_once(torpor: Torpor) -> None:
    args = (str(SHARED_MIB), str(PRIVATE_MIB), str(CHILDREN))
    torpor.run("run", "--name", "shared", *python_job("shared_memory.py", *args))
    torpor.wait_log("shared", "ready")
    job = torpor.job("shared")
    pids = procfs.namespace_members(job["pid"])
    assert len(pids) == CHILDREN + 1
    allocated = (SHARED_MIB + PRIVATE_MIB) << 20
    upper = allocated + len(pids) * (PER_PROCESS_MIB << 20)
    # each child maps the private pages it inherited: the RSS of all of them counts those CHILDREN+1 times
    page = os.sysconf("SC_PAGE_SIZE")
    rss_sum = sum(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page for pid in pids)
    assert rss_sum > upper, "the job does not share memory as this test needs"
    assert allocated * 0.98 <= job["rss_bytes"] <= upper, (job["rss_bytes"] >> 20, rss_sum >> 20)
    shown = torpor.run("ps").stdout
    assert "MEMORY" in shown.splitlines()[0]
