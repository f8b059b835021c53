"""Shared fixtures: an isolated torpor state directory and a way to run the real CLI against it.

Tests drive the installed ``torpor`` command in a subprocess (as a user would) with ``TORPOR_HOME``
pointing at a temporary folder, and clean up every job they started. A test that needs more than a
normal user has is marked with what it needs (``criu``, ``root``, ``slurm``, ``torch``): ``make unit``
runs the tests that need none of them, as any user; ``make test`` runs them all, as root.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

TORPOR = str(Path(sys.executable).parent / "torpor")
JOBS = Path(__file__).parent / "jobs"


def criu_works() -> bool:
    criu = Path(sys.executable).parent / "criu"
    if not criu.exists() or os.geteuid() != 0:
        return False
    return subprocess.run([str(criu), "check"], capture_output=True, check=False).returncode == 0


CRIU_OK = criu_works()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # ``make unit`` leaves the ``criu``, ``root``, ``slurm`` and ``torch`` tests out by marker; run without
    # root anyway, the ``criu`` and ``root`` ones are skipped here, saying why, instead of failing
    no_criu = pytest.mark.skip(reason="needs root and a working CRIU (run 'make setup')")
    if (
        not CRIU_OK
        and os.environ.get("TORPOR_TESTS_NEED_CRIU") == "1"
        and any("criu" in i.keywords for i in items)
    ):
        # CI: a run whose real checkpoints were all skipped has not tested torpor
        raise pytest.UsageError(
            "TORPOR_TESTS_NEED_CRIU=1, but CRIU does not work here (not root? run 'make setup')"
        )
    for item in items:
        if "criu" in item.keywords and not CRIU_OK:
            item.add_marker(no_criu)
        elif (root := item.get_closest_marker("root")) is not None and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason=f"needs root: {', '.join(root.args) or 'root'}"))


@dataclass
class Torpor:
    home: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [TORPOR, *args], capture_output=True, text=True, env=self.env, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"torpor {' '.join(args)} exited {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)

    def job(self, name: str) -> dict[str, Any]:
        jobs = {job["name"]: job for job in self.json("ps")}
        return dict(jobs[name])

    def log(self, name: str) -> str:
        return self.run("logs", name).stdout

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def wait_log(self, name: str, text: str, timeout: float = 60) -> str:
        self.wait_for(lambda: text in self.log(name), timeout, f"{text!r} in the log of {name}")
        return self.log(name)

    def wait_state(self, name: str, *states: str, timeout: float = 60) -> dict[str, Any]:
        self.wait_for(lambda: self.job(name)["state"] in states, timeout, f"{name} to be {states}")
        return self.job(name)

    def engine(self) -> Any:
        """An Engine in this process on the same state directory and hot tier as the CLI's."""
        from torpor.core.engine import Engine
        from torpor.settings import Settings, find_criu

        return Engine(
            Settings(home=self.home, criu=find_criu(None), hot_dir=Path(self.env["TORPOR_HOT_DIR"]))
        )


@pytest.fixture
def torpor(tmp_path: Path) -> Iterator[Torpor]:
    home = tmp_path / "home"
    # the RAM hot tier lives outside the state directory: give each test its own and remove it after
    hot = Path("/dev/shm") / f"torpor-test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "TORPOR_HOME": str(home), "TORPOR_HOT_DIR": str(hot), "PYTHONUNBUFFERED": "1"}
    instance = Torpor(home, env)
    yield instance
    if home.exists():
        for job in json.loads(instance.run("ps", "--json", check=False).stdout or "[]"):
            instance.run("rm", "--force", job["name"], check=False)
    shutil.rmtree(hot, ignore_errors=True)


def holders(path: Path) -> list[int]:
    """The processes that have ``path`` open: once there are none, nothing can write to it any more."""
    target = str(path.resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return found


@contextmanager
def gpu_holders(devices: Path, minors: int) -> Iterator[list[int]]:
    """Processes holding ``devices``/nvidia0, nvidia1… open, one each, then one that holds none: GPU
    users as /proc shows them, for tests that point ``torpor.adapters.gpu.NVIDIA_DEVICE_PREFIX`` at
    ``devices``/nvidia (no machine these tests run on has an NVIDIA GPU)."""
    devices.mkdir(parents=True, exist_ok=True)
    processes = []
    try:
        for n in range(minors):
            (devices / f"nvidia{n}").touch()
            with open(devices / f"nvidia{n}") as held:
                processes.append(subprocess.Popen(["sleep", "60"], stdin=held))
        processes.append(subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL))
        yield [p.pid for p in processes]
    finally:
        for each in processes:
            each.kill()
            each.wait()


def python_job(script: str, *args: str) -> list[str]:
    return ["--", sys.executable, "-u", str(JOBS / script), *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


MOTO = str(Path(sys.executable).parent / "moto_server")
#: moto's credentials: any will do, as long as each client gives some
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextmanager
def moto_server(host: str = "127.0.0.1") -> Iterator[str]:
    """A real S3-compatible HTTP server (moto's server mode) on an ephemeral port of ``host``: its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [MOTO, "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **S3_ENV},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection((host, port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield f"http://{host}:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """:func:`moto_server` on loopback, with its credentials in this process's environment (boto3's)."""
    with moto_server() as endpoint:
        saved = {key: os.environ.get(key) for key in S3_ENV}
        os.environ.update(S3_ENV)
        try:
            yield endpoint
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture
def readable_folder() -> Iterator[Path]:
    """A folder every user may look into (pytest's tmp_path is root's alone), removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix="torpor-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class OutsideUnixServer:
    """A unix stream server at ``path`` in the test process, outside every job; it accepts one client."""

    def __init__(self, path: str) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(1)
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(
            target=lambda: self.accepted.append(self.server.accept()[0]), daemon=True
        )
        self.thread.start()

    def connection(self, timeout: float = 10) -> socket.socket:
        """The client's connection, once it came (within ``timeout`` seconds)."""
        self.thread.join(timeout)
        return self.accepted[0]

    def __enter__(self) -> OutsideUnixServer:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self.accepted:
            conn.close()
        self.server.close()


@contextmanager
def serving(app: Any, timeout: float = 10) -> Iterator[str]:
    """A real uvicorn server for the ASGI ``app`` on an ephemeral port of 127.0.0.1; yields its base URL."""
    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"uvicorn did not start on 127.0.0.1:{port}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        listener.close()


#: ``mount(name, options)``: a tmpfs mounted (with those options) on a new folder of the test's tmp_path
MountTmpfs = Callable[[str, str], Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[MountTmpfs]:
    """Small file systems a test can fill or make read-only; unmounted after it."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)
