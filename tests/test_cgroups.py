"""adapters.cgroups: each job's memory cgroup, whose limit stalls a job instead of killing it, and the
node's readings.

Real cgroups where the machine has a memory controller (here cgroup v1; the tests skip, saying why,
where there is none): creating, limiting, reading and removing a job's cgroup; a real process that
allocates in steps past its limit stalls, is not killed, and goes on once the limit is raised (and,
for contrast, one in a cgroup that may kill is killed and counted); a stalled process made dumpable
without growing. With CRIU: a torpor job started in a job's cgroup is counted there, and is restored
after hibernation into the cgroup with the limit set before the restore, a stalled one included.
cgroup v2's memory controller cannot run on this machine (v1 holds it), so v2's discovery and file
formats (memory.high, memory.current, memory.events, memory.pressure) are tested on a folder of files
laid out as the kernel's.

Each test makes its cgroups in a folder of its own under the test process's memory cgroup and removes
them, killing whatever is left in them first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from conftest import JOBS, Torpor
from torpor.adapters import cgroups
from torpor.adapters.cgroups import JobCgroup, MemoryController, NoMemoryController
from torpor.adapters.system import ownprocess, procfs
from torpor.errors import EnvironmentProblem, UsageError

MiB = 1 << 20
FOUND = cgroups.detect_memory_controller()
TestFunction = TypeVar("TestFunction", bound=Callable[..., None])


def needs_controller(test: TestFunction) -> TestFunction:
    """Runs as root, on a machine with a memory controller for our cgroup (else skipped, saying why)."""
    no_controller = getattr(FOUND, "reason", "")
    marked = pytest.mark.skipif(bool(no_controller), reason=f"no memory cgroup here: {no_controller}")(test)
    return pytest.mark.root("to make memory cgroups")(marked)


pytestmark = [pytest.mark.timeout(120)]

#: allocates STEP MiB at a time (touched, incompressible) up to TOTAL MiB, saying how far it got, then
#: "done"; then waits to be stopped
STEPPER = """
import os, sys, time
step, total = int(sys.argv[1]), int(sys.argv[2])
held = []
while len(held) * step < total:
    held.append(bytearray(os.urandom(1 << 20)) * step)
    print(f"held {len(held) * step}", flush=True)
    time.sleep(0.02)
print("done", sum(block[-1] for block in held) >= 0, flush=True)
time.sleep(600)
"""


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def controller() -> Iterator[MemoryController]:
    """The machine's controller, rooted in a test folder of our own cgroup (torpor-jobs goes there)."""
    assert isinstance(FOUND, MemoryController)
    own = FOUND.own / f"torpor-test-{uuid.uuid4().hex[:8]}"
    os.mkdir(own, 0o700)
    mine = MemoryController(FOUND.version, own)
    yield mine
    for name in mine.job_names():
        job = mine.job(name)
        for _ in range(100):  # bounded: a killed process leaves its cgroup within a few ms
            for pid in job.pids():
                os.kill(pid, signal.SIGKILL)
            if not job.pids():
                break
            time.sleep(0.05)
        job.remove()
    os.rmdir(mine.jobs) if mine.jobs.exists() else None
    os.rmdir(own)


@contextmanager
def running_in(job: JobCgroup, args: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A process that joins ``job``'s cgroup before it execs ``args`` (all it allocates is charged
    there); killed when the test is done with it."""
    with subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: ownprocess.join_cgroup(job.path),
    ) as process:
        try:
            yield process
        finally:
            process.kill()
            process.wait(10)


def stepper(step_mib: int, total_mib: int) -> list[str]:
    return [sys.executable, "-c", STEPPER, str(step_mib), str(total_mib)]


def read_until(process: subprocess.Popen[str], text: str) -> list[str]:
    """Lines of ``process`` up to the one that starts with ``text`` (bounded by the test's timeout)."""
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line.strip())
        if line.startswith(text):
            return lines
    raise AssertionError(f"{text!r} never came: {lines[-5:]}")


# -- finding the controller -------------------------------------------------------------------------


@needs_controller
def test_finds_the_memory_cgroup_of_this_process() -> None:
    assert isinstance(FOUND, MemoryController)
    line = next(
        line
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if (FOUND.version == 1 and "memory" in line.split(":")[1].split(","))
        or (FOUND.version == 2 and line.startswith("0::"))
    )
    assert str(FOUND.own).endswith(line.split(":", 2)[2].rstrip("/"))
    assert (FOUND.own / ("memory.limit_in_bytes" if FOUND.version == 1 else "memory.current")).exists()
    assert cgroups.find_memory_controller() == FOUND


def fake_machine(tmp_path: Path, mountinfo: str, cgroup: str) -> tuple[Path, Path]:
    (tmp_path / "mountinfo").write_text(mountinfo)
    (tmp_path / "cgroup").write_text(cgroup)
    return tmp_path / "mountinfo", tmp_path / "cgroup"


def test_v1_mount_with_the_memory_option_wins_and_paths_are_unescaped(tmp_path: Path) -> None:
    mount = tmp_path / "cg roups"
    escaped = str(mount).replace(" ", "\\040")
    files = fake_machine(
        tmp_path,
        f"35 31 0:32 / {escaped}/memory rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {escaped}/unified rw,relatime - cgroup2 cgroup2 rw\n",
        "4:memory:/a/b\n1:cpu,cpuacct:/\n0::/\n",
    )
    assert cgroups.detect_memory_controller(*files) == MemoryController(1, mount / "memory/a/b")


def test_a_mount_of_part_of_the_hierarchy_is_followed_from_its_root(tmp_path: Path) -> None:
    # in a container the mount's root field is the container's cgroup, /proc/self/cgroup the full path
    files = fake_machine(
        tmp_path,
        f"35 31 0:32 /kube/pod1 {tmp_path}/m rw - cgroup cgroup rw,memory\n",
        "4:memory:/kube/pod1/box\n",
    )
    assert cgroups.detect_memory_controller(*files) == MemoryController(1, tmp_path / "m/box")
    outside = fake_machine(
        tmp_path, f"35 31 0:32 /kube/pod1 {tmp_path}/m rw - cgroup cgroup rw,memory\n", "4:memory:/other\n"
    )
    found = cgroups.detect_memory_controller(*outside)
    assert isinstance(found, NoMemoryController) and "outside the mount" in found.reason


def test_v2_needs_memory_in_our_cgroup_controllers(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    (root / "user.slice/agent").mkdir(parents=True)
    (root / "user.slice/agent/cgroup.controllers").write_text("cpu io pids\n")
    files = fake_machine(
        tmp_path, f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n", "0::/user.slice/agent\n"
    )
    found = cgroups.detect_memory_controller(*files)
    assert isinstance(found, NoMemoryController)
    assert "no memory controller" in found.reason and "cpu io pids" in found.reason
    assert cgroups.find_memory_controller(*files) is None
    (root / "user.slice/agent/cgroup.controllers").write_text("cpu io memory pids\n")
    assert cgroups.detect_memory_controller(*files) == MemoryController(2, root / "user.slice/agent")


def test_no_cgroup_mount_at_all_says_so(tmp_path: Path) -> None:
    files = fake_machine(tmp_path, "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n", "0::/\n")
    found = cgroups.detect_memory_controller(*files)
    assert isinstance(found, NoMemoryController) and "no cgroup2 mount" in found.reason
    missing = cgroups.detect_memory_controller(tmp_path / "nothing", tmp_path / "cgroup")
    assert isinstance(missing, NoMemoryController) and "cannot read" in missing.reason


# -- v2's files, on a folder laid out as the kernel's ------------------------------------------------


def kernel_files(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_v2_limit_is_memory_high_and_its_files_read_right(tmp_path: Path) -> None:
    own = tmp_path / "agent"
    kernel_files(own, {"cgroup.controllers": "cpu memory\n", "cgroup.subtree_control": ""})
    controller = MemoryController(2, own)
    (own / cgroups.JOBS_FOLDER).mkdir()  # cgroupfs makes the folder's files: lay them out first
    kernel_files(controller.jobs, {"cgroup.subtree_control": "", "cgroup.controllers": "memory\n"})
    controller.prepare()
    assert (own / "cgroup.subtree_control").read_text() == "+memory"
    assert (controller.jobs / "cgroup.subtree_control").read_text() == "+memory"
    job = controller.job("train-1")
    kernel_files(
        job.path,
        {
            "memory.high": "max\n",
            "memory.max": "max\n",
            "memory.current": "73400320\n",
            "memory.events": "low 0\nhigh 1432\nmax 0\noom 0\noom_kill 2\noom_group_kill 0\n",
            "memory.pressure": "some avg10=12.50 avg60=3.10 avg300=0.70 total=81234\n"
            "full avg10=4.25 avg60=1.00 avg300=0.20 total=40000\n",
            "cgroup.procs": "12\n7\n",
        },
    )
    assert job.limit() is None
    job.create(256 * MiB)
    assert (job.path / "memory.high").read_text() == str(256 * MiB)
    assert (job.path / "memory.max").read_text() == "max\n", "memory.max would kill: it stays max"
    assert job.limit() == 256 * MiB
    assert job.usage() == 73400320
    assert job.pressure() == 4.25
    assert job.oom_kills() == 2
    assert not job.stalled(), "v2 throttles at memory.high, it never stalls there"
    assert job.pids() == [7, 12]
    assert job.make_room(300 * MiB) == 73400320 + 300 * MiB
    job.set_limit(None)
    assert (job.path / "memory.high").read_text() == "max"
    (job.path / "memory.events").write_text("low 0\noom_kill x\n")
    with pytest.raises(EnvironmentProblem, match=r"memory\.events does not read"):
        job.oom_kills()


def test_v2_with_subtree_control_enabled_already_writes_nothing(tmp_path: Path) -> None:
    own = tmp_path / "agent"
    kernel_files(own, {"cgroup.controllers": "memory\n", "cgroup.subtree_control": "cpu memory\n"})
    (own / cgroups.JOBS_FOLDER).mkdir()
    kernel_files(own / cgroups.JOBS_FOLDER, {"cgroup.subtree_control": "memory\n"})
    MemoryController(2, own).prepare()
    assert (own / "cgroup.subtree_control").read_text() == "cpu memory\n"


# -- the node -------------------------------------------------------------------------------------


def test_node_readings_from_this_machine() -> None:
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) << 10
    assert 0 < cgroups.mem_available() <= total
    if not Path("/proc/pressure/memory").exists():
        pytest.skip("this kernel has no PSI")
    pressure = cgroups.memory_pressure()
    assert pressure is not None
    assert 0 <= pressure.full_avg10 <= pressure.some_avg10 <= 100


def test_node_readings_from_files(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree: 22641560 kB\nMemAvailable:   24100776 kB\n")
    assert cgroups.mem_available(meminfo) == 24100776 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(EnvironmentProblem, match="no MemAvailable"):
        cgroups.mem_available(meminfo)
    psi = tmp_path / "memory"
    psi.write_text(
        "some avg10=7.31 avg60=2.00 avg300=0.50 total=1984521\nfull avg10=3.02 avg60=1 avg300=0 total=1047659\n"
    )
    assert cgroups.memory_pressure(psi) == (7.31, 3.02)
    assert cgroups.memory_pressure(tmp_path / "absent") is None
    psi.write_text("nonsense\n")
    with pytest.raises(EnvironmentProblem, match="does not read as PSI"):
        cgroups.memory_pressure(psi)


# -- real cgroups -----------------------------------------------------------------------------------


@needs_controller
def test_create_limit_usage_remove(controller: MemoryController) -> None:
    controller.prepare()
    controller.prepare()  # again: nothing changes, nothing fails
    assert controller.jobs.is_dir() and (controller.jobs.stat().st_mode & 0o777) == 0o700
    job = controller.job("create-1")
    assert not job.exists() and job.pids() == []
    job.create(64 * MiB)
    assert job.exists() and (job.path.stat().st_mode & 0o777) == 0o700
    assert controller.job_names() == ["create-1"]
    assert job.limit() == 64 * MiB
    assert 0 <= job.usage() < MiB
    assert job.oom_kills() == 0 and not job.stalled() and job.pressure() is None
    if controller.version == 1:
        assert "oom_kill_disable 1" in (job.path / "memory.oom_control").read_text()
    job.set_limit(100 * MiB + 123)  # the kernel keeps whole pages
    assert job.limit() == (100 * MiB + 123) // os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PAGE_SIZE")
    job.set_limit(None)
    assert job.limit() is None
    for bad in (0, -5):
        with pytest.raises(UsageError, match="more than 0 bytes"):
            job.set_limit(bad)
    job.create(32 * MiB)  # an existing folder just gets the limit
    assert job.limit() == 32 * MiB
    job.remove()
    assert not job.exists()
    job.remove()  # a missing one is fine
    with pytest.raises(EnvironmentProblem, match="is gone"):
        job.usage()


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".hidden", "-x", "x" * 129])
def test_a_name_that_is_not_one_folder_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match="cannot name a cgroup"):
        MemoryController(1, tmp_path).job(name)


@needs_controller
def test_create_before_prepare_says_what_to_do(controller: MemoryController) -> None:
    with pytest.raises(EnvironmentProblem, match=r"call prepare\(\) first"):
        controller.job("early").create(64 * MiB)


@needs_controller
def test_a_cgroup_with_a_process_is_not_removed(controller: MemoryController) -> None:
    controller.prepare()
    job = controller.job("busy")
    job.create(64 * MiB)
    with running_in(
        job, [sys.executable, "-c", "import time; print('in', flush=True); time.sleep(60)"]
    ) as process:
        read_until(process, "in")
        assert job.pids() == [process.pid]
        with pytest.raises(EnvironmentProblem, match=rf"still holds processes \[{process.pid}\]"):
            job.remove()
    wait_until(lambda: not job.pids(), "the killed process to leave its cgroup")
    job.remove()
    assert not job.exists()


@needs_controller
def test_a_job_past_its_limit_stalls_and_goes_on_when_it_is_raised(controller: MemoryController) -> None:
    if controller.version == 2:
        pytest.skip("v2 throttles at memory.high instead of stalling")
    controller.prepare()
    job = controller.job("stall")
    job.create(64 * MiB)
    with running_in(job, stepper(8, 160)) as process:
        wait_until(job.stalled, "the job to stall at its limit")
        assert process.poll() is None, "a job at its limit must not be killed"
        assert procfs.process_state(process.pid) == "D"
        assert 60 * MiB <= job.usage() <= 64 * MiB
        assert job.oom_kills() == 0
        job.set_limit(256 * MiB)
        lines = read_until(process, "done")
        assert lines[-1] == "done True" and "held 160" in lines
        assert not job.stalled() and job.oom_kills() == 0
        assert job.usage() >= 160 * MiB
        if len(Path("/proc/swaps").read_text().splitlines()) == 1:  # no swap to push its pages into:
            # a limit below what it holds is refused, and the old one stays
            with pytest.raises(EnvironmentProblem, match=r"the kernel refused .* Device or resource busy"):
                job.set_limit(64 * MiB)
            assert job.limit() == 256 * MiB


@needs_controller
def test_without_oom_kill_disable_the_kernel_kills_and_it_is_counted(controller: MemoryController) -> None:
    """What torpor's limits prevent: the same job in a cgroup that may kill is killed at its limit."""
    if controller.version == 2:
        pytest.skip("v2: memory.max kills; torpor never sets it")
    controller.prepare()
    job = controller.job("killable")
    job.create(64 * MiB)
    (job.path / "memory.oom_control").write_text("0")
    with running_in(job, stepper(8, 160)) as process:
        assert process.wait(60) == -signal.SIGKILL
        assert job.oom_kills() == 1


@needs_controller
def test_a_stalled_job_is_stopped_without_growing(controller: MemoryController) -> None:
    if controller.version == 2:
        pytest.skip("v2 does not stall")
    controller.prepare()
    job = controller.job("unstall")
    job.create(64 * MiB)
    with running_in(job, stepper(8, 160)) as process:
        wait_until(job.stalled, "the job to stall at its limit")
        stalled_at = job.usage()
        assert job.unstall_for_dump()
        assert procfs.process_state(process.pid) == "T"
        assert not job.stalled()
        limit = job.limit()
        assert limit is not None and stalled_at < limit <= stalled_at + cgroups.DUMP_MARGIN
        time.sleep(0.3)  # a stopped job would not allocate: a running one would have, by now
        assert job.usage() <= stalled_at + MiB
        job.set_limit(256 * MiB)
        assert job.continue_processes() == [process.pid]
        assert read_until(process, "done")[-1] == "done True"
        assert job.oom_kills() == 0


# -- with CRIU: torpor jobs in a job cgroup ---------------------------------------------------------


def engine_run(torpor: Torpor, name: str, job: JobCgroup, args: list[str]) -> None:
    torpor.engine().run(name, args, "/tmp", cgroup=job.path)


@pytest.mark.criu
@needs_controller
def test_a_torpor_job_is_counted_in_its_cgroup_and_restored_with_the_limit_set_before(
    torpor: Torpor, controller: MemoryController
) -> None:
    controller.prepare()
    job = controller.job("hog")
    job.create(300 * MiB)
    try:
        engine_run(torpor, "hog", job, [sys.executable, "-u", str(JOBS / "memory_hog.py"), "100"])
        torpor.wait_log("hog", "step 2")
        pid = torpor.job("hog")["pid"]
        assert pid in job.pids()
        assert job.usage() >= 100 * MiB
        torpor.run("hibernate", "hog")
        assert job.pids() == [] and job.usage() < 10 * MiB
        # the folder of a hibernated job may go; CRIU would make it again with the dumped limit: the
        # agent makes it first, with the limit it wants, and CRIU keeps that one
        job.remove()
        job.create(500 * MiB)
        torpor.run("resume", "hog")
        assert torpor.job("hog")["pid"] in job.pids()
        assert job.limit() == 500 * MiB
        assert "oom_kill_disable 1" in (job.path / "memory.oom_control").read_text()
        assert job.usage() >= 100 * MiB
        step = int(torpor.log("hog").split("step ")[-1].split()[0])
        torpor.wait_log("hog", f"step {step + 2}")
    finally:
        torpor.run("rm", "--force", "hog", check=False)


@pytest.mark.criu
@needs_controller
def test_a_stalled_torpor_job_is_hibernated_and_finishes_after_its_restore(
    torpor: Torpor, controller: MemoryController
) -> None:
    if controller.version == 2:
        pytest.skip("v2 does not stall")
    controller.prepare()
    job = controller.job("grower")
    job.create(96 * MiB)
    try:
        engine_run(torpor, "grower", job, stepper(8, 200))
        wait_until(job.stalled, "the job to stall at its limit")
        assert job.unstall_for_dump()
        torpor.run("hibernate", "grower")
        assert job.oom_kills() == 0
        job.set_limit(400 * MiB)  # before the restore: the folder exists, CRIU keeps its limit
        torpor.run("resume", "grower")
        pids = job.pids()
        assert pids and all(procfs.process_state(pid) == "T" for pid in pids), "CRIU restores it stopped"
        assert job.continue_processes() == pids
        log = torpor.wait_log("grower", "done")
        assert "done True" in log and "held 200" in log
        assert job.oom_kills() == 0 and job.limit() == 400 * MiB
    finally:
        torpor.run("rm", "--force", "grower", check=False)


def test_the_mount_a_path_is_on_is_the_deepest_and_the_last_mounted_there(tmp_path: Path) -> None:
    from torpor.adapters.system.mounts import mount_of

    table = tmp_path / "mountinfo"
    table.write_text(
        "20 1 8:1 / / rw - overlay overlay rw\n"
        "21 20 8:2 /pods/u/volumes/kubernetes.io~empty-dir/s /scratch rw - ext4 /dev/sda2 rw\n"
        "22 20 0:5 / /scr rw - tmpfs tmpfs rw\n"
        "23 21 0:6 / /scratch rw - tmpfs tmpfs rw\n"
        "24 20 8:3 /a\\040b /with\\040space rw - ext4 /dev/sda3 rw\n"
    )
    mount = mount_of("/scratch/x/y", table)
    assert mount is not None and (str(mount.point), mount.fstype) == ("/scratch", "tmpfs")  # mounted over
    mount = mount_of("/scratchpad/z", table)  # not below /scratch, nor /scr
    assert mount is not None and str(mount.point) == "/"
    mount = mount_of("/with space/f", table)
    assert mount is not None and mount.root == "/a b"
    assert mount_of("/x", tmp_path / "absent") is None
