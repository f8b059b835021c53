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
    pass


@dataclass(frozen=True)
class KubeAPI:
    url: str
    token: str
    context: ssl.SSLContext

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

    def _call(self, method: str, path: str, body: dict[str, Any], content_type: str) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as response:
                data = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = ""
            with contextlib.suppress(ValueError, OSError, AttributeError):  # the status, if it sent one
                detail = json.loads(exc.read()).get("message", "")
            raise KubeError(f"{method} {path}: {exc.code} {detail or exc.reason}") from None
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
        self._call(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{pod}",
            {"metadata": {"annotations": annotations}},
            "application/merge-patch+json",
        )
