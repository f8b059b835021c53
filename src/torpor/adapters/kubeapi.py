"""The few calls a pod's supervisor makes to the Kubernetes API: an event on its pod, an annotation on it.

With the pod's service account (its token and the cluster's CA, mounted by Kubernetes), at
``$TORPOR_KUBE_API`` or else the in-cluster address (``$KUBERNETES_SERVICE_HOST``). Every call has a
short timeout and raises :class:`KubeError` with one line; the caller decides what a failure means
(for the supervisor: nothing but a line in its log — the job comes first).
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 5.0


class KubeError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        #: the HTTP status the API answered with (None: no answer)
        self.status = status


@dataclass(frozen=True)
class KubeAPI:
    url: str
    #: a bearer token, or "" where the TLS context carries a client certificate
    token: str
    context: ssl.SSLContext
    #: seconds a call may take (the webhook's lookups: less than its own timeout in the apiserver)
    timeout_s: float = TIMEOUT_S

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeAPI:
        """The API as a kubeconfig file's current context sees it (files named in it, not inline data)."""
        import yaml  # only the operator, run outside the cluster, needs it

        try:
            config = yaml.safe_load(path.read_text()) or {}
            context_name = config.get("current-context")
            context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
            cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
            user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
            tls = ssl.create_default_context(cafile=cluster.get("certificate-authority"))
            if user.get("client-certificate"):
                tls.load_cert_chain(user["client-certificate"], user["client-key"])
            return cls(str(cluster["server"]).rstrip("/"), str(user.get("token", "")), tls)
        except (OSError, ValueError, KeyError, StopIteration, TypeError, ssl.SSLError, yaml.YAMLError) as exc:
            raise KubeError(f"cannot use the kubeconfig {path}: {exc}") from None

    @classmethod
    def of(cls, kubeconfig: str | None) -> KubeAPI | None:
        """The API through ``kubeconfig`` when given, else the pod's service account (None outside a
        pod); KubeError for a kubeconfig that cannot be used."""
        return cls.from_kubeconfig(Path(kubeconfig)) if kubeconfig else cls.in_cluster()

    @classmethod
    def in_cluster(cls, env: dict[str, str] | None = None, account: Path = SERVICE_ACCOUNT) -> KubeAPI | None:
        """The API as the pod's service account sees it; None outside a pod (no token, no address)."""
        env = dict(os.environ) if env is None else env
        url = env.get("TORPOR_KUBE_API")
        if not url and env.get("KUBERNETES_SERVICE_HOST"):
            host = env["KUBERNETES_SERVICE_HOST"]
            host = f"[{host}]" if ":" in host else host
            url = f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"
        try:
            token = (account / "token").read_text().strip()
        except OSError:
            return None
        if not url or not token:
            return None
        context = ssl.create_default_context(cafile=str(account / "ca.crt"))
        return cls(url.rstrip("/"), token, context)

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Content-Type": content_type}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers=headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as response:
                data = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = ""
            with contextlib.suppress(ValueError, OSError, AttributeError):  # the status, if it sent one
                detail = json.loads(exc.read()).get("message", "")
            raise KubeError(f"{method} {path}: {exc.code} {detail or exc.reason}", exc.code) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise KubeError(f"{method} {path}: {reason}") from None
        return data if isinstance(data, dict) else {}

    def event(
        self, namespace: str, pod: str, uid: str, reason: str, message: str, warning: bool = False
    ) -> None:
        """An event on the pod, as ``kubectl describe pod`` shows it."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._call(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{pod}.", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "namespace": namespace,
                    "uid": uid,
                },
                "reason": reason,
                "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": "torpor"},
                "reportingComponent": "torpor",
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
            "application/json",
        )

    def annotate(self, namespace: str, pod: str, annotations: dict[str, str]) -> None:
        self.merge(f"/api/v1/namespaces/{namespace}/pods/{pod}", {"metadata": {"annotations": annotations}})

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or None if there is none (404)."""
        try:
            return self._call("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, body)

    def merge(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", path, body, "application/merge-patch+json")

    def delete(self, path: str) -> None:
        try:
            self._call("DELETE", path)
        except KubeError as exc:
            if exc.status != 404:
                raise
