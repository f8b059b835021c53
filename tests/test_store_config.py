"""The store configuration of a state directory (issue 11, items 3 and 7): where images go, with which
key and retention, is written once into ``$TORPOR_HOME/store.json`` and every process — CLI, launcher,
destager — takes it from there; a bad value is refused where it is set, a store variable of a later
command that disagrees is refused, ``torpor store set`` changes it (a running job's next checkpoint
follows), and a checkpoint whose image cannot be stored says so on stderr and in ``torpor checkpoints``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import MountTmpfs, Torpor, python_job
from torpor.adapters.folder import FolderBackend
from torpor.core.store import config
from torpor.core.store.repository import Repository
from torpor.errors import EnvironmentProblem, UsageError
from torpor.settings import Settings, parse_bytes

pytestmark = pytest.mark.timeout(180)


def one_line_error(result: subprocess.CompletedProcess[str], code: int, *texts: str) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("torpor: error:")]
    assert len(lines) == 1, result.stderr
    for text in texts:
        assert text in lines[0], lines[0]
    return lines[0]


def key_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


# -- values refused where they are set (fast, no CRIU) ----------------------------------------------


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "abc", "-1G", "", "1e400"])
def test_a_bad_hot_capacity_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.setenv("TORPOR_HOT_CAPACITY", value or " ")
    with pytest.raises(UsageError, match=r"^TORPOR_HOT_CAPACITY=") as caught:
        Settings.from_environment(home=str(tmp_path))
    assert "\n" not in caught.value.message


def test_parse_bytes_refuses_what_is_not_a_finite_size() -> None:
    for text in ("inf", "nan", "-5", "1e400", "G"):
        with pytest.raises(UsageError):
            parse_bytes(text)
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("0") == 0


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TORPOR_STORE", "s3://", "needs a bucket"),
        ("TORPOR_STORE", "s3:///prefix", "needs a bucket"),
        ("TORPOR_STORE", "ftp://host/x", "unsupported store URL"),
        ("TORPOR_STORE", "file://", "needs a folder"),
        ("TORPOR_S3_ENDPOINT", "localhost:9000", "http://"),
        ("TORPOR_KEY_FILE", "{missing}", "does not exist"),
        ("TORPOR_KEY_FILE", "{short}", "must hold 32 bytes"),
        ("TORPOR_KEY_FILE", "{folder}", "cannot read"),
        ("TORPOR_KEEP_LAST", "many", "whole number"),
        ("TORPOR_KEEP_LAST", "-1", "negative"),
    ],
)
def test_a_bad_store_value_is_refused_naming_the_variable(
    tmp_path: Path, name: str, value: str, says: str
) -> None:
    (tmp_path / "short").write_bytes(b"12345")
    value = value.format(missing=tmp_path / "missing", short=tmp_path / "short", folder=tmp_path)
    with pytest.raises(UsageError) as caught:
        config.from_variables({name: value}, tmp_path / "home")
    assert caught.value.message.startswith(f"{name}="), caught.value.message
    assert says in caught.value.message and "\n" not in caught.value.message


def test_the_file_is_versioned_private_and_read_again_when_it_changes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    key = key_file(tmp_path / "key")
    written = config.establish(home, {"TORPOR_STORE": "s3://bucket/a/", "TORPOR_KEY_FILE": str(key)})
    path = home / config.FILE
    data = json.loads(path.read_text())
    assert data["format"] == config.FORMAT and data["version"] == config.VERSION
    assert data["url"] == "s3://bucket/a" and data["key_file"] == str(key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    watched = config.ConfigFile(home)
    assert watched.current() == written
    config.save(home, written.replace(keep_last=3))
    assert watched.current().keep_last == 3  # a long-lived process sees the change at its next use
    # a command that sets nothing, or the same values, is fine; a different value is refused
    assert config.establish(home, {}) == watched.current()
    assert config.establish(home, {"TORPOR_STORE": "s3://bucket/a"}).keep_last == 3
    with pytest.raises(UsageError, match="torpor store set --url"):
        config.establish(home, {"TORPOR_STORE": str(tmp_path / "elsewhere")})
    path.chmod(0o620)  # it decides where memory images go: nobody but its owner may change it
    with pytest.raises(EnvironmentProblem, match="writable by others"):
        config.load(home)
    path.chmod(0o600)
    path.write_text("{not json")
    with pytest.raises(UsageError, match="is damaged"):
        config.load(home)


# -- through the CLI --------------------------------------------------------------------------------


def test_a_store_url_without_a_bucket_is_refused_at_run(torpor: Torpor) -> None:
    bad = Torpor(torpor.home, {**torpor.env, "TORPOR_STORE": "s3://"})
    one_line_error(bad.run("run", "--name", "j", "--", "sleep", "60", check=False), 2, "TORPOR_STORE")
    assert not (torpor.home / config.FILE).exists()
    assert torpor.json("ps") == []  # no job that could never store a checkpoint


@pytest.mark.root("a job runs in its own PID namespace")
def test_a_later_command_with_another_store_value_is_refused(torpor: Torpor, tmp_path: Path) -> None:
    torpor.run("run", "--name", "j1", "--", "sleep", "600")
    key = key_file(tmp_path / "k")
    keyed = Torpor(torpor.home, {**torpor.env, "TORPOR_KEY_FILE": str(key)})
    line = one_line_error(keyed.run("checkpoint", "j1", check=False), 2, "TORPOR_KEY_FILE")
    assert "no key file" in line and f"torpor store set --key-file {key}" in line
    assert torpor.json("checkpoints") == []  # nothing stored in plaintext that was meant encrypted
    elsewhere = Torpor(torpor.home, {**torpor.env, "TORPOR_STORE": str(tmp_path / "other")})
    line = one_line_error(elsewhere.run("ps", check=False), 2, "TORPOR_STORE", "torpor store set --url")
    assert str(torpor.home / "images") in line
    # the diagnostic commands still answer, and say what disagrees
    shown = json.loads(elsewhere.run("store", "show", "--json").stdout)
    assert shown["config"]["url"] == str(torpor.home / "images")
    assert [d["variable"] for d in shown["environment_disagrees"]] == ["TORPOR_STORE"]
    report = json.loads(elsewhere.run("doctor", "--json", check=False).stdout)
    assert report["store"]["config"]["url"] == str(torpor.home / "images")
    assert report["store"]["environment_disagrees"]


def test_store_set_validates_before_it_writes(torpor: Torpor, tmp_path: Path) -> None:
    torpor.run("ps")  # the first command writes the configuration from the (empty) environment
    before = (torpor.home / config.FILE).read_bytes()
    one_line_error(torpor.run("store", "set", "--url", "s3://", check=False), 2, "--url")
    one_line_error(
        torpor.run("store", "set", "--key-file", str(tmp_path / "nope"), check=False), 2, "--key-file"
    )
    one_line_error(torpor.run("store", "set", "--keep-last", "-2", check=False), 2, "--keep-last")
    assert (torpor.home / config.FILE).read_bytes() == before
    # a key for a store that exists unencrypted: Repository.open refuses it, nothing changes
    Repository(FolderBackend(torpor.home / "images")).open()
    key = key_file(tmp_path / "k")
    one_line_error(
        torpor.run("store", "set", "--key-file", str(key), check=False), 6, "not encrypted", "unchanged"
    )
    assert (torpor.home / config.FILE).read_bytes() == before
    # a new folder with a key: fine, and every later command (no variables set) uses it
    new = tmp_path / "encrypted"
    out = torpor.run("store", "set", "--url", str(new), "--key-file", str(key), "--keep-last", "2").stdout
    assert str(new) in out
    shown = json.loads(torpor.run("store", "show", "--json").stdout)
    assert shown["config"] == {
        "url": str(new),
        "s3_endpoint": None,
        "key_file": str(key),
        "keep_last": 2,
    }
    assert json.loads((new / "config").read_bytes())["encryption"] == "aes-256-gcm"
    torpor.run("store", "set", "--no-key", "--url", str(tmp_path / "plain"))
    assert json.loads(torpor.run("store", "show", "--json").stdout)["config"]["key_file"] is None


# -- with real checkpoints --------------------------------------------------------------------------


@pytest.mark.criu
def test_a_running_job_checkpoints_into_the_store_set_after_it_started(
    torpor: Torpor, tmp_path: Path
) -> None:
    torpor.run("run", "--name", "c", *python_job("counter.py"))
    torpor.wait_log("c", "step 2")
    first = json.loads(torpor.run("checkpoint", "c", "--wait", "--json").stdout)["id"]
    assert Repository(FolderBackend(torpor.home / "images")).open().has(first)
    new = tmp_path / "new-store"
    refused = torpor.run("store", "set", "--url", str(new), check=False)
    one_line_error(refused, 2, "1 checkpoint", "--force")
    torpor.run("store", "set", "--url", str(new), "--keep-last", "1", "--force")
    # the job's launcher was started with the old configuration: it reads the new one
    second = json.loads(torpor.run("checkpoint", "c", "--wait", "--json").stdout)["id"]
    assert Repository(FolderBackend(new)).open().has(second)
    assert not Repository(FolderBackend(torpor.home / "images")).open().has(second)
    # retention (keep the last 1) came from the new configuration too: the first checkpoint is gone
    assert [c["id"] for c in torpor.json("checkpoints", "c")] == [second]


@pytest.mark.criu
def test_a_checkpoint_that_cannot_be_stored_says_so(torpor: Torpor, tmpfs: MountTmpfs) -> None:
    cold = tmpfs("cold", "size=16m")
    torpor.env["TORPOR_STORE"] = str(cold)
    torpor.run("run", "--name", "r", *python_job("counter.py"))
    torpor.wait_log("r", "step 2")
    torpor.run("checkpoint", "r", "--wait")  # the store works, and exists now
    subprocess.run(["mount", "-o", "remount,ro", str(cold)], check=True)
    result = torpor.run("checkpoint", "r")
    assert result.returncode == 0  # the checkpoint exists (in RAM) and the job runs on
    checkpoint = result.stdout.split(" as ")[1].split(":")[0]
    warning = f"torpor: warning: checkpoint {checkpoint} is only in RAM: "
    assert warning in result.stderr and "read-only file system" in result.stderr.lower(), result.stderr
    listed = {c["id"]: c for c in torpor.json("checkpoints", "r")}
    assert listed[checkpoint]["state"] != "durable"
    assert "read-only file system" in (listed[checkpoint]["error"] or "").lower()
    table = torpor.run("checkpoints").stdout
    assert f"{checkpoint}: " in table and "read-only file system" in table.lower(), table
    waited = torpor.run("checkpoint", "r", "--wait", check=False)
    one_line_error(waited, 6, "not durable")
