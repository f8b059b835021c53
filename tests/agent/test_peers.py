"""Peers (issue 30, its first part): an agent serves its API with TLS beyond loopback, and ``torpor peers``
adds, lists and removes other machines' agents. Real agents, real TLS (a self-signed certificate made by
the test), and a real second node: an agent in a network namespace of the test's own, reached over a veth
pair that the test then takes down.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import TORPOR, Torpor, free_port, python_job

from .conftest import AgentProcess, ip

pytestmark = pytest.mark.timeout(120)

TOKEN = "the-peer-token-of-the-test-0123456789"


def certificate(folder: Path, *addresses: str, ca: bool = True) -> tuple[Path, Path]:
    """A self-signed certificate for ``addresses`` and its key (0600), in ``folder``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "torpor test peer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def secret(path: Path, text: str = TOKEN) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.slow  # two agents, one after the other
def test_an_agent_serves_tls_beyond_loopback_only_and_a_peer_is_added_listed_and_removed(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    cert, key = certificate(tmp_path, "127.0.0.1")
    token = secret(tmp_path / "token")
    port = free_port()
    refused = other.run("agent", "--listen", f"0.0.0.0:{port}", "--token-file", str(token), check=False)
    assert refused.returncode == 2 and "clear text" in refused.stderr
    listen = ["--listen", f"127.0.0.1:{port}", "--token-file", str(token)]
    half = other.run("agent", *listen, "--tls-cert", str(cert), check=False)
    assert half.returncode == 2 and "go together" in half.stderr

    peer = AgentProcess(other, tmp_path / "peer-agent.log")
    try:
        peer.start(*listen, "--tls-cert", str(cert), "--tls-key", str(key), "--memory-budget", "1G")
        url = f"https://127.0.0.1:{port}"
        answer = httpx.get(
            url + "/v1/node",
            verify=ssl.create_default_context(cafile=str(cert)),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert answer.status_code == 200 and answer.json()["memory"]["budget"] == 1 << 30
        with pytest.raises(httpx.HTTPError):  # no clear text on that port
            httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=5)
        assert peer.api.get("/v1/health").status_code == 200  # the unix socket is served as before

        untrusted = torpor.run("peers", "add", "b", url, "--token-file", str(token), check=False)
        assert (
            untrusted.returncode == 3
            and "not one to trust" in untrusted.stderr
            and "not added" in untrusted.stderr
        )
        wrong = torpor.run(
            "peers",
            "add",
            "b",
            url,
            "--token-file",
            str(secret(tmp_path / "wrong", "x" * 32)),
            "--ca-file",
            str(cert),
            check=False,
        )
        assert wrong.returncode == 3 and "wrong bearer token" in wrong.stderr
        clear = torpor.run(
            "peers", "add", "b", f"http://127.0.0.1:{port}", "--token-file", str(token), check=False
        )
        assert clear.returncode == 3 and "wants https://" in clear.stderr
        assert torpor.json("peers") == []

        added = torpor.run("peers", "add", "b", url + "/", "--token-file", str(token), "--ca-file", str(cert))
        assert "added peer b (https://127.0.0.1:" in added.stdout
        again = torpor.run(
            "peers", "add", "b", url, "--token-file", str(token), "--ca-file", str(cert), check=False
        )
        assert again.returncode == 2 and "--replace" in again.stderr

        other.run("run", "--name", "sleeper", "--", "sleep", "300")
        [seen] = torpor.json("peers")
        assert seen["name"] == "b" and seen["url"] == url and seen["reachable"] is True
        assert seen["memory"]["budget"] == 1 << 30 and seen["jobs"] == {"running": 1}
        assert seen["draining"] is None and seen["version"]
        assert (
            seen["arch"] and seen["kernel"] and "criu" in seen and seen["differs"] == []
        )  # the same machine
        listing = torpor.run("peers").stdout
        assert "1 running" in listing and TOKEN not in listing and TOKEN not in json.dumps(seen)
        # the same agent again, trusted by its certificate's fingerprint instead of a CA file
        torpor.run("peers", "add", "c", url, "--token-file", str(token), "--fingerprint", sha256_of(cert))
        pinned = {each["name"]: each for each in torpor.json("peers")}["c"]
        assert pinned["reachable"] is True and pinned["pinned"].startswith("sha256:")
        torpor.run("peers", "rm", "c")

        peer.stop()
        [down] = torpor.json("peers", "ls")
        assert down["reachable"] is False and "cannot connect" in down["problem"]
        assert "no: cannot connect" in torpor.run("peers").stdout

        assert torpor.run("peers", "rm", "b").stdout.strip() == "removed peer b"
        gone = torpor.run("peers", "rm", "b", check=False)
        assert gone.returncode == 2 and "no peer named 'b'" in gone.stderr
    finally:
        peer.close()
        other.run("rm", "--force", "sleeper", check=False)


class _NotAnAgent(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>\n<p>hello</p>\n</html>\n" if self.path == "/v1/node" else b"<html>\nno\n</html>\n"
        self.send_response(200 if self.path == "/v1/node" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("path", ["/v1/node", "/elsewhere"])
def test_a_server_that_is_no_agent_is_not_added_and_said_so_in_one_line(
    torpor: Torpor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAnAgent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        if path != "/v1/node":  # a server whose every page is a 404 of many lines
            monkeypatch.setattr(_NotAnAgent, "do_GET", _not_found)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = torpor.run(
            "peers", "add", "web", url, "--token-file", str(secret(tmp_path / "t")), check=False
        )
        assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr and "not added" in result.stderr
        assert (
            "not as a torpor agent does" in result.stderr
            or "not the answer of a torpor agent" in result.stderr
        )
        assert torpor.json("peers") == []
    finally:
        server.shutdown()
        server.server_close()


def _not_found(handler: http.server.BaseHTTPRequestHandler) -> None:
    body = b"<html>\n<p>not here</p>\n</html>\n"
    handler.send_response(404)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.root("to make a network namespace and a veth pair")
def test_a_peer_on_another_node_is_reachable_over_tls_and_unreachable_in_one_line_once_its_link_is_cut(
    torpor: Torpor, other: Torpor, tmp_path: Path, node: tuple[str, str, str]
) -> None:
    netns, link, address = node
    cert, key = certificate(tmp_path, address)
    token = secret(tmp_path / "token")
    port = free_port()
    with open(tmp_path / "node-agent.log", "wb") as log:
        agent = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns,
                TORPOR,
                "agent",
                "--round",
                "200ms",
                "--listen",
                f"{address}:{port}",
                "--token-file",
                str(token),
                "--tls-cert",
                str(cert),
                "--tls-key",
                str(key),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=other.env,
        )
    try:
        url = f"https://{address}:{port}"
        deadline = time.monotonic() + 30
        while torpor.run(
            "peers", "add", "node2", url, "--token-file", str(token), "--ca-file", str(cert), check=False
        ).returncode:
            assert agent.poll() is None, (tmp_path / "node-agent.log").read_text()
            assert time.monotonic() < deadline, "the node's agent never answered"
            time.sleep(0.3)
        [seen] = torpor.json("peers")
        assert seen["reachable"] is True and seen["jobs"] == {}

        ip("link", "set", link, "down")  # the cable is cut
        started = time.monotonic()
        listed = torpor.run("peers")
        took = time.monotonic() - started
        assert listed.returncode == 0 and "node2" in listed.stdout and "no: " in listed.stdout, listed.stdout
        assert took < 30, f"torpor peers took {took:.1f} s with the peer cut off"
        failed = torpor.run(
            "peers", "add", "again", url, "--token-file", str(token), "--ca-file", str(cert), check=False
        )
        assert failed.returncode == 3 and len(failed.stderr.strip().splitlines()) == 1
        assert "Traceback" not in failed.stderr and "peer again" in failed.stderr

        ip("link", "set", link, "up")
        torpor.wait_for(lambda: torpor.json("peers")[0]["reachable"] is True, 30, "the peer reachable again")
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def sha256_of(cert: Path) -> str:
    """The fingerprint as openssl prints it: upper-case pairs joined by colons."""
    digest = x509.load_pem_x509_certificate(cert.read_bytes()).fingerprint(hashes.SHA256()).hex().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A TLS server on loopback that is no agent, with a certificate for another address (192.0.2.1)."""
    cert, key = certificate(tmp_path, "192.0.2.1", ca=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAnAgent)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert
    finally:
        server.shutdown()
        server.server_close()


def test_a_peer_pinned_by_another_certificates_fingerprint_is_refused_in_one_line_and_not_added(
    torpor: Torpor, tmp_path: Path, tls_server: tuple[str, Path]
) -> None:
    url, cert = tls_server
    token = str(secret(tmp_path / "t"))
    (tmp_path / "another").mkdir()
    another, _ = certificate(tmp_path / "another", "127.0.0.1")
    wrong = torpor.run(
        "peers", "add", "p", url, "--token-file", token, "--fingerprint", sha256_of(another), check=False
    )
    assert wrong.returncode == 3 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    seen = sha256_of(cert).replace(":", "").lower()
    assert (
        f"has the fingerprint sha256:{seen}, not the sha256:" in wrong.stderr and "not added" in wrong.stderr
    )
    assert torpor.json("peers") == []


def test_a_pinned_certificate_is_trusted_whatever_host_it_names_and_the_answer_is_still_checked(
    torpor: Torpor, tmp_path: Path, tls_server: tuple[str, Path]
) -> None:
    url, cert = tls_server
    token = str(secret(tmp_path / "t"))
    # by its CA file, the certificate names another host: refused
    named = torpor.run("peers", "add", "p", url, "--token-file", token, "--ca-file", str(cert), check=False)
    assert named.returncode == 3 and "not added" in named.stderr
    # pinned, the TLS is trusted: what stops it now is that the server is no agent
    pinned = torpor.run(
        "peers", "add", "p", url, "--token-file", token, "--fingerprint", sha256_of(cert), check=False
    )
    assert pinned.returncode == 3 and "not as a torpor agent does" in pinned.stderr, pinned.stderr
    pin = "sha256:" + sha256_of(cert).replace(":", "").lower()
    kept = torpor.run(
        "peers", "add", "p", url, "--token-file", token, "--fingerprint", pin, "--no-check", "--json"
    )
    assert json.loads(kept.stdout)["pinned"] == pin
    [listed] = torpor.json("peers")
    assert listed["pinned"] == pin
    assert "not as a torpor agent does" in listed["problem"]  # TLS passed, as pinned


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--fingerprint", "ab:cd"], "bad --fingerprint 'ab:cd'"),
        (["--fingerprint", "0" * 64, "--ca-file", "x.pem"], "give one"),
    ],
)
def test_a_bad_fingerprint_or_two_ways_of_trust_are_usage_errors(
    torpor: Torpor, tmp_path: Path, flags: list[str], says: str
) -> None:
    result = torpor.run(
        "peers",
        "add",
        "p",
        "https://127.0.0.1:1",
        "--token-file",
        str(secret(tmp_path / "t")),
        *flags,
        check=False,
    )
    assert result.returncode == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    clear = torpor.run(
        "peers",
        "add",
        "p",
        "http://127.0.0.1:1",
        "--token-file",
        str(tmp_path / "t"),
        "--fingerprint",
        "0" * 64,
        check=False,
    )
    assert clear.returncode == 2 and "--fingerprint goes with an https:// URL" in clear.stderr


SERVER_JOB = """\
import socket, sys, time
data = open(sys.argv[1], "rb")  # read on, never written
listener = socket.socket()
listener.bind(("127.0.0.1", int(sys.argv[2])))
listener.listen()
connection = socket.create_connection(("127.0.0.1", int(sys.argv[3])))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.mark.slow  # a peer's agent and two jobs
def test_migrate_check_asks_the_peer_and_names_what_stops_a_move_before_anything_is_frozen(
    torpor: Torpor, other: Torpor, tmp_path: Path
) -> None:
    token = secret(tmp_path / "token")
    port = free_port()
    peer = AgentProcess(other, tmp_path / "peer-agent.log")
    remote = socket.create_server(("127.0.0.1", 0))  # what the job keeps a connection to
    try:
        peer.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", "1G")
        torpor.run("peers", "add", "b", f"http://127.0.0.1:{port}", "--token-file", str(token))
        anyone = httpx.post(f"http://127.0.0.1:{port}/v1/arrivals/look", json={"paths": ["/etc/shadow"]})
        assert anyone.status_code == 401  # what a peer may ask needs its token too
        torpor.run("run", "--name", "plain", *python_job("counter.py"))
        (tmp_path / "data.bin").write_bytes(b"x" * 4096)
        (tmp_path / "server.py").write_text(SERVER_JOB)
        listens = free_port()
        torpor.run(
            "run", "--name", "srv", "--", sys.executable, "-u", str(tmp_path / "server.py"),
            str(tmp_path / "data.bin"), str(listens), str(remote.getsockname()[1]),
        )  # fmt: skip
        torpor.wait_log("plain", "step 1")
        torpor.wait_log("srv", "ready")

        fits = torpor.run("migrate", "plain", "--to", "b", "--check")
        assert "job 'plain' could move to peer b:" in fits.stdout, fits.stdout
        report = torpor.json("migrate", "plain", "--to", "b", "--check")
        assert report["may_move"] is True and report["refusals"] == [] and report["memory"] > 0
        assert report["read_files"] >= 1  # the interpreter, at least: the same file on the peer

        refused = torpor.run("migrate", "srv", "--to", "b", "--check", check=False)
        assert refused.returncode == 3 and "job 'srv' cannot move to peer b" in refused.stderr
        # the peer here shares this network namespace: the job's own port is taken there
        assert f"port {listens} taken on peer b" in refused.stderr
        assert (
            "established TCP connections cannot follow the job to another address: 127.0.0.1:"
            in refused.stderr
        )
        assert (
            f"-> 127.0.0.1:{remote.getsockname()[1]}" in refused.stderr and "Traceback" not in refused.stderr
        )
        dropping = torpor.run(
            "migrate", "srv", "--to", "b", "--check", "--drop-connections", "--json", check=False
        )
        assert dropping.returncode == 3
        assert json.loads(dropping.stdout)["refusals"] == [f"port {listens} taken on peer b"]
        assert torpor.job("srv")["state"] == "running" and torpor.job("plain")["state"] == "running"

        unknown = torpor.run("migrate", "plain", "--to", "nowhere", "--check", check=False)
        assert unknown.returncode == 2 and "no peer named 'nowhere'" in unknown.stderr

        peer.stop()
        gone = torpor.run("migrate", "plain", "--to", "b", "--check", check=False)
        assert gone.returncode == 3 and "peer b cannot be asked: cannot connect" in gone.stderr
        assert torpor.job("plain")["state"] == "running"
    finally:
        remote.close()
        peer.close()
        for job in ("plain", "srv"):
            torpor.run("rm", "--force", job, check=False)
