"""Jobs that run as another user (issue 13, item 3): ``torpor run -- runuser -u USER -- …``.

CRIU reads the resource limits of every process it dumps; the kernel lets root read another user's
only with CAP_SYS_RESOURCE, which root lacks on some machines (this one). Covered here: such a job
checkpointed, hibernated and resumed for real (output continues, same user, same limits); the rlimit
shim for criu (scripts/criu-rlimits.c) compiled from source and asked by a third user for every limit of
a process of nobody's; ``torpor doctor`` on it; and, where root lacks the capability, the error of a dump
without the shim, and of a job whose first process is not root, in torpor's words.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Torpor
from torpor.adapters.system import machine, procfs

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd"),
]

SHIM_SOURCE = Path(__file__).parents[2] / "scripts" / "criu-rlimits.c"
PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
NO_CAP = machine.has_capability(machine.CAP_SYS_RESOURCE) is False
#: what the job prints, every 0.2 s: its step, its uid and two limits it set itself at the start
LOOP = """
import os, resource, time
resource.setrlimit(resource.RLIMIT_NOFILE, (123, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
resource.setrlimit(resource.RLIMIT_CORE, (4096, resource.getrlimit(resource.RLIMIT_CORE)[1]))
step = 0
while True:
    nofile, core = resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_CORE)
    print("step", step, "uid", os.getuid(), "nofile", *nofile, "core", *core, flush=True)
    step += 1
    time.sleep(0.2)
"""
LINE = re.compile(r"^step (\d+) uid (\d+) nofile (-?\d+) (-?\d+) core (-?\d+) (-?\d+)$")


@pytest.fixture
def user() -> Iterator[pwd.struct_passwd]:
    """A user made for the test, without a home, removed after it."""
    name = f"tprun{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "-f", name], check=False, capture_output=True)


def criu_in_use() -> Path:
    """The criu the tests' torpor runs (TORPOR_CRIU, or the one installed beside this Python)."""
    return Path(os.environ.get("TORPOR_CRIU") or Path(sys.executable).parent / "criu")


def steps(log: str) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in m.groups()) for line in log.splitlines() if (m := LINE.match(line))]


def job_processes_of(torpor: Torpor, name: str, uid: int) -> list[int]:
    root = torpor.job(name)["pid"]
    return [pid for pid in procfs.namespace_members(root) if _uid(pid) == uid]


def _uid(pid: int) -> int | None:
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


@pytest.mark.criu
def test_a_job_of_another_user_is_checkpointed_hibernated_and_resumed(
    torpor: Torpor, user: pwd.struct_passwd
) -> None:
    torpor.run(
        "run", "--name", "as-user", "--", "runuser", "-u", user.pw_name, "--", PYTHON, "-u", "-c", LOOP
    )
    torpor.wait_log("as-user", "step 3 ")
    torpor.run("checkpoint", "as-user")
    torpor.wait_log("as-user", "step 6 ")
    torpor.run("hibernate", "as-user")
    assert torpor.job("as-user")["state"] == "hibernated"
    last = steps(torpor.log("as-user"))[-1][0]
    torpor.run("resume", "as-user")
    torpor.wait_log("as-user", f"step {last + 3} ")
    seen = steps(torpor.log("as-user"))
    # every step once, in order: nothing lost or repeated across the checkpoint and the hibernation
    assert [s[0] for s in seen] == list(range(len(seen)))
    # still the user, with the limits the job set itself (CRIU dumped and restored them)
    first, after = seen[0], seen[-1]
    assert after[1] == user.pw_uid and after[2:] == first[2:] and after[2] == 123 and after[4] == 4096
    members = job_processes_of(torpor, "as-user", user.pw_uid)
    assert members, "no process of the job runs as the user after the resume"
    limits = Path(f"/proc/{members[0]}/limits").read_text()
    assert re.search(r"^Max open files\s+123\s", limits, re.MULTILINE)


@pytest.mark.root("to run processes as two other users")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/install-programs.sh)")
def test_the_shim_answers_every_limit_of_another_users_process_from_proc(
    readable_folder: Path, user: pwd.struct_passwd
) -> None:
    shim = readable_folder / "shim.so"
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(shim), str(SHIM_SOURCE)],
        check=True,
    )
    # a process of nobody's with limits of its own, soft below hard, printing what it has
    target_code = (
        "import json, resource, sys, time\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (77, 99))\n"
        "resource.setrlimit(resource.RLIMIT_CPU, (1000, 2000))\n"
        "resource.setrlimit(resource.RLIMIT_STACK, (4 << 20, 16 << 20))\n"
        "print(json.dumps([resource.getrlimit(r) for r in range(16)]), flush=True)\n"
        "time.sleep(60)\n"
    )
    target = subprocess.Popen(
        [PYTHON, "-c", target_code],
        user=65534,
        group=65534,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout is not None
        own = [tuple(limit) for limit in json.loads(target.stdout.readline())]
        # the test's user asks (no capability, another uid: the kernel refuses every read to it)
        asker_code = (
            "import ctypes, json, sys\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "class Limit(ctypes.Structure):\n"
            "    _fields_ = [('cur', ctypes.c_uint64), ('max', ctypes.c_uint64)]\n"
            "SYS_prlimit64, pid, out = 302, int(sys.argv[1]), []\n"
            "def ask(res, new=None):\n"
            "    old = Limit()\n"
            "    rc = libc.syscall(SYS_prlimit64, pid, res, new, ctypes.byref(old) if new is None else None)\n"
            "    return [rc, ctypes.get_errno() if rc else 0, old.cur, old.max]\n"
            "out = [ask(r) for r in range(17)]\n"
            "out.append(ask(7, ctypes.byref(Limit(1, 1))))  # a write: refused as before\n"
            "out.append([libc.syscall(39), 0, 0, 0])  # getpid: any other call passes through\n"
            "print(json.dumps(out))\n"
        )
        asked = subprocess.run(
            [PYTHON, "-c", asker_code, str(target.pid)],
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=[],
            env={"LD_PRELOAD": str(shim), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        target.kill()
        target.communicate()
    assert asked.stderr == ""  # the loader took the shim (it warns on stderr when it cannot)
    answers = json.loads(asked.stdout)
    infinity = 2**64 - 1

    def as_python(value: int) -> int:
        return -1 if value == infinity else value  # resource.getrlimit's RLIM_INFINITY

    got = [(as_python(cur), as_python(high)) for rc, _, cur, high in answers[:16]]
    assert [a[0] for a in answers[:16]] == [0] * 16
    assert got == own
    assert own[7] == (77, 99) and own[0] == (1000, 2000) and own[3] == (4 << 20, 16 << 20)
    assert answers[16][:2] == [-1, 1]  # no resource 16: EPERM passed through, not a made-up answer
    assert answers[17][:2] == [-1, 1]
    assert answers[18][0] > 0


@pytest.mark.criu
def test_doctor_says_whether_jobs_of_another_user_can_be_checkpointed(torpor: Torpor) -> None:
    report = torpor.json("doctor")
    other = report["other_users"]
    assert other["cap_sys_resource"] is (not NO_CAP)
    # the suite's criu is installed by make setup, with the shim: such jobs work either way
    assert other["checkpoint_ok"] is True and other["problem"] is None
    if NO_CAP:
        assert other["rlimit_shim"] and Path(other["rlimit_shim"]).is_file()
        assert "rlimit shim" in torpor.run("doctor").stdout


@pytest.fixture
def criu_without_shim(tmp_path: Path) -> Path:
    """The suite's criu wrapper, but pointed at a shim that is not there: criu as it runs without it."""
    text = criu_in_use().read_text(errors="replace")
    changed = re.sub(r'^S=".*"$', f'S="{tmp_path}/absent.so"', text, count=1, flags=re.MULTILINE)
    if changed == text:
        pytest.skip(f"{criu_in_use()} is not the wrapper scripts/install-criu.sh writes")
    wrapper = tmp_path / "criu"
    wrapper.write_text(changed)
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.criu
@pytest.mark.skipif(not NO_CAP, reason="root has CAP_SYS_RESOURCE here: CRIU reads every user's limits")
def test_without_the_shim_doctor_warns_and_the_dump_says_why_in_torpors_words(
    torpor: Torpor, user: pwd.struct_passwd, criu_without_shim: Path
) -> None:
    bare = Torpor(torpor.home, {**torpor.env, "TORPOR_CRIU": str(criu_without_shim)})
    doctor = bare.run("doctor", "--json")  # exit 0: jobs of root's own still work
    other = json.loads(doctor.stdout)["other_users"]
    assert other["checkpoint_ok"] is False and other["rlimit_shim"] is None
    assert "cannot be checkpointed" in other["problem"] and "CAP_SYS_RESOURCE" in other["problem"]
    line = next(line for line in bare.run("doctor").stdout.splitlines() if "of another user" in line)
    assert line.startswith("--  jobs with processes of another user")

    bare.run("run", "--name", "bare", "--", "runuser", "-u", user.pw_name, "--", PYTHON, "-u", "-c", LOOP)
    bare.wait_log("bare", "step 2 ")
    failed = bare.run("checkpoint", "bare", check=False)
    assert failed.returncode == 4
    message = next(line for line in failed.stderr.splitlines() if line.startswith("torpor: error:"))
    assert f"user {user.pw_name}" in message and "CAP_SYS_RESOURCE" in message and "make setup" in message
    assert bare.job("bare")["state"] == "running"
    now = steps(bare.log("bare"))[-1][0]
    bare.wait_log("bare", f"step {now + 2} ")  # not left frozen


@pytest.mark.criu
def test_a_job_whose_first_process_is_not_root_is_refused_in_torpors_words(
    torpor: Torpor, user: pwd.struct_passwd
) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv")
    ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    torpor.run("run", "--name", "setpriv", "--", setpriv, *ids, PYTHON, "-u", "-c", LOOP)
    torpor.wait_log("setpriv", "step 2 ")
    failed = torpor.run("checkpoint", "setpriv", check=False)
    assert failed.returncode == 4
    assert "does not run as root" in failed.stderr and "runuser -u USER" in failed.stderr
    assert f"user {user.pw_name}" in failed.stderr
    assert torpor.job("setpriv")["state"] == "running"
