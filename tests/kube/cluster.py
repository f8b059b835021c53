"""A real two-node Kubernetes cluster (scripts/k8s/cluster.sh) with torpor's admission webhook and
operator running on this machine: for the tests marked ``k8s`` (tests/kube/conftest.py) and the
Kubernetes benchmark (scripts/bench_kube.py)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import JOBS, TORPOR, free_port

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "scripts/k8s/cluster.sh"
CACHE = Path(os.environ.get("TORPOR_K8S_CACHE", "/var/cache/torpor-k8s"))
WORK = Path(os.environ.get("TORPOR_K8S_WORK", "/var/tmp/torpor-k8s"))
#: the first node's address on the node network: the host, as the pods reach it (scripts/k8s/cluster.sh)
NODE_HOST = "10.254.254.1"
API_ADDRESS = f"{NODE_HOST}:16443"
#: a namespace with this label is changed by the webhook of that name (Cluster.webhook), not the session's
WEBHOOK_LABEL = "torpor.dev/test-webhook"


def kubernetes_missing() -> str | None:
    """Why a cluster cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not (CACHE / "bin/kubelet").exists():
        return f"no Kubernetes build in {CACHE} (run scripts/k8s/build.sh, or make k8s)"
    if shutil.which("kubectl") is None:
        return "no kubectl"
    return None


@dataclass
class Cluster:
    env: dict[str, str]
    #: the store volume, on the host (every node's pods see their namespace's folder of it)
    store: Path
    #: a certificate (the webhook's), for manifests that need one
    certificate: Path
    #: the session webhook's settings (webhook.json)
    webhook_config: dict[str, Any]
    #: where the session's webhooks keep their files
    folder: Path

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 180) -> str:
        result = subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def apply(self, *documents: dict[str, Any]) -> None:
        self.kubectl(
            "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": documents})
        )

    def get(self, *what: str) -> Any:
        """The objects as JSON ({} for none, with --ignore-not-found)."""
        return json.loads(self.kubectl("get", *what, "-o", "json") or "{}")

    def wait_for(
        self, predicate: Any, timeout: float = 120, what: str = "condition", story: Any = None
    ) -> Any:
        """What ``predicate`` returns once it is true; on a timeout, an AssertionError with what
        ``story()`` says (e.g. a pod's log and :meth:`story`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := predicate():
                return found
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}" + (f"\n{story()}" if story else ""))

    def running_pod(self, namespace: str, name: str, not_uid: str | None = None) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            pod = json.loads(
                self.kubectl("get", "-n", namespace, "pod", name, "-o", "json", check=False) or "{}"
            )
            if pod.get("status", {}).get("phase") == "Running" and pod["metadata"]["uid"] != not_uid:
                return pod
            return None

        found: dict[str, Any] = self.wait_for(ready, what=f"pod {namespace}/{name} to run")
        return found

    def operator_log(self) -> str:
        """What the session's operator has said so far."""
        return (self.folder / "operator.log").read_text(errors="replace")

    def logs(self, namespace: str, pod: str) -> str:
        return self.kubectl("logs", "-n", namespace, pod, check=False)

    def story(self, namespace: str, pod: str) -> str:
        """What a failed assertion about a pod should show: its containers' restarts and states, the
        log of a container that ran before the current one, and the pod's events."""
        found = self.get("pod", "-n", namespace, pod, "--ignore-not-found")
        statuses = found.get("status", {}).get("containerStatuses", []) if found else []
        lines = [f"pod {namespace}/{pod} on {found.get('spec', {}).get('nodeName') if found else '?'}"]
        lines += [
            f"container {c['name']}: {c.get('restartCount')} restarts, {c.get('state')}" for c in statuses
        ]
        if any(c.get("restartCount") for c in statuses):
            previous = self.kubectl("logs", "-n", namespace, pod, "--previous", check=False)
            lines += ["log of the previous container:", previous]
        lines += [f"event {e['reason']}: {e['message']}" for e in self.events(namespace, pod)]
        return "\n".join(lines)

    def events(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        found = self.get("events", "-n", namespace, "--field-selector", f"involvedObject.name={pod}")
        return list(found["items"])

    @contextlib.contextmanager
    def webhook(self, namespace: str, **settings: Any) -> Iterator[None]:
        """A webhook of its own for the pods of ``namespace``: the session's settings with ``settings``
        (``env`` added to the session's), instead of the session's webhook, until the block ends."""
        name = f"torpor-test-{namespace}"
        env = {**self.webhook_config.get("env", {}), **settings.pop("env", {})}
        config = {**self.webhook_config, **settings, "env": env}
        self.kubectl("label", "namespace", namespace, f"{WEBHOOK_LABEL}={name}")
        process = start_webhook(
            self, self.folder / name, config, name, {"matchLabels": {WEBHOOK_LABEL: name}}
        )
        try:
            yield
        finally:
            self.kubectl("delete", "mutatingwebhookconfiguration", name, check=False)
            process.terminate()
            process.wait(10)

    def namespace(self, name: str) -> None:
        """A namespace whose pods may tell Kubernetes what torpor did (deploy/kubernetes/pod-access.yaml)."""
        self.kubectl("create", "namespace", name)
        text = (ROOT / "deploy/kubernetes/pod-access.yaml").read_text().replace("NAMESPACE", name)
        self.kubectl("apply", "-f", "-", stdin=text)

    def remove_namespace(self, name: str) -> None:
        """Remove a namespace and all in it: what runs there is deleted at once first (a namespace deleted
        while its pods still terminate takes ~40 s more: the namespace controller backs off while they
        go), then the namespace, empty (~5 s)."""
        self.kubectl(
            "delete", "statefulsets,deployments,replicasets,replicationcontrollers,jobs,pods", "--all",
            "-n", name, "--grace-period=0", "--force", "--wait=false", check=False,
        )  # fmt: skip
        self.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", check=False)


def certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for a server on 127.0.0.1, and its key."""
    cert, key = folder / "webhook.crt", folder / "webhook.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=torpor-webhook",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def counter_statefulset(
    namespace: str, name: str, command: list[str] | None = None, opted_in: bool = True, **pod_spec: Any
) -> dict[str, Any]:
    """A StatefulSet of one pod that counts (tests/jobs/counter.py, or ``command``), opted in by its
    label, checkpointed every 3 s; its program comes from the host (the test image is an empty
    skeleton that mounts the host's /usr, and tests/jobs is mounted at /jobs)."""
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {
                    "labels": {"app": name, "torpor.dev/checkpoint": "true"},
                    "annotations": {"torpor.dev/checkpoint-every": "3s"},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "localhost/hostusr:1",
                            "imagePullPolicy": "Never",
                            "command": command or ["python3", "-u", "/jobs/counter.py"],
                            "volumeMounts": [
                                {"name": "usr", "mountPath": "/usr", "readOnly": True},
                                {"name": "jobs", "mountPath": "/jobs", "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "usr", "hostPath": {"path": "/usr", "type": "Directory"}},
                        {"name": "jobs", "hostPath": {"path": str(JOBS), "type": "Directory"}},
                    ],
                },
            },
        },
    }
    statefulset["spec"]["template"]["spec"].update(pod_spec)  # type: ignore[index]
    if not opted_in:
        del statefulset["spec"]["template"]["metadata"]["labels"]["torpor.dev/checkpoint"]  # type: ignore[index]
    return statefulset


def counter_deployment(namespace: str, name: str, **kwargs: Any) -> dict[str, Any]:
    """A Deployment of one replica of :func:`counter_statefulset`'s pod."""
    template = counter_statefulset(namespace, name, **kwargs)["spec"]["template"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": template},
    }


def start_webhook(
    cluster: Cluster, folder: Path, config: dict[str, Any], name: str, namespaces: dict[str, Any]
) -> subprocess.Popen[bytes]:
    """``torpor webhook`` on the host with ``config``, its files in ``folder``, and the
    MutatingWebhookConfiguration ``name`` that sends it the opted-in pods of the ``namespaces``
    (a namespaceSelector)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "webhook.json").write_text(json.dumps(config))
    cert, key = cluster.certificate, cluster.certificate.with_suffix(".key")
    port = free_port()
    with (folder / "webhook.log").open("wb") as log:
        process = subprocess.Popen(
            [TORPOR, "webhook", "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key),
             "--config", str(folder / "webhook.json"), "--kubeconfig", str(WORK / "cp/kubeconfig")],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # a pod created before it listens would be admitted unchanged (failurePolicy: Ignore)
        _wait_listening(port, process)
        cluster.apply(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": "pods.torpor.dev",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Ignore",
                        "timeoutSeconds": 5,
                        "namespaceSelector": namespaces,
                        "objectSelector": {"matchLabels": {"torpor.dev/checkpoint": "true"}},
                        "rules": [
                            {
                                "operations": ["CREATE"],
                                "apiGroups": [""],
                                "apiVersions": ["v1"],
                                "resources": ["pods"],
                            }
                        ],
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{port}/mutate",
                            "caBundle": base64.b64encode(cert.read_bytes()).decode(),
                        },
                    }
                ],
            }
        )
    except BaseException:
        process.terminate()
        process.wait(10)
        raise
    return process


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"torpor webhook on port {port} did not start") from None
            time.sleep(0.1)


@contextlib.contextmanager
def running(folder: Path) -> Iterator[Cluster]:
    """Bring the cluster up with the webhook and the operator (their files in ``folder``), and tear it
    all down after."""
    env = {**os.environ, "KUBECONFIG": str(WORK / "cp/kubeconfig")}
    up = subprocess.run(
        ["bash", str(CLUSTER), "up", "2"], capture_output=True, text=True, env=env, timeout=300
    )
    webhook: subprocess.Popen[bytes] | None = None
    operator: subprocess.Popen[bytes] | None = None
    try:
        if up.returncode != 0:
            raise RuntimeError(f"the cluster did not come up:\n{up.stdout}{up.stderr}")
        store = WORK / f"store-{uuid.uuid4().hex[:8]}"  # the volume every node sees
        # torpor in the pods: this checkout (its .venv, src and CRIU) and the Python the venv is made from
        config = {
            "torpor": TORPOR,
            "torpor_paths": [str(ROOT), sys.base_prefix],
            "store_host_path": str(store),
            "min_grace_s": 60,
            "hot_size": "512Mi",
            # the pods reach the apiserver at the first node's address (there is no kube-proxy here)
            "env": {"TORPOR_KUBE_API": f"https://{API_ADDRESS}"},
        }
        cert, _key = certificate(folder)
        instance = Cluster(env, store, cert, config, folder)
        instance.kubectl("apply", "-f", str(ROOT / "deploy/kubernetes/crd.yaml"))
        store.mkdir(mode=0o700)
        with (folder / "operator.log").open("wb") as log:
            operator = subprocess.Popen(
                [TORPOR, "operator", "--store", str(store), "--kubeconfig", env["KUBECONFIG"], "--interval", "1s"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        # every namespace but those a test gives a webhook of their own (Cluster.webhook)
        others = {"matchExpressions": [{"key": WEBHOOK_LABEL, "operator": "DoesNotExist"}]}
        webhook = start_webhook(instance, folder, config, "torpor-test", others)
        yield instance
    finally:
        for process in (webhook, operator):
            if process is not None:
                process.terminate()
                process.wait(10)
        down = subprocess.run(
            ["bash", str(CLUSTER), "down"], capture_output=True, text=True, env=env, timeout=300
        )
        for stale in WORK.glob("store-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if down.returncode != 0:
            raise RuntimeError(f"the cluster did not go down:\n{down.stdout}{down.stderr}")
