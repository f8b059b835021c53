"""The operator's ``torpor.dev/hibernate``: pods hibernated, and kept so until the annotation goes
(decisions: :mod:`torpor.policy.hold`).

Where the annotation is read, each pass:

- on an opted-in **pod** of a controller: it is moved to the controller that keeps the pod
  (``hold.target``: a StatefulSet, a ReplicaSet's Deployment) — the pod is about to go;
- on a **controller**: it is scaled to zero, its replicas written beside, in the same patch
  (``hold.REPLICAS_ANNOTATION``); with the annotation gone it gets them back. Every pod it had
  hibernates, and each restores when it comes back;
- on a **bare pod**: the annotation is set on its identity's ``TorporIdentity`` (which stays), the pod
  is saved to the operator's folder (``STORE/.operator/hibernated/NAMESPACE/POD.json``, which no pod
  sees: each pod's volume is its namespace's folder) and then deleted; with the annotation gone from
  the resource it is created again from that copy, and restores.

Every step is safe to repeat, so an operator killed between two of them finishes the work on its next
pass: a copy is saved before its pod is deleted and dropped only once the pod exists again, and the
count a controller goes back to is written in the same patch that scales it to zero.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from torpor.adapters import kubeapi
from torpor.adapters.system import private
from torpor.core.admission import IDENTITY_SET_ANNOTATION, controller_of
from torpor.policy import hold
from torpor.policy import pod as pod_policy

#: the resource of an identity (deploy/kubernetes/crd.yaml)
GROUP, VERSION, PLURAL, KIND = "torpor.dev", "v1alpha1", "torporidentities", "TorporIdentity"
#: where each scalable controller kind is listed, across namespaces
LIST_PATHS = {
    "StatefulSet": "/apis/apps/v1/statefulsets",
    "Deployment": "/apis/apps/v1/deployments",
    "ReplicaSet": "/apis/apps/v1/replicasets",
    "ReplicationController": "/api/v1/replicationcontrollers",
}
#: on a pod the operator cannot keep hibernated: why (said once, as an event)
UNSUPPORTED_ANNOTATION = "torpor.dev/hibernate-refused"
#: what the API sets on a pod, or the scheduler and the kubelet: not part of a pod created again
_SET_BY_KUBERNETES = ("uid", "resourceVersion", "creationTimestamp", "managedFields", "selfLink",
                      "generation", "deletionTimestamp", "deletionGracePeriodSeconds")  # fmt: skip


def object_path(kind: str, namespace: str, name: str) -> str:
    listed = LIST_PATHS.get(kind, "/api/v1/pods")
    group, _, plural = listed.rpartition("/")
    return f"{group}/namespaces/{namespace}/{plural}/{name}"


def parse_owner(text: str) -> pod_policy.Owner | None:
    """``KIND/NAME`` (as a TorporIdentity's ``spec.owner`` says it) as an owner; None for ""."""
    kind, _, name = text.partition("/")
    return pod_policy.Owner(kind, name) if kind and name else None


def _name(item: dict[str, Any]) -> str:
    metadata = item["metadata"]
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def _terminating(item: dict[str, Any]) -> bool:
    return bool(item["metadata"].get("deletionTimestamp"))


def saved_copy(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as it can be created again: without what Kubernetes set on it, its node, its status,
    and the annotation that had it hibernated."""
    metadata = {k: v for k, v in pod["metadata"].items() if k not in _SET_BY_KUBERNETES}
    metadata["annotations"] = {
        k: v for k, v in (metadata.get("annotations") or {}).items() if k != hold.HIBERNATE_ANNOTATION
    }
    # the scheduler places it again; the priority comes back from its class (the API refuses both)
    spec = {k: v for k, v in pod["spec"].items() if k not in ("nodeName", "priority")}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


class Holder:
    """``torpor.dev/hibernate`` in one pass (see the module's docstring)."""

    def __init__(self, api: kubeapi.KubeAPI, folder: Path, say: Callable[[str], None]) -> None:
        self.api = api
        self.folder = folder  # STORE/.operator/hibernated
        self.say = say

    def reconcile(self, resources: list[dict[str, Any]], resource_path: Callable[[str, str], str]) -> None:
        """One pass over the TorporIdentity ``resources`` (every namespace's) and the API;
        ``resource_path(namespace, name)`` is where a TorporIdentity is in the API."""
        selector = quote(f"{pod_policy.OPT_IN_LABEL}=true")
        pods = (self.api.get(f"/api/v1/pods?labelSelector={selector}") or {}).get("items", [])
        for item in pods:
            # one being deleted goes anyway (and its annotation must not undo a wake that follows)
            if hold.wanted(item["metadata"].get("annotations")) and not _terminating(item):
                self._tried(_name(item), self._pod, item, resource_path)
        for item in resources:
            if hold.wanted(item["metadata"].get("annotations")):
                self._tried(_name(item), self._resource, item, resource_path)
        for kind, listed in LIST_PATHS.items():
            for item in (self.api.get(listed) or {}).get("items", []):
                self._tried(_name(item), self._controller, kind, item)
        for copy in sorted(self.folder.glob("*/*.json")):
            self._tried(f"{copy.parent.name}/{copy.stem}", self._saved, copy, resource_path)

    def _tried(self, what: str, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except (kubeapi.KubeError, OSError, ValueError, KeyError) as exc:  # the next pass tries again
            self.say(f"{what}: {exc}")

    # -- pods ----------------------------------------------------------------------------------------

    def _pod(self, item: dict[str, Any], resource_path: Callable[[str, str], str]) -> None:
        metadata = item["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        try:
            keeper = self._keeper(namespace, controller_of(metadata))
        except ValueError as exc:
            self._refuse(item, str(exc))
            return
        if keeper is not None:
            self._hibernate_controller(namespace, keeper, f"{namespace}/{name}")
            return
        identity = (metadata.get("annotations") or {}).get(IDENTITY_SET_ANNOTATION)
        if not identity:
            self._refuse(item, "the webhook did not put it under torpor")
            return
        resource = resource_path(namespace, pod_policy.resource_name(identity))
        if self.api.get(resource) is None:
            return  # its identity's resource is made once its job starts: the next pass
        self.api.merge(resource, {"metadata": {"annotations": {hold.HIBERNATE_ANNOTATION: "true"}}})
        self._delete_bare(item, resource)

    def _resource(self, item: dict[str, Any], resource_path: Callable[[str, str], str]) -> None:
        """A TorporIdentity annotated: its controller hibernated (the annotation moves to it, as a
        pod's does), or its bare pods deleted (the annotation stays: it is what keeps them so)."""
        metadata, spec = item["metadata"], item.get("spec") or {}
        namespace, name = metadata["namespace"], metadata["name"]
        owner = parse_owner(str(spec.get("owner", "")))
        if owner is not None:
            try:
                keeper = self._keeper(namespace, owner)
            except ValueError as exc:
                self.say(f"{namespace}/{name}: not hibernated: {exc}")
                return
            if keeper is not None:
                self._hibernate_controller(namespace, keeper, f"{KIND} {namespace}/{name}")
                self.api.merge(
                    resource_path(namespace, name),
                    {"metadata": {"annotations": {hold.HIBERNATE_ANNOTATION: None}}},
                )
            return
        for slot in (item.get("status") or {}).get("slots", []):
            pod = self.api.get(object_path("Pod", namespace, str(slot.get("pod", ""))))
            ours = pod is not None and (pod["metadata"].get("annotations") or {}).get(IDENTITY_SET_ANNOTATION)
            if pod is not None and ours == spec.get("identity") and not _terminating(pod):
                self._delete_bare(pod, resource_path(namespace, name))

    def _keeper(self, namespace: str, owner: pod_policy.Owner | None) -> pod_policy.Owner | None:
        """What keeps a pod of ``owner`` hibernated (``hold.target``; ``ValueError`` if nothing can)."""
        parent = None
        if owner is not None and owner.kind == "ReplicaSet":
            replicaset = self.api.get(object_path("ReplicaSet", namespace, owner.name)) or {}
            parent = controller_of(replicaset.get("metadata") or {})
        return hold.target(owner, parent)

    def _hibernate_controller(self, namespace: str, keeper: pod_policy.Owner, asked_on: str) -> None:
        """The annotation set on the controller: scaled to zero below, in this pass."""
        self.api.merge(
            object_path(keeper.kind, namespace, keeper.name),
            {"metadata": {"annotations": {hold.HIBERNATE_ANNOTATION: "true"}}},
        )
        self.say(f"{asked_on}: hibernating {keeper.kind} {namespace}/{keeper.name}")

    def _delete_bare(self, item: dict[str, Any], resource: str) -> None:
        """Saved, then deleted: it hibernates; ``resource`` (its identity's) keeps it so."""
        namespace, name = item["metadata"]["namespace"], item["metadata"]["name"]
        self._save(namespace, name, {"resource": resource, "pod": saved_copy(item)})
        self.api.delete(object_path("Pod", namespace, name))
        self.say(f"{namespace}/{name}: hibernating it (deleted; saved to be created again)")

    def _refuse(self, item: dict[str, Any], why: str) -> None:
        metadata = item["metadata"]
        if (metadata.get("annotations") or {}).get(UNSUPPORTED_ANNOTATION) == why:
            return  # said already
        namespace, name = metadata["namespace"], metadata["name"]
        self.api.event(namespace, name, metadata.get("uid", ""), "HibernateRefused", why, warning=True)
        self.api.annotate(namespace, name, {UNSUPPORTED_ANNOTATION: why})
        self.say(f"{namespace}/{name}: not hibernated: {why}")

    def _save(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        folder = self.folder / namespace
        private.make_private_dirs(folder)
        temporary = folder / f".{name}.json.tmp"
        private.write_private(temporary, json.dumps(body).encode())
        os.replace(temporary, folder / f"{name}.json")

    def _saved(self, copy: Path, resource_path: Callable[[str, str], str]) -> None:
        body = json.loads(copy.read_text())
        pod = body["pod"]
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        resource = self.api.get(body["resource"])  # gone with its identity: nothing keeps it hibernated
        current = self.api.get(object_path("Pod", namespace, name))
        if current is not None and _terminating(current):
            return  # still hibernating: created again, if it is to be, once it is gone
        wanted = hold.wanted((resource or {}).get("metadata", {}).get("annotations")) or (
            current is not None and hold.wanted(current["metadata"].get("annotations"))
        )
        step = hold.bare_pod(wanted, current is not None, saved=True)
        if step == hold.PodStep.CREATE:
            try:
                self.api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
                self.say(f"{namespace}/{name}: woken: created again")
            except kubeapi.KubeError as exc:
                # 409: it exists already (made by the last pass, or a user); 404: its namespace is gone
                if exc.status not in (404, 409):
                    raise
                if exc.status == 404:
                    self.say(f"{namespace}/{name}: not created again: {exc}")
            copy.unlink()
        elif step == hold.PodStep.FORGET:
            copy.unlink()

    # -- controllers ---------------------------------------------------------------------------------

    def _controller(self, kind: str, item: dict[str, Any]) -> None:
        metadata, spec = item["metadata"], item.get("spec") or {}
        if kind == "ReplicaSet" and controller_of(metadata) is not None:
            return  # a Deployment's: the Deployment is scaled (it would scale this one back)
        annotations = metadata.get("annotations") or {}
        saved_text = str(annotations.get(hold.REPLICAS_ANNOTATION, ""))
        saved = int(saved_text) if saved_text.isdigit() else None
        change = hold.scale(hold.wanted(annotations), int(spec.get("replicas", 1)), saved)
        if change is None:
            return
        replicas, keep = change
        self.api.merge(
            object_path(kind, metadata["namespace"], metadata["name"]),
            {
                "metadata": {"annotations": {hold.REPLICAS_ANNOTATION: None if keep is None else str(keep)}},
                "spec": {"replicas": replicas},
            },
        )
        what = "hibernated: scaled to 0" if replicas == 0 else f"woken: scaled back to {replicas}"
        self.say(f"{kind} {metadata['namespace']}/{metadata['name']} {what}")
