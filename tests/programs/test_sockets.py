"""Real programs with clients outside the job: unix sockets (--ext-unix-sk), HTTP keep-alive, tmux.

- A process outside the job connected to one of its unix sockets fails the dump; the error names the
  socket, the process and ``--ext-unix-sk``. With the option the checkpoint works, the outside client
  keeps its connection while the job runs, and a job restored from that image sees it closed (its own
  unix connections, inside the job, work on); a datagram socket is connected to its address again.
- ``python -m http.server --protocol HTTP/1.1``: one keep-alive TCP connection from this test serves
  requests before a checkpoint, after it, and after a hibernation and resume (``--tcp-established``).
- A tmux server (``tmux -D``, in the foreground: a server that daemonizes leaves the job's PID 1, and
  the job ends with it) running a counter in a detached session: it counts on through checkpoint,
  hibernate and resume; an attached control-mode client fails the dump, or is let go with the option.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OutsideUnixServer, Torpor, free_port, python_job

pytestmark = [pytest.mark.criu, pytest.mark.timeout(120)]


def refused_for_outside_socket(result: subprocess.CompletedProcess[str], socket_path: str, pid: int) -> None:
    assert result.returncode == 4, (result.returncode, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("torpor: error: ")]
    assert len(errors) == 1, result.stderr
    assert f"pid {pid} " in errors[0] and socket_path in errors[0], errors[0]
    assert "--ext-unix-sk" in errors[0] and "outside the job" in errors[0], errors[0]
    assert "the job is still running" in result.stderr


def test_outside_client_on_a_job_unix_socket(torpor: Torpor, tmp_path: Path) -> None:
    path = str(tmp_path / "job.sock")
    torpor.run("run", "--name", "usk", *python_job("unix_server.py", path))
    torpor.wait_log("usk", "step 2")
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    client.connect(path)
    client.sendall(b"one")
    assert client.recv(100) == b"echo one"

    for verb in ("checkpoint", "hibernate"):
        refused_for_outside_socket(torpor.run(verb, "usk", check=False), path, os.getpid())
    assert torpor.json("checkpoints") == []

    torpor.run("checkpoint", "--ext-unix-sk", "usk")
    client.sendall(b"two")  # the job kept running: the outside client keeps its connection
    assert client.recv(100) == b"echo two"

    torpor.run("hibernate", "--ext-unix-sk", "usk")
    assert client.recv(100) == b""  # the job is gone: its end of the connection closed
    client.close()
    gone_before = torpor.log("usk").count("client gone")
    torpor.run("resume", "usk")
    # the restored job finds the connection closed, as if the client had hung up, and serves on
    torpor.wait_for(lambda: torpor.log("usk").count("client gone") > gone_before, what="the old client gone")
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.settimeout(10)
    again.connect(path)
    again.sendall(b"three")
    assert again.recv(100) == b"echo three"
    again.close()
    last_step = max(int(n) for n in re.findall(r"step (\d+)", torpor.log("usk")))
    torpor.wait_log("usk", f"step {last_step + 3} ")


def test_job_connected_to_an_outside_unix_server(torpor: Torpor, tmp_path: Path) -> None:
    path = str(tmp_path / "outside.sock")
    with OutsideUnixServer(path) as server:
        torpor.run("run", "--name", "cli", *python_job("external_unix.py", path))
        conn = server.connection()
        conn.sendall(b"ping")
        torpor.wait_log("cli", "got ping")
        torpor.run("checkpoint", "--ext-unix-sk", "cli")
        conn.sendall(b"pong")
        torpor.wait_log("cli", "got pong")
        torpor.run("hibernate", "--ext-unix-sk", "cli")
        torpor.run("resume", "cli")
        log = torpor.wait_log("cli", "peer closed")
        last_step = max(int(n) for n in re.findall(r"step (\d+)", log))
        torpor.wait_log("cli", f"step {last_step + 3}\n")


def test_job_sending_datagrams_to_an_outside_address(torpor: Torpor, tmp_path: Path) -> None:
    path = str(tmp_path / "log.sock")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(10)
    try:
        torpor.run("run", "--name", "dg", *python_job("dgram_sender.py", path))
        assert receiver.recv(100).startswith(b"msg ")
        result = torpor.run("checkpoint", "dg", check=False)
        refused_for_outside_socket(result, path, os.getpid())
        assert "sends to that address again" in result.stderr
        torpor.run("hibernate", "--ext-unix-sk", "dg")
        while True:  # what it sent before the hibernation
            receiver.settimeout(0.5)
            try:
                receiver.recv(100)
            except TimeoutError:
                break
        receiver.settimeout(10)
        torpor.run("resume", "dg")
        # CRIU connected the restored socket to the same address: the messages come again, numbered on
        first = int(receiver.recv(100).split()[1])
        assert int(receiver.recv(100).split()[1]) == first + 1
        assert "send failed" not in torpor.log("dg")
    finally:
        receiver.close()


def test_http_server_keeps_a_keep_alive_connection(torpor: Torpor, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "a.txt").write_text("hello\n")
    port = free_port()
    # HTTP/1.0, http.server's default, closes the connection after each response: no keep-alive
    command = [sys.executable, "-m", "http.server", "-b", "127.0.0.1", "-p", "HTTP/1.1", "-d", str(site)]
    torpor.run("run", "--name", "web", "--", *command, str(port))
    torpor.wait_log("web", "Serving HTTP")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def get() -> tuple[int, bytes]:
        conn.request("GET", "/a.txt")
        response = conn.getresponse()
        return response.status, response.read()

    assert get() == (200, b"hello\n")
    sock = conn.sock  # http.client opens a new connection only when this one is closed
    assert sock is not None
    torpor.run("checkpoint", "web")
    assert get() == (200, b"hello\n")
    torpor.run("hibernate", "web")
    torpor.run("resume", "web")
    (site / "a.txt").write_text("changed\n")
    assert get() == (200, b"changed\n")
    assert conn.sock is sock, "the keep-alive connection was not kept"
    conn.close()
    assert torpor.log("web").count('"GET /a.txt HTTP/1.1" 200') == 3


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (scripts/install-programs.sh)")
def test_tmux_detached_session(torpor: Torpor, tmp_path: Path) -> None:
    sock = str(tmp_path / "tmux.sock")
    env = {k: v for k, v in torpor.env.items() if k != "TMUX"} | {"TERM": "xterm"}

    def tmux(*args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", sock, *args], env=env, capture_output=True, text=True, check=True, timeout=10
        ).stdout

    def counts() -> list[int]:
        return [
            int(n) for n in re.findall(r"count (\d+)", tmux("capture-pane", "-p", "-S", "-", "-t", "main"))
        ]

    torpor.run("run", "--name", "tm", "--", "tmux", "-S", sock, "-D")
    torpor.wait_for(lambda: os.path.exists(sock), what="the tmux server's socket")
    loop = "i=0; while true; do echo count $i; i=$((i+1)); sleep 0.1; done"
    tmux("new-session", "-d", "-s", "main", "-x", "80", "-y", "10", loop)  # a client that leaves at once
    torpor.wait_for(lambda: len(counts()) > 3, what="the counter to count")

    torpor.run("checkpoint", "tm")
    torpor.run("hibernate", "tm")
    torpor.run("resume", "tm")
    before = counts()[-1]
    torpor.wait_for(lambda: counts()[-1] > before + 3, what="the counter to count on after resume")
    seen = counts()
    assert seen == list(range(seen[0], seen[0] + len(seen))), "the counter restarted or skipped"

    with subprocess.Popen(
        ["tmux", "-S", sock, "-C", "attach", "-t", "main"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as attached:
        assert attached.stdout is not None
        try:
            torpor.wait_for(lambda: tmux("list-clients").strip() != "", what="the client to attach")
            refused_for_outside_socket(torpor.run("checkpoint", "tm", check=False), sock, attached.pid)
            torpor.run("checkpoint", "--ext-unix-sk", "tm")
            lines = (attached.stdout.readline() for _ in range(100))
            assert any(line.startswith("%output") for line in lines)  # still attached, the counter shows
            torpor.run("hibernate", "--ext-unix-sk", "tm")
            assert attached.wait(10) is not None  # the server went away under it
            assert "%exit" in attached.stdout.read()
        finally:
            if attached.poll() is None:
                attached.kill()
    torpor.run("resume", "tm")
    before = counts()[-1]
    torpor.wait_for(lambda: counts()[-1] > before + 3, what="the counter to count on after resume")
    assert tmux("list-clients").strip() == ""  # the client of the checkpoint is gone, not half there
