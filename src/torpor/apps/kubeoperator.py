"""``torpor operator``: a TorporIdentity resource for each identity in the store, and an identity's
checkpoints removed when the controller whose pods it was is deleted.

A reconcile loop over the store (the volume the pods share, mounted here too) every ``--interval``:

- each identity (``torpor.core.podstore.slots``) has a namespaced ``TorporIdentity`` (torpor.dev/v1alpha1,
  ``deploy/kubernetes/crd.yaml``; its name: ``torpor.policy.pod.resource_name``) whose ``status``
  lists its slots: the pod that holds or held each, its node, the job's state, its checkpoints (id,
  kind, time, size, freeze) and the latest one;
- an identity whose controller (the StatefulSet, ReplicaSet or Job its pods had) or whose namespace
  no longer exists, or whose namespace was made again since (its UID differs from the one its pods
  recorded), has its checkpoints and folder deleted (each slot taken first: a pod still
  hibernating is waited for), then its resource (``torpor.policy.pod.orphaned``); with the webhook's
  settings (``--config``) and an S3 cold tier, each slot's prefix in the bucket is emptied too
  (:class:`S3Purge`);
- a resource whose identity is no longer in the store is deleted;
- ``torpor.dev/hibernate: "true"`` keeps a pod hibernated until it goes (:mod:`torpor.apps.kubehold`).

It keeps nothing of its own: killed and started again, it carries on from the store and the API. A
reconcile loop rather than a watch: an owner deleted while the operator was down is still found.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from torpor.adapters import kubeapi
from torpor.adapters.s3 import S3Backend
from torpor.apps import kubehold
from torpor.apps.agent.commands import seconds
from torpor.apps.webhook import load_config
from torpor.core import admission, podstore
from torpor.core.store.config import StoreConfig
from torpor.errors import TorporError, UsageError
from torpor.policy import pod as pod_policy
from torpor.settings import Settings

GROUP, VERSION, PLURAL, KIND = kubehold.GROUP, kubehold.VERSION, kubehold.PLURAL, kubehold.KIND
#: where each controller kind is in the API
OWNER_PATHS = {
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets/{name}",
    "ReplicaSet": "/apis/apps/v1/namespaces/{ns}/replicasets/{name}",
    "DaemonSet": "/apis/apps/v1/namespaces/{ns}/daemonsets/{name}",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs/{name}",
    "ReplicationController": "/api/v1/namespaces/{ns}/replicationcontrollers/{name}",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "operator",
        help="keep a TorporIdentity resource per identity, and remove the checkpoints of deleted controllers",
        description=(
            "The Kubernetes operator: every INTERVAL it reads the store the pods share and keeps a "
            "TorporIdentity resource (torpor.dev/v1alpha1) per identity with its slots' pods, nodes, states "
            "and checkpoints; an identity whose StatefulSet, ReplicaSet or Job was deleted has its "
            "checkpoints removed; a pod, controller or TorporIdentity annotated torpor.dev/hibernate=true is "
            "hibernated and kept so (its controller scaled to zero, or a bare pod deleted) until the "
            "annotation goes. In the cluster it uses its service account; outside, --kubeconfig."
        ),
    )
    p.add_argument("--store", required=True, help="the store folder the pods share (all namespaces)")
    p.add_argument("--kubeconfig", help="a kubeconfig (default: the in-cluster service account)")
    p.add_argument(
        "--config",
        help="the webhook's settings (webhook.json): with s3_url, an identity's images in S3 are deleted too, "
        "with the credentials of the Secret s3_secret in its namespace",
    )
    p.add_argument("--interval", type=seconds, default=10.0, metavar="DURATION", help="default 10s")
    p.add_argument("--once", action="store_true", help="reconcile once and exit")
    p.set_defaults(func=cmd_operator, needs_settings=True)


def _say(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} operator: {text}", file=sys.stderr, flush=True)


def _stamp(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def status_of(slots: list[podstore.SlotState]) -> dict[str, Any]:
    """The resource's status for an identity's slots."""
    listed = []
    latest: tuple[float, str] | None = None
    for slot in slots:
        checkpoints = [
            {
                "id": c.id,
                "kind": str(c.kind),
                "created": _stamp(c.created_at),
                "sizeBytes": c.size_bytes,
                "freezeSeconds": round(c.freeze_s, 4),
            }
            for c in slot.checkpoints
        ]
        for c in slot.checkpoints:
            latest = max(latest or (0.0, ""), (c.created_at, c.id))
        listed.append(
            {
                "slot": slot.slot,
                "pod": slot.pod.get("name", ""),
                "node": slot.pod.get("node", ""),
                "held": slot.held,
                "state": slot.state or "none",
                "checkpoints": checkpoints,
            }
        )
    status: dict[str, Any] = {"slots": listed, "observedAt": _stamp(time.time())}
    if latest is not None:
        status["lastCheckpoint"] = {"id": latest[1], "created": _stamp(latest[0])}
    return status


class S3Purge:
    """Empties the S3 prefix of a slot of a removed identity (:data:`torpor.core.podstore.PurgeS3`): the
    prefix and endpoint the webhook's settings give it (``torpor.policy.pod.s3_clean_up``), with the
    credentials of the Secret ``s3_secret`` in the identity's namespace (without one, boto3's chain)."""

    def __init__(self, api: kubeapi.KubeAPI, config: admission.WebhookConfig) -> None:
        self.api = api
        self.config = config

    def __call__(self, identity: str, n: int, slot: StoreConfig) -> int:
        url = slot.url or ""
        why = pod_policy.s3_clean_up(
            url, slot.s3_endpoint, self.config.s3_url, self.config.s3_endpoint, identity, n
        )
        if why is not None:
            raise TorporError(f"{pod_policy.slot_name(n)} of {identity} is not removed: {why}")
        parts = urlsplit(url)
        backend = S3Backend(
            parts.netloc, parts.path.strip("/"), self.config.s3_endpoint, 2, self._credentials(identity)
        )
        try:
            return backend.purge()
        finally:
            backend.close()

    def _credentials(self, identity: str) -> tuple[str, str] | None:
        name = self.config.s3_secret
        if name is None:
            return None
        namespace = identity.split("/")[0]
        secret = self.api.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        if secret is None:
            raise TorporError(f"the Secret {namespace}/{name} with the S3 credentials is gone")
        data = secret.get("data") or {}
        try:
            return (
                base64.b64decode(data[admission.S3_SECRET_KEYS["TORPOR_S3_ACCESS_KEY_ID"]]).decode(),
                base64.b64decode(data[admission.S3_SECRET_KEYS["TORPOR_S3_SECRET_ACCESS_KEY"]]).decode(),
            )
        except (KeyError, TypeError, ValueError):
            raise TorporError(f"the Secret {namespace}/{name} lacks the S3 credentials") from None


class Operator:
    def __init__(
        self,
        store: Path,
        settings: Settings,
        api: kubeapi.KubeAPI,
        config: admission.WebhookConfig | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.api = api
        self.purge_s3 = S3Purge(api, config) if config is not None and config.s3_url else None
        self.holder = kubehold.Holder(api, store / ".operator" / "hibernated", _say)

    def _path(self, namespace: str, name: str = "") -> str:
        base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
        return f"{base}/{name}" if name else base

    def reconcile(self) -> None:
        by_identity: dict[str, list[podstore.SlotState]] = defaultdict(list)
        for slot in podstore.slots(self.store):
            by_identity[slot.identity].append(slot)
        for identity, slots in sorted(by_identity.items()):
            try:
                self._identity(identity, slots)
            except (kubeapi.KubeError, TorporError) as exc:
                _say(f"{identity}: {exc}")
        resources = (self.api.get(f"/apis/{GROUP}/{VERSION}/{PLURAL}") or {}).get(
            "items", []
        )  # all namespaces'
        self._forget_gone(set(by_identity), resources)
        self.holder.reconcile(resources, self._path)

    def _identity(self, identity: str, slots: list[podstore.SlotState]) -> None:
        namespace, name = identity.split("/")[0], pod_policy.resource_name(identity)
        owners = {slot.pod.get("owner", "") for slot in slots} - {""}
        owner = kubehold.parse_owner(sorted(owners)[0]) if owners else None
        found = self.api.get(f"/api/v1/namespaces/{namespace}")
        namespace_exists = found is not None
        current = str(((found or {}).get("metadata") or {}).get("uid") or "")
        remade = any(pod_policy.remade_namespace(slot.pod.get("namespace_uid"), current) for slot in slots)
        exists = True
        if namespace_exists and not remade and owner is not None and owner.kind in OWNER_PATHS:
            exists = self.api.get(OWNER_PATHS[owner.kind].format(ns=namespace, name=owner.name)) is not None
        if pod_policy.orphaned(owner, exists, namespace_exists, remade) and not any(
            slot.held for slot in slots
        ):
            deleted = podstore.remove_identity(self.store, identity, self.settings, purge_s3=self.purge_s3)
            if remade:
                gone = f"the namespace {namespace} it was of (made again since)"
            elif namespace_exists and owner is not None:
                self.api.delete(self._path(namespace, name))
                gone = f"its {owner.kind} {owner.name}"
            else:
                gone = f"its namespace {namespace}"  # and its resources with it
            _say(f"{identity}: {gone} is gone: removed {len(deleted)} checkpoint(s)")
            return
        # a bare pod's: no owner field (the 1.20 API server refused an empty one as null)
        spec = {"identity": identity, **({"owner": f"{owner.kind}/{owner.name}"} if owner else {})}
        if self.api.get(self._path(namespace, name)) is None:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "metadata": {"name": name, "namespace": namespace},
                "spec": spec,
            }
            self.api.create(self._path(namespace), body)
            _say(f"{identity}: made {KIND} {namespace}/{name}")
        self.api.merge(f"{self._path(namespace, name)}/status", {"status": status_of(slots)})

    def _forget_gone(self, identities: set[str], resources: list[dict[str, Any]]) -> None:
        for item in resources:
            identity = str((item.get("spec") or {}).get("identity", ""))
            if identity not in identities:
                namespace, name = str(item["metadata"]["namespace"]), str(item["metadata"]["name"])
                self.api.delete(self._path(namespace, name))
                _say(f"{identity or name}: no longer in the store: {KIND} {namespace}/{name} deleted")


def cmd_operator(settings: Settings, args: argparse.Namespace) -> int:
    store = Path(args.store)
    if not store.is_dir():
        raise UsageError(f"the store {store} is not a folder")
    try:
        api = kubeapi.KubeAPI.of(args.kubeconfig)
    except kubeapi.KubeError as exc:
        raise UsageError(str(exc)) from None
    if api is None:
        raise UsageError("not in a pod (no service account token): give --kubeconfig")
    operator = Operator(store, settings, api, load_config(args.config) if args.config else None)
    _say(f"reconciling {store} every {args.interval:g} s")
    while True:
        try:
            operator.reconcile()
        except kubeapi.KubeError as exc:  # the API unreachable: the next pass tries again
            _say(str(exc))
        if args.once:
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
