"""``torpor webhook``: the mutating admission webhook, over HTTPS (``POST /mutate``, ``GET /healthz``).

Each AdmissionReview of a pod gets :func:`torpor.core.admission.mutate`'s patch, with the namespace's
UID read from the API server for an opted-in pod (its service account may ``get`` namespaces: a pod
cannot learn it otherwise, and tells its namespace from an earlier one of the same name by it). It never refuses a
pod: one it cannot change, or a request it cannot read, is allowed unchanged with a warning (and the
webhook configuration says ``failurePolicy: Ignore`` with a short timeout, so a webhook that is down
refuses nothing either).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import ssl
import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from torpor.adapters import kubeapi
from torpor.core import admission
from torpor.errors import UsageError
from torpor.settings import Settings

#: the largest AdmissionReview read (the apiserver's own limit on an object is 1.5 MiB)
MAX_BODY = 3 << 20


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "webhook",
        help="serve the Kubernetes admission webhook that puts opted-in pods under 'torpor pod'",
        description=(
            "Serve the mutating admission webhook over HTTPS: pods labelled torpor.dev/checkpoint=true "
            "get their main container run under 'torpor pod', with torpor, the store, the hot tier and "
            "the privileges checkpointing needs (docs/kubernetes.md). Pods it cannot handle are admitted "
            "unchanged with a warning."
        ),
    )
    p.add_argument("--listen", default="0.0.0.0:8443", metavar="HOST:PORT", help="default 0.0.0.0:8443")
    p.add_argument("--tls-cert", required=True, metavar="FILE", help="the server's certificate (PEM)")
    p.add_argument("--tls-key", required=True, metavar="FILE", help="its private key (PEM)")
    p.add_argument("--config", metavar="FILE", help="a JSON file of settings (docs/kubernetes.md)")
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="where it reads namespaces' UIDs outside the cluster (default: its service account)",
    )
    p.set_defaults(func=cmd_webhook, needs_settings=True)


def load_config(path: str | None) -> admission.WebhookConfig:
    if path is None:
        return admission.WebhookConfig()
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        return admission.WebhookConfig.from_dict(data)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"cannot read the webhook settings {path}: {exc}") from exc


def review_response(
    review: Any, config: admission.WebhookConfig, namespace_uid: Callable[[str], str | None] = lambda _: None
) -> dict[str, Any]:
    """The AdmissionReview to answer ``review`` with: always allowed, patched where torpor applies.
    ``namespace_uid``: a namespace's UID by its name (None where it cannot be read)."""
    request = review.get("request") if isinstance(review, dict) else None
    uid = request.get("uid", "") if isinstance(request, dict) else ""
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    try:
        if not isinstance(request, dict):
            raise ValueError("no request in the AdmissionReview")
        obj = request.get("object")
        if request.get("kind", {}).get("kind") != "Pod" or not isinstance(obj, dict):
            raise ValueError("not a pod")
        namespace = str(request.get("namespace") or (obj.get("metadata") or {}).get("namespace") or "")
        known = namespace_uid(namespace) if admission.opted_in(obj) else None
        mutation = admission.mutate(obj, namespace, config, known)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        mutation = admission.Mutation([], [f"torpor: pod admitted without checkpointing: {exc}"])
    if mutation.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(mutation.patch).encode()).decode()
    if mutation.warnings:
        response["warnings"] = mutation.warnings
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


#: seconds a namespace's UID may take to read: well within the apiserver's 5 s for the whole review
LOOKUP_TIMEOUT_S = 2.0


def namespace_uids(api: kubeapi.KubeAPI | None) -> Callable[[str], str | None]:
    """A namespace's UID by its name, read from the API server at each review (never kept: a namespace
    made again under the same name has a new one); None where it cannot be read, said in the log."""

    def uid(namespace: str) -> str | None:
        if api is None:
            return None
        try:
            found = api.get(f"/api/v1/namespaces/{namespace}")
        except kubeapi.KubeError as exc:
            print(f"webhook: cannot read namespace {namespace}'s UID: {exc}", file=sys.stderr, flush=True)
            return None
        value = ((found or {}).get("metadata") or {}).get("uid")
        return value if isinstance(value, str) and value else None

    return uid


def make_server(
    listen: str,
    cert: str,
    key: str,
    config: admission.WebhookConfig,
    namespace_uid: Callable[[str], str | None] = lambda _: None,
) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")
    try:
        address = (host.strip("[]") or "0.0.0.0", int(port))
    except ValueError:
        raise UsageError(f"--listen '{listen}' is not HOST:PORT") from None

    class Handler(BaseHTTPRequestHandler):
        server_version = "torpor-webhook"
        timeout = 10  # a client that stalls (also in its TLS handshake) holds one thread, not the server

        def log_message(self, format: str, *args: Any) -> None:
            print(f"webhook: {self.address_string()} {format % args}", file=sys.stderr, flush=True)

        def _reply(self, status: HTTPStatus, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._reply(HTTPStatus.OK, b"ok\n", "text/plain")
            else:
                self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

        def do_POST(self) -> None:
            if self.path.split("?")[0] != "/mutate":
                self._reply(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY:
                self._reply(HTTPStatus.BAD_REQUEST, b'{"error": "bad Content-Length"}')
                return
            try:
                review = json.loads(self.rfile.read(length))
            except ValueError:
                review = None
            self._reply(HTTPStatus.OK, json.dumps(review_response(review, config, namespace_uid)).encode())

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") from exc
    try:
        server = ThreadingHTTPServer(address, Handler)
    except OSError as exc:
        raise UsageError(f"cannot listen on {listen}: {exc.strerror}") from exc
    server.daemon_threads = True
    # the handshake in the request's thread, not in accept()
    server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    return server


def cmd_webhook(_settings: Settings, args: argparse.Namespace) -> int:
    config = load_config(args.config)
    try:
        api = kubeapi.KubeAPI.of(args.kubeconfig)
    except kubeapi.KubeError as exc:
        raise UsageError(str(exc)) from None
    if api is not None:
        api = dataclasses.replace(api, timeout_s=LOOKUP_TIMEOUT_S)
    server = make_server(args.listen, args.tls_cert, args.tls_key, config, namespace_uids(api))
    if api is None:
        print(
            "webhook: no service account token: pods do not learn their namespace's UID, so a namespace "
            "made again under an old name is not told apart from it",
            file=sys.stderr,
            flush=True,
        )
    print(f"webhook: serving on https://{args.listen}/mutate", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
