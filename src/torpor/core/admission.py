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
  unconfined), and a termination grace long enough to hibernate;
- with ``s3_url``, an S3 cold tier for the checkpoint images (each slot its own prefix under the
  namespace's, :func:`torpor.policy.pod.slot_cold_tier`; the store volume keeps the slots' locks and
  records): its credentials from the Secret ``s3_secret`` in the pod's namespace, as environment under
  torpor's own names (the job's own ``AWS_*`` stay its own), and the Secret's ``key``, if it has one,
  as a read-only file for encrypting the images.

A pod changed already (created again from a copy of one that was) is left as it is. A pod it cannot handle (no command in its spec: the image's entrypoint is not known here; no identity;
a container it cannot find) is admitted unchanged, and the reason is a warning.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

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
#: where the S3 Secret's ``key`` is mounted (a folder of its own: a Secret volume replaces the folder)
S3_KEY_MOUNT = "/run/torpor-s3"
#: the keys of the S3 Secret, and the variables of the supervisor they become (torpor.apps.pod)
S3_SECRET_KEYS = {
    "TORPOR_S3_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "TORPOR_S3_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
}
#: the Secret's optional encryption key (32 bytes, TORPOR_KEY_FILE)
S3_SECRET_KEY_FILE = "key"
#: what ``env`` may not set: the webhook's own S3 settings say these, per slot where it matters. One
#: TORPOR_STORE for every pod would put all slots in one cold tier, where each one's garbage
#: collection deletes the chunks of the others
_OWN_STORE_VARIABLES = ("TORPOR_STORE", "TORPOR_S3_ENDPOINT", "TORPOR_POD_S3", "TORPOR_POD_S3_KEY")
#: a Secret's name: a DNS subdomain
_SECRET_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


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
    #: extra environment for the supervisor (e.g. TORPOR_KEEP_LAST); not the cold tier: ``s3_url``
    env: Mapping[str, str] = field(default_factory=dict)
    #: the checkpoint images in S3 instead of the store volume: ``s3://BUCKET[/PREFIX]``, each slot
    #: under ``PREFIX/NAMESPACE/IDENTITY/slot-N``
    s3_url: str | None = None
    #: the S3 endpoint of an S3-compatible server (MinIO, Ceph); none: AWS
    s3_endpoint: str | None = None
    #: the Secret in each pod's namespace with ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
    #: optionally ``key``; none: boto3's usual chain in the pod (an instance role)
    s3_secret: str | None = None

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
        if values.get("s3_url") is not None:
            values["s3_url"] = _s3_url(str(values["s3_url"]))
        config = cls(**values)
        if (config.store_host_path is None) == (config.store_claim is None):
            raise ValueError("give one of store_host_path and store_claim")
        config._check_s3()
        return config

    def _check_s3(self) -> None:
        if self.s3_url is None:
            for name in ("s3_endpoint", "s3_secret"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is a setting of the S3 cold tier: give s3_url too")
        if self.s3_endpoint is not None:
            parts = urlsplit(self.s3_endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(
                    f"s3_endpoint '{self.s3_endpoint}' is not an http:// or https:// URL, "
                    "e.g. http://minio.storage:9000"
                )
        if self.s3_secret is not None and not _SECRET_NAME.match(self.s3_secret):
            raise ValueError(f"s3_secret '{self.s3_secret}' is not a Secret's name (a DNS subdomain)")
        for name in sorted(self.env):
            if (why := self._env_refusal(name)) is not None:
                raise ValueError(f"env sets {name}: {why}")

    def _env_refusal(self, name: str) -> str | None:
        """Why ``env`` may not set ``name`` (None: it may)."""
        if name in _OWN_STORE_VARIABLES:
            return (
                "give the cold tier as s3_url and s3_endpoint instead (each slot gets its own prefix; one "
                "cold tier for every slot would let one slot's garbage collection delete another's chunks)"
            )
        if name in S3_SECRET_KEYS:
            return "the webhook sets it from the Secret s3_secret"
        if self.s3_secret is not None and name in (*S3_SECRET_KEYS.values(), "TORPOR_KEY_FILE"):
            return f"it comes from the Secret s3_secret '{self.s3_secret}'"
        return None


def _s3_url(text: str) -> str:
    """``s3://BUCKET[/PREFIX]`` in one spelling (no slash at the end); ``ValueError`` for anything else."""
    parts = urlsplit(text.strip())
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if parts.scheme != "s3" or not bucket or parts.query or parts.fragment:
        raise ValueError(f"s3_url '{text}' is not s3://BUCKET[/PREFIX]")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise ValueError(
            f"s3_url '{text}': '{bucket}' is not an S3 bucket name (3-63 lowercase letters, digits, '.', '-')"
        )
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"s3_url '{text}': its prefix has an empty, '.' or '..' part")
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


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


def mutate(
    pod: Mapping[str, Any], namespace: str, config: WebhookConfig, namespace_uid: str | None = None
) -> Mutation:
    """The patch that puts ``pod`` (in ``namespace``) under torpor, or none and the reason why.

    ``namespace_uid``: the namespace's UID, as the webhook read it from the API server (None where it
    could not): the pod tells its namespace from an earlier one of the same name by it
    (:func:`torpor.policy.pod.remade_namespace`); the downward API does not give it."""
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
        *([{"name": "TORPOR_POD_NAMESPACE_UID", "value": namespace_uid}] if namespace_uid else []),
        *_field_env("TORPOR_POD_NAME", "metadata.name"),
        *_field_env("TORPOR_POD_NAMESPACE", "metadata.namespace"),
        *_field_env("TORPOR_POD_UID", "metadata.uid"),
        *_field_env("TORPOR_NODE_NAME", "spec.nodeName"),
        *_s3_env(config),
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
        *(
            [{"name": "torpor-s3-key", "mountPath": S3_KEY_MOUNT, "readOnly": True}]
            if config.s3_secret
            else []
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
        *_s3_key_volume(config),
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


def _s3_env(config: WebhookConfig) -> list[dict[str, Any]]:
    """The S3 cold tier's environment: its base, endpoint and key file, and the credentials from the
    Secret. A Secret that is missing, or lacks a credential, stops the container from being created
    (``CreateContainerConfigError``, which names it): a pod never runs with its checkpoints going
    nowhere."""
    if config.s3_url is None:
        return []
    env: list[dict[str, Any]] = [{"name": "TORPOR_POD_S3", "value": config.s3_url}]
    if config.s3_endpoint is not None:
        env.append({"name": "TORPOR_S3_ENDPOINT", "value": config.s3_endpoint})
    if config.s3_secret is not None:
        env += [
            {
                "name": ours,
                "valueFrom": {"secretKeyRef": {"name": config.s3_secret, "key": key, "optional": False}},
            }
            for ours, key in S3_SECRET_KEYS.items()
        ]
        env.append({"name": "TORPOR_POD_S3_KEY", "value": f"{S3_KEY_MOUNT}/{S3_SECRET_KEY_FILE}"})
    return env


def _s3_key_volume(config: WebhookConfig) -> list[dict[str, Any]]:
    """The Secret's ``key``, readable by its owner only. It is optional: a Secret without one mounts an
    empty folder, and the supervisor stores the images unencrypted."""
    if config.s3_secret is None:
        return []
    secret = {
        "secretName": config.s3_secret,
        "items": [{"key": S3_SECRET_KEY_FILE, "path": S3_SECRET_KEY_FILE}],
        "defaultMode": 0o400,
        "optional": True,
    }
    return [{"name": "torpor-s3-key", "secret": secret}]


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
