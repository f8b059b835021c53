"""``torpor webhook`` as the apiserver sees it: HTTPS on loopback, an AdmissionReview in, a patch out."""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import TORPOR, free_port

from .cluster import certificate
from .test_admission import pod


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[tuple[int, ssl.SSLContext]]:
    cert, key = certificate(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [TORPOR, "webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key)],
        stderr=subprocess.PIPE,
    )
    context = ssl.create_default_context(cafile=str(cert))
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
            connection.request("GET", "/healthz")
            assert connection.getresponse().read() == b"ok\n"
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "the webhook did not start"
            time.sleep(0.1)
    yield port, context
    server.terminate()
    server.communicate(timeout=10)


def post(port: int, context: ssl.SSLContext, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=5)
    connection.request("POST", "/mutate", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def test_the_webhook_answers_an_admission_review_with_the_patch(webhook: tuple[int, ssl.SSLContext]) -> None:
    port, context = webhook
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "abc", "kind": {"kind": "Pod"}, "namespace": "team-a", "object": pod()},
    }
    status, body = post(port, context, json.dumps(review).encode())
    answer = json.loads(body)
    assert status == 200 and answer["kind"] == "AdmissionReview" and answer["response"]["uid"] == "abc"
    patch = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert any(op["path"] == "/spec/containers/0/command" for op in patch)
    # what is not an AdmissionReview is allowed unchanged, and the server goes on answering
    status, body = post(port, context, b"{not json")
    assert status == 200 and json.loads(body)["response"]["allowed"] is True


def test_the_webhook_refuses_to_start_without_its_certificate_in_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [TORPOR, "webhook", "--listen", "127.0.0.1:0", "--tls-cert", str(tmp_path / "no.crt"),
         "--tls-key", str(tmp_path / "no.key")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        result.stderr.startswith("torpor: error: cannot load the TLS certificate")
        and result.stderr.count("\n") == 1
    )
