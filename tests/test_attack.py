"""A scripted attack by an unprivileged user on a root job (issue 11).

A user made for the test (and removed after it) tries, while a root job that holds a secret in its
memory and writes it to its log is checkpointed, hibernated and resumed under torpor's default RAM hot
tier: to read every file under the state directory, the store and the hot tier; to plant links where
torpor writes; and to make the default hot tier of another home before root uses it. It must read
nothing of the job and redirect no write.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Torpor
from torpor.core.store import remove_hot_tier
from torpor.errors import UnsafePath
from torpor.settings import Settings

pytestmark = [
    pytest.mark.criu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd"),
]

#: holds its secret in memory (many copies) and prints it once, then counts
JOB = """
import sys, time
hoard = [sys.argv[1] * 64 for _ in range(256)]
print(sys.argv[1], flush=True)
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.1)
"""

#: run as the attacker: read all it can under the roots, and try to make a link at each of the places
ATTACK = r"""
import errno, json, os, sys
roots, secret, plants, bait = json.loads(sys.argv[1])
report = {"read": [], "secret": [], "denied": 0, "planted": [], "refused": []}
def denied(exc):
    report["denied"] += 1
for root in roots:
    try:
        os.stat(root)
    except OSError:
        report["denied"] += 1
    for folder, _dirs, files in os.walk(root, onerror=denied):
        for name in files:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as handle:
                    data = handle.read()
            except OSError:
                report["denied"] += 1
                continue
            report["read"].append(path)
            if secret.encode() in data:
                report["secret"].append(path)
for path in plants:
    try:
        os.symlink(bait, path)
    except OSError as exc:
        report["refused"].append(errno.errorcode[exc.errno])
    else:
        report["planted"].append(path)
print(json.dumps(report))
"""


@dataclass
class Attacker:
    name: str
    uid: int
    gid: int
    #: a folder of the attacker's own, with a file it can read (where it points its links)
    den: Path

    @property
    def bait(self) -> Path:
        return self.den / "bait"

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *command],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            check=False,
        )

    def attack(self, roots: list[Path], secret: str, plants: list[Path]) -> dict[str, Any]:
        args = json.dumps([[str(r) for r in roots], secret, [str(p) for p in plants], str(self.bait)])
        result = self.run("/usr/bin/python3", "-I", "-c", ATTACK, args)
        assert result.returncode == 0, result.stderr
        report: dict[str, Any] = json.loads(result.stdout)
        return report


@pytest.fixture
def attacker(readable_folder: Path) -> Iterator[Attacker]:
    name = f"tpatk{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-m", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        den = readable_folder / "attacker"
        den.mkdir()
        os.chown(den, entry.pw_uid, entry.pw_gid)
        user = Attacker(name, entry.pw_uid, entry.pw_gid, den)
        assert user.run("touch", str(user.bait)).returncode == 0
        yield user
    finally:
        subprocess.run(["userdel", "-r", "-f", name], check=False, capture_output=True)


def torpor_at(home: Path) -> Torpor:
    """torpor on ``home`` with the default hot tier (``/dev/shm/torpor-<hash of home>``)."""
    env = {**os.environ, "TORPOR_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("TORPOR_HOT_DIR", None)
    return Torpor(home, env)


def clean_up(torpor: Torpor) -> None:
    if torpor.home.exists():
        for job in json.loads(torpor.run("ps", "--json", check=False).stdout or "[]"):
            torpor.run("rm", "--force", job["name"], check=False)
    remove_hot_tier(Settings(home=torpor.home))


def test_another_user_reads_nothing_of_a_root_job_and_redirects_no_write(
    readable_folder: Path, attacker: Attacker
) -> None:
    secret = f"torpor-secret-{uuid.uuid4().hex}"
    torpor = torpor_at(readable_folder / "home")
    hot = Settings(home=torpor.home).hot_path
    try:
        torpor.run("run", "--name", "s", "--", sys.executable, "-u", "-c", JOB, secret)
        torpor.wait_log("s", "step 3")
        checkpoint = torpor.json("checkpoint", "s", "--wait")
        image = hot / checkpoint["id"]
        plants = [
            hot / "destager.log",
            hot / "destager.lock",
            hot / "next.partial",
            image / ".torpor.json",
            image / ".lock",
            torpor.home / "torpor.db-wal",
            torpor.home / "jobs" / "s" / "output.log",
            torpor.home / "staging" / "next.partial",
            torpor.home / "images" / "config",
        ]
        # the secret is there for root to read: in the image in RAM, in the job's log, in the database
        assert secret in torpor.log("s")
        for files in (list(image.iterdir()), list(torpor.home.glob("torpor.db*"))):
            assert any(secret.encode() in p.read_bytes() for p in files), files

        report = attacker.attack([readable_folder, hot], secret, plants)
        mine = str(attacker.den)
        assert [p for p in report["read"] if not p.startswith(mine)] == []
        assert report["secret"] == [] and report["denied"] > 0
        assert report["planted"] == [] and set(report["refused"]) == {"EACCES"}

        torpor.run("hibernate", "s", "--wait")
        torpor.run("resume", "s")
        torpor.wait_state("s", "running")
        torpor.wait_log("s", "step 5")
        torpor.run("checkpoint", "s", "--wait")
        report = attacker.attack([readable_folder, hot], secret, plants)
        assert [p for p in report["read"] if not p.startswith(mine)] == []
        assert report["secret"] == [] and report["planted"] == []
        assert attacker.bait.read_bytes() == b""
    finally:
        clean_up(torpor)


def test_a_default_hot_tier_another_user_made_first_is_refused(
    readable_folder: Path, attacker: Attacker
) -> None:
    torpor = torpor_at(readable_folder / "other-home")
    hot = Settings(home=torpor.home).hot_path  # predictable: /dev/shm/torpor-<hash of home>
    try:
        made = attacker.run(
            "sh", "-c", 'mkdir -m 777 "$0" && ln -s "$1" "$0/destager.log"', str(hot), str(attacker.bait)
        )
        assert made.returncode == 0, made.stderr
        torpor.run("run", "--name", "v", "--", sys.executable, "-u", "-c", JOB, "not-a-secret")
        torpor.wait_log("v", "step 2")
        result = torpor.run("checkpoint", "v", check=False)
        assert result.returncode == UnsafePath.exit_code, result.stderr
        assert f"the hot tier {hot} is owned by uid {attacker.uid}" in result.stderr
        assert [p.name for p in hot.iterdir()] == ["destager.log"]  # nothing of root's was written there
        assert not os.path.ismount(hot)
        assert attacker.bait.read_bytes() == b""
        assert torpor.job("v")["state"] == "running"
    finally:
        clean_up(torpor)
        shutil.rmtree(hot, ignore_errors=True)  # the attacker's: torpor leaves it alone
