"""Templates and warm starts end to end with real CRIU: a server saved once it is ready, started again
any number of times under new names, each with its own log; what copies share (their random state) and
how a copy learns it is one (SIGCONT, ``torpor whoami``); a port two copies cannot share, and one they
can (SO_REUSEPORT); a template whose program changed starts cold; ``--warm-start`` saves its own.
"""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import Torpor, free_port

pytestmark = [pytest.mark.criu, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "reseeding_server.py"


def get(port: int, host: str = "127.0.0.1") -> dict[str, object]:
    with urllib.request.urlopen(f"http://{host}:{port}/", timeout=10) as answer:
        return dict(json.loads(answer.read()))


def serving(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def start_example(torpor: Torpor, name: str, port: int) -> None:
    torpor.run("run", "--name", name, "--", sys.executable, "-u", str(EXAMPLE), str(port))
    torpor.wait_log(name, f"ready on {port}")


def test_copies_of_a_template_continue_its_memory_with_their_own_name_and_log(torpor: Torpor) -> None:
    port = free_port()
    start_example(torpor, "web", port)
    assert get(port)["job"] == "web"
    saved = torpor.json("template", "save", "ready", "web")
    assert saved["name"] == "ready" and saved["listens"] == [["127.0.0.1", port]]
    # the template is no checkpoint of the job's: rm of the job leaves it, and the token it hands next
    # is the one a copy hands first (same random state)
    assert torpor.json("checkpoints", "web") == []
    expected = get(port)["token"]
    torpor.run("rm", "--force", "web")
    assert [t["name"] for t in torpor.json("template", "ls")] == ["ready"]

    out = torpor.run("run", "--from-template", "ready", "--name", "copy1").stdout
    assert "from template 'ready'" in out
    torpor.wait_for(lambda: serving(port), what="the copy to answer")
    first = get(port)
    # it was told it was restored (SIGCONT) and reseeded: its token is not the template's next one
    torpor.wait_log("copy1", "restored as job copy1: reseeded")
    first = get(port)
    assert first["job"] == "copy1" and first["restores"] == 1 and first["token"] != expected
    whoami = torpor.job("copy1")
    assert whoami["state"] == "running"
    # its log is its own: the template's lines are not in it, the copy's are
    log = torpor.log("copy1")
    assert "ready on" not in log and "restored as job copy1" in log
    (listed,) = torpor.json("template", "ls")
    assert listed["jobs"] == ["copy1"]
    held = torpor.job("copy1")["rss_bytes"]
    assert held > 1 << 20 and abs(listed["jobs_memory_bytes"] - held) < held / 5  # the copy's, read twice

    # a second copy after the first is gone: the same start again, under another name
    torpor.run("rm", "--force", "copy1")
    torpor.run("run", "--from-template", "ready", "--name", "copy2")
    torpor.wait_log("copy2", "restored as job copy2")
    assert get(port)["job"] == "copy2"
    torpor.run("template", "rm", "ready")
    assert torpor.json("template", "ls") == []
    # the running copy does not need its template any more
    assert get(port)["job"] == "copy2"


def test_a_copy_on_a_taken_port_is_refused_and_the_source_runs_on(torpor: Torpor) -> None:
    port = free_port()
    start_example(torpor, "web", port)
    torpor.run("template", "save", "ready", "web")
    refused = torpor.run("run", "--from-template", "ready", "--name", "copy", check=False)
    assert refused.returncode == 2
    assert f"port {port}" in refused.stderr and "--own-network" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) <= 2
    # nothing is left of the refused copy; the source was not disturbed
    assert [job["name"] for job in torpor.json("ps")] == ["web"]
    assert torpor.job("web")["state"] == "running" and get(port)["job"] == "web"


REUSEPORT_SERVER = """
import os, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(open("/proc/self/stat").read().split()[0].encode())
    c.close()
"""


def test_copies_of_a_server_with_so_reuseport_share_its_port(torpor: Torpor, tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "reuse.py"
    script.write_text(REUSEPORT_SERVER)
    torpor.run("run", "--name", "web", "--", sys.executable, "-u", str(script), str(port))
    torpor.wait_log("web", "ready")
    torpor.run("template", "save", "ready", "web")
    torpor.run("run", "--from-template", "ready", "--name", "copy")
    pids = {torpor.job(name)["pid"] for name in ("web", "copy")}
    answered: set[int] = set()
    deadline = time.monotonic() + 30
    while answered != pids and time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            answered.add(int(conn.recv(32)))
    assert answered == pids  # the kernel spread the connections over both


def test_a_template_whose_script_changed_starts_cold(torpor: Torpor, tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(EXAMPLE.read_text())
    torpor.run("run", "--name", "web", "--", sys.executable, "-u", str(script), str(port))
    torpor.wait_log("web", "ready on")
    torpor.run("template", "save", "ready", "web")
    torpor.run("rm", "--force", "web")
    script.write_text(script.read_text() + "\n# changed\n")
    out = torpor.run("run", "--from-template", "ready", "--name", "again")
    assert f"template 'ready' is stale ({script} changed size" in out.stdout
    torpor.wait_log("again", "ready on")  # it ran its command from the start
    assert get(port)["restores"] == 0


def test_warm_start_saves_a_template_once_ready_and_starts_from_it_next(torpor: Torpor) -> None:
    port = free_port()
    command = ["--", sys.executable, "-u", str(EXAMPLE), str(port)]
    out = torpor.run(
        "run", "--name", "first", "--warm-start", "--ready-when", f"port:{port}", *command
    ).stdout
    assert "cold: its warm-start template 'warm-" in out
    torpor.wait_for(lambda: len(torpor.json("template", "ls")) == 1, what="the warm-start template")
    (template,) = torpor.json("template", "ls")
    assert template["ready_when"] == f"port:{port}" and template["source_job"] == "first"
    torpor.run("rm", "--force", "first")
    out = torpor.run(
        "run", "--name", "second", "--warm-start", "--ready-when", f"port:{port}", *command
    ).stdout
    assert f"from template '{template['name']}'" in out
    torpor.wait_log("second", "restored as job second")
    assert get(port)["job"] == "second"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["run", "--from-template", "nope"], "no template named 'nope'"),
        (["run", "--from-template", "x", "--", "true"], "give no COMMAND"),
        (["run", "--warm-start", "--", "true"], "--warm-start needs --ready-when"),
        (["run", "--warm-start", "--ready-when", "port:99999", "--", "true"], "port"),
        (["run", "--ready-when", "port:80", "--", "true"], "--ready-when goes with --warm-start"),
        (["run", "--own-network", "--", "true"], "go with --from-template"),
        (["template", "save", "bad/name", "job"], "invalid template name"),
        (["template", "save", "t", "nope"], "no job named 'nope'"),
        (["template", "rm", "nope"], "no template named 'nope'"),
    ],
)
def test_bad_template_input_is_one_line_and_exit_2(torpor: Torpor, args: list[str], said: str) -> None:
    out = torpor.run(*args, check=False)
    assert out.returncode == 2, out.stderr
    assert said in out.stderr
    assert out.stderr.startswith("torpor: error: ") and len(out.stderr.strip().splitlines()) == 1


def test_whoami_outside_a_job_says_so(torpor: Torpor) -> None:
    out = torpor.run("whoami", check=False)
    assert out.returncode == 2 and "not in a torpor job" in out.stderr


def test_a_template_of_a_job_that_does_not_run_is_refused(torpor: Torpor, tmp_path: Path) -> None:
    script = tmp_path / "quick.py"
    script.write_text(textwrap.dedent("print('done')"))
    torpor.run("run", "--name", "quick", "--", sys.executable, str(script))
    torpor.wait_state("quick", "exited")
    out = torpor.run("template", "save", "t", "quick", check=False)
    assert out.returncode == 2 and "not running" in out.stderr


def test_a_copy_without_checkpoints_of_its_own_resumes_from_its_template(torpor: Torpor) -> None:
    port = free_port()
    start_example(torpor, "web", port)
    torpor.run("template", "save", "ready", "web")
    torpor.run("rm", "--force", "web")
    torpor.run("run", "--from-template", "ready", "--name", "copy")
    torpor.wait_log("copy", "restored as job copy")
    torpor.run("stop", "copy")
    assert torpor.json("checkpoints", "copy") == []
    out = torpor.run("resume", "copy").stdout
    assert f"restored copy from {torpor.json('template', 'ls')[0]['checkpoint']}" in out
    torpor.wait_for(lambda: torpor.log("copy").count("restored as job copy") == 2, what="the second start")
    assert get(port)["job"] == "copy"
    # once it has a checkpoint of its own, that is what it resumes from
    own = torpor.json("hibernate", "copy")
    assert torpor.json("resume", "copy")["checkpoint"] == own["id"]


GHOST_HOLDER = """
import os, tempfile, time
fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="torpor-test-ghost-")
os.write(fd, b"kept while deleted")
os.unlink(path)  # open but deleted: CRIU saves it as a ghost file, and makes it again to restore it
ballast = os.urandom(160 << 20)  # restores that take long enough to overlap
print("ready", flush=True)
while True:
    time.sleep(0.1)
    os.lseek(fd, 0, 0)
    assert os.read(fd, 64) == b"kept while deleted"
"""


def test_copies_of_a_template_with_a_deleted_file_started_at_once_all_run(
    torpor: Torpor, tmp_path: Path
) -> None:
    script = tmp_path / "ghost.py"
    script.write_text(GHOST_HOLDER)
    torpor.run("run", "--name", "holder", "--", sys.executable, "-u", str(script))
    torpor.wait_log("holder", "ready")
    torpor.run("template", "save", "ghost", "holder")
    results: dict[str, int] = {}

    def start(name: str) -> None:
        results[name] = torpor.run("run", "--from-template", "ghost", "--name", name, check=False).returncode

    threads = [threading.Thread(target=start, args=(f"copy{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {f"copy{i}": 0 for i in range(4)}
    time.sleep(0.5)  # each reads its deleted file back every 0.1 s: a wrong one would have failed
    assert all(torpor.job(f"copy{i}")["state"] == "running" for i in range(4))


def test_saving_a_template_leaves_the_jobs_own_checkpoints_alone(torpor: Torpor) -> None:
    port = free_port()
    torpor.run("run", "--name", "web", "--keep", "1", "--", sys.executable, "-u", str(EXAMPLE), str(port))
    torpor.wait_log("web", f"ready on {port}")
    own = torpor.json("checkpoint", "web")["id"]
    torpor.run("template", "save", "ready", "web")
    # retention (keep 1) did not count the template's checkpoint, which is not the job's
    assert [c["id"] for c in torpor.json("checkpoints", "web")] == [own]


RW_HOLDER = """
import os, sys, time
# read-write, and not named on the command line (so not stamped): CRIU restores it only at the same size
fd = os.open(os.path.join(sys.argv[1], "data"), os.O_RDWR | os.O_CREAT)
os.write(fd, b"state")
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_template_criu_cannot_restore_here_starts_cold_and_says_why(torpor: Torpor, tmp_path: Path) -> None:
    script, data = tmp_path / "rw.py", tmp_path / "data"
    script.write_text(RW_HOLDER)
    command = ["--", sys.executable, "-u", str(script), str(tmp_path)]
    torpor.run("run", "--name", "first", "--warm-start", "--ready-when", "log:^ready$", *command)
    torpor.wait_for(lambda: len(torpor.json("template", "ls")) == 1, what="the warm-start template")
    (saved,) = torpor.json("template", "ls")
    torpor.run("rm", "--force", "first")
    with data.open("ab") as grown:  # the file the template holds read-write is not what it was
        grown.write(b" and more")
    out = torpor.run("run", "--name", "second", "--warm-start", "--ready-when", "log:^ready$", *command)
    assert "cold: its warm-start template could not be restored here" in out.stdout
    assert "criu restore failed" in out.stdout
    torpor.wait_log("second", "ready")  # it ran its command from the start
    # and saved a new template in the old one's place
    torpor.wait_for(
        lambda: [t["checkpoint"] for t in torpor.json("template", "ls")] not in ([], [saved["checkpoint"]]),
        what="a new warm-start template",
    )
    assert [t["source_job"] for t in torpor.json("template", "ls")] == ["second"]
