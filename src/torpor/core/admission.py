"""What the mutating admission webhook changes in an opted-in pod: a JSON Patch, computed from the pod
alone (no call to anything; the server is ``torpor.apps.webhook``).

A pod labelled ``torpor.dev/checkpoint: "true"`` gets its main container (the first, or the one
``torpor.dev/container`` names) run under the in-pod supervisor: ``TORPOR -- COMMAND ARGS...``, with

- torpor itself: the node's installation (``torpor_paths``, host folders mounted read-only at the same
  paths: the image is not changed, and needs nothing of torpor);
- the store: a volume every node sees (``store``: a hostPath, mounted at the namespace's own folder,
  or a PersistentVolumeClaim of that name in the pod's namespace), at ``/torpor-store``; a pod sees only
  its own namespace's checkpoints;
- the hot tier: an ``emptyDir`` in memory, so that a checkpoint is not bounded by the container's
  64 MiB ``/dev/shm``;
- who it is: the identity (:func:`torpor.policy.pod.identity`), the pod's name, namespace, uid and node
  (the downward API), and what its job depends on (its image and volumes, :func:`torpor.policy.pod.needs`),
  which a later pod must match to continue it;
- the privileges CRIU needs (``privileged``, or the capabilities the reference lists with seccomp
  unconfined), and a termination grace long enough to hibernate.

A pod changed already (created again from a copy of one that was) is left as it is. A pod it cannot handle (no command in its spec: the image's entrypoint is not known here; no identity;
a container it cannot find) is admitted unchanged, and the reason is a warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torpor.policy import pod as pod_policy
from torpor.policy.jobpolicy import parse_duration

CONTAINER_ANNOTATION = "torpor.dev/container"
#: set on the pods the webhook changed: the identity it gave them
IDENTITY_SET_ANNOTATION = "torpor.dev/managed-identity"
STORE_MOUNT = "/torpor-store"
HOT_MOUNT = "/run/torpor-hot"
#: capabilities checkpointing needs when the pod is not privileged (docs/kubernetes.md)
CAPABILITIES = ("SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "CHECKPOINT_RESTORE", "SYS_TIME")
#: controllers whose pods are interchangeable: each pod takes a free slot of the identity
INTERCHANGEABLE = frozenset({"ReplicaSet", "ReplicationController", "DaemonSet", "Job"})


@dataclass(frozen=True)
class WebhookConfig:
    """How the cluster provides torpor to pods (``torpor webhook --config``; docs/kubernetes.md)."""

    #: the torpor command on every node
    torpor: str = "/opt/torpor/bin/torpor"
    #: host folders torpor needs (its installation, the Python it runs on), mounted read-only
    torpor_paths: tuple[str, ...] = ("/opt/torpor",)
    #: a hostPath folder every node shares, or ...
    store_host_path: str | None = "/var/lib/torpor-store"
    #: ... the name of a PersistentVolumeClaim each namespace has
    store_claim: str | None = None
    privileged: bool = True
    min_grace_s: float = 60.0
    #: the in-memory hot tier's size limit
    hot_size: str = "4Gi"
    #: extra environment for the supervisor (e.g. TORPOR_STORE_URL for an S3 cold tier)
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WebhookConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown webhook setting(s): {', '.join(unknown)}")
        values = dict(data)
        if values.get("store_claim") is not None:
            values.setdefault("store_host_path", None)  # a claim instead of the default host folder
        if "torpor_paths" in values:
            values["torpor_paths"] = tuple(str(p) for p in values["torpor_paths"])
        config = cls(**values)
        if (config.store_host_path is None) == (config.store_claim is None):
            raise ValueError("give one of store_host_path and store_claim")
        return config


@dataclass(frozen=True)
class Mutation:
    patch: list[dict[str, Any]]
    warnings: list[str]
    identity: str | None = None


def opted_in(pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(pod_policy.OPT_IN_LABEL, "")).lower() == "true"


def controller_of(metadata: Mapping[str, Any]) -> pod_policy.Owner | None:
    """The controller in an object's ``ownerReferences`` (``controller: true``), if any."""
    for ref in metadata.get("ownerReferences") or ():
        if ref.get("controller"):
            return pod_policy.Owner(str(ref.get("kind", "")), str(ref.get("name", "")))
    return None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def mutate(pod: Mapping[str, Any], namespace: str, config: WebhookConfig) -> Mutation:
    """The patch that puts ``pod`` (in ``namespace``) under torpor, or none and the reason why."""
    if not opted_in(pod):
        return Mutation([], [])
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    spec = pod.get("spec") or {}
    containers: Sequence[Mapping[str, Any]] = spec.get("containers") or ()
    wanted = annotations.get(CONTAINER_ANNOTATION)
    index = next((i for i, c in enumerate(containers) if wanted is None or c.get("name") == wanted), None)
    if index is None:
        return _unchanged(f"no container named '{wanted}'" if wanted else "no container")
    container = containers[index]
    if IDENTITY_SET_ANNOTATION in annotations and list(container.get("command") or ())[:3] == [
        config.torpor, "pod", "--"
    ]:  # fmt: skip
        return Mutation([], [])  # changed already: a pod created again from a changed one (kubehold)
    if not container.get("command"):
        return _unchanged(
            f"container '{container.get('name')}' has no command in the pod spec (its image's "
            "entrypoint is not known to the webhook): give 'command'"
        )
    owner = controller_of(metadata)
    try:
        identity = pod_policy.identity(
            namespace,
            str(metadata.get("name") or ""),
            str(container.get("name", "")),
            owner,
            annotations.get(pod_policy.IDENTITY_ANNOTATION),
        )
    except ValueError as exc:
        return _unchanged(str(exc))
    interchangeable = owner is not None and owner.kind in INTERCHANGEABLE
    every = annotations.get(pod_policy.EVERY_ANNOTATION)
    if every is not None:
        try:
            parse_duration(str(every))
        except ValueError as exc:
            return _unchanged(f"{pod_policy.EVERY_ANNOTATION}: {exc}")
    lazy = str(annotations.get(pod_policy.LAZY_ANNOTATION, "")).lower() == "true"

    # what the job depends on, before torpor's own mounts are added: compared by the next pod
    needs = pod_policy.needs(
        str(container.get("image", "")), container.get("volumeMounts") or (), spec.get("volumes") or ()
    )
    at = f"/spec/containers/{index}"
    patch: list[dict[str, Any]] = [
        _set(
            container,
            "command",
            at,
            [config.torpor, "pod", "--", *container["command"], *container.get("args", ())],
        ),
    ]
    if "args" in container:
        patch.append({"op": "remove", "path": f"{at}/args"})
    env = [
        {"name": "TORPOR_POD_STORE", "value": STORE_MOUNT},
        {"name": "TORPOR_IDENTITY", "value": identity},
        {"name": "TORPOR_INTERCHANGEABLE", "value": "1" if interchangeable else "0"},
        {"name": "TORPOR_HOT_DIR", "value": HOT_MOUNT},
        {"name": "TORPOR_LAZY_RESTORE", "value": "1" if lazy else "0"},
        {"name": "TORPOR_POD_NEEDS", "value": json.dumps(needs, sort_keys=True)},
        *([{"name": "TORPOR_POD_OWNER", "value": f"{owner.kind}/{owner.name}"}] if owner else []),
        *([{"name": "TORPOR_CHECKPOINT_EVERY", "value": str(every)}] if every else []),
        *_field_env("TORPOR_POD_NAME", "metadata.name"),
        *_field_env("TORPOR_POD_NAMESPACE", "metadata.namespace"),
        *_field_env("TORPOR_POD_UID", "metadata.uid"),
        *_field_env("TORPOR_NODE_NAME", "spec.nodeName"),
        *({"name": k, "value": v} for k, v in sorted(config.env.items())),
    ]
    patch += _append(container, "env", at, env)
    store_mount: dict[str, Any] = {"name": "torpor-store", "mountPath": STORE_MOUNT}
    if config.store_host_path is not None:
        store_mount["subPath"] = namespace  # a pod sees its own namespace's folder only
    mounts = [
        store_mount,
        {"name": "torpor-hot", "mountPath": HOT_MOUNT},
        *(
            {"name": f"torpor-bin-{n}", "mountPath": path, "readOnly": True}
            for n, path in enumerate(config.torpor_paths)
        ),
    ]
    patch += _append(container, "volumeMounts", at, mounts)
    patch.append(_set(container, "securityContext", at, _security(container.get("securityContext"), config)))

    store: dict[str, Any] = (
        {"hostPath": {"path": config.store_host_path, "type": "DirectoryOrCreate"}}
        if config.store_host_path is not None
        else {"persistentVolumeClaim": {"claimName": config.store_claim}}
    )
    volumes = [
        {"name": "torpor-store", **store},
        {"name": "torpor-hot", "emptyDir": {"medium": "Memory", "sizeLimit": config.hot_size}},
        *(
            {"name": f"torpor-bin-{n}", "hostPath": {"path": path, "type": "Directory"}}
            for n, path in enumerate(config.torpor_paths)
        ),
    ]
    patch += _append(spec, "volumes", "/spec", volumes)
    grace = pod_policy.grace_for(spec.get("terminationGracePeriodSeconds"), config.min_grace_s)
    patch.append(_set(spec, "terminationGracePeriodSeconds", "/spec", int(grace)))
    if not annotations:
        patch.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    patch.append(
        {
            "op": "replace" if IDENTITY_SET_ANNOTATION in annotations else "add",
            "path": f"/metadata/annotations/{_escape(IDENTITY_SET_ANNOTATION)}",
            "value": identity,
        }
    )
    return Mutation(patch, [], identity)


def _unchanged(why: str) -> Mutation:
    return Mutation([], [f"torpor: pod admitted without checkpointing: {why}"])


def _set(obj: Mapping[str, Any], key: str, at: str, value: Any) -> dict[str, Any]:
    return {"op": "replace" if key in obj else "add", "path": f"{at}/{key}", "value": value}


def _append(obj: Mapping[str, Any], key: str, at: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not obj.get(key):
        return [{"op": "add", "path": f"{at}/{key}", "value": items}]
    return [{"op": "add", "path": f"{at}/{key}/-", "value": item} for item in items]


def _field_env(name: str, path: str) -> list[dict[str, Any]]:
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}]


def _security(current: Mapping[str, Any] | None, config: WebhookConfig) -> dict[str, Any]:
    context = dict(current or {})
    if config.privileged:
        context["privileged"] = True
        return context
    capabilities = dict(context.get("capabilities") or {})
    capabilities["add"] = sorted({*capabilities.get("add", ()), *CAPABILITIES})
    context["capabilities"] = capabilities
    context["seccompProfile"] = {"type": "Unconfined"}
    return context
