"""What the admission webhook does to a pod (torpor.core.admission), and its answer to the apiserver
(torpor.apps.webhook.review_response): pure, on pods as the apiserver sends them."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import pytest

from torpor.apps.webhook import review_response
from torpor.core.admission import CAPABILITIES, WebhookConfig, mutate

CONFIG = WebhookConfig(torpor="/opt/torpor/bin/torpor", torpor_paths=("/opt/torpor",))


def apply(doc: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add, replace and remove: what the apiserver does with the patch."""
    doc = copy.deepcopy(doc)
    for op in patch:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "remove":
            del target[int(last) if isinstance(target, list) else last]
        elif isinstance(target, list):
            target.append(op["value"]) if last == "-" else target.insert(int(last), op["value"])
        else:
            assert op["op"] == "replace" or last not in target, op
            target[last] = op["value"]
    return doc


def pod(**spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "trainer:1",
        "command": ["python3", "train.py"],
        "args": ["--lr", "0.1"],
    }
    return {
        "metadata": {
            "name": "train-0",
            "labels": {"torpor.dev/checkpoint": "true", "app": "train"},
            "ownerReferences": [{"kind": "StatefulSet", "name": "train", "controller": True}],
        },
        "spec": {
            "containers": [container, {"name": "sidecar", "image": "x", "command": ["sleep", "1d"]}],
            **spec,
        },
    }


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_an_opted_in_pod_runs_its_command_under_torpor_with_the_store_and_the_privileges() -> None:
    mutation = mutate(pod(), "team-a", CONFIG)
    assert mutation.warnings == [] and mutation.identity == "team-a/train-0"
    changed = apply(pod(), mutation.patch)
    main, sidecar = changed["spec"]["containers"]
    assert main["command"] == ["/opt/torpor/bin/torpor", "pod", "--", "python3", "train.py", "--lr", "0.1"]
    assert "args" not in main
    assert sidecar == pod()["spec"]["containers"][1]  # only the main container
    env = env_of(main)
    assert env["TORPOR_IDENTITY"] == "team-a/train-0" and env["TORPOR_INTERCHANGEABLE"] == "0"
    assert env["TORPOR_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert json.loads(env["TORPOR_POD_NEEDS"]) == {"image": "trainer:1", "volumes": []}  # not torpor's own
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["torpor-store"]["subPath"] == "team-a"  # a pod sees its own namespace's checkpoints only
    assert mounts["torpor-bin-0"] == {"name": "torpor-bin-0", "mountPath": "/opt/torpor", "readOnly": True}
    volumes = {v["name"]: v for v in changed["spec"]["volumes"]}
    assert volumes["torpor-store"]["hostPath"]["path"] == "/var/lib/torpor-store"
    assert volumes["torpor-hot"]["emptyDir"]["medium"] == "Memory"
    assert main["securityContext"] == {"privileged": True}
    assert changed["spec"]["terminationGracePeriodSeconds"] == 60
    assert changed["metadata"]["annotations"]["torpor.dev/managed-identity"] == "team-a/train-0"


def test_what_the_pod_has_already_is_kept_and_added_to() -> None:
    original = pod(terminationGracePeriodSeconds=600, volumes=[{"name": "data", "emptyDir": {}}])
    main = original["spec"]["containers"][0]
    main["env"] = [{"name": "SEED", "value": "1"}]
    main["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    main["securityContext"] = {"runAsUser": 0}
    original["metadata"]["annotations"] = {
        "torpor.dev/checkpoint-every": "5m",
        "torpor.dev/lazy-restore": "true",
        "torpor.dev/container": "main",
    }
    config = WebhookConfig(store_host_path=None, store_claim="torpor-store", privileged=False)
    changed = apply(original, mutate(original, "team-a", config).patch)
    main = changed["spec"]["containers"][0]
    env = env_of(main)
    assert env["SEED"] == "1" and env["TORPOR_CHECKPOINT_EVERY"] == "5m" and env["TORPOR_LAZY_RESTORE"] == "1"
    assert [m["name"] for m in main["volumeMounts"]][:2] == ["data", "torpor-store"]
    assert "subPath" not in main["volumeMounts"][1]  # a claim is the namespace's own
    assert changed["spec"]["volumes"][1]["persistentVolumeClaim"] == {"claimName": "torpor-store"}
    assert main["securityContext"]["runAsUser"] == 0
    assert main["securityContext"]["capabilities"]["add"] == sorted(CAPABILITIES)
    assert main["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert changed["spec"]["terminationGracePeriodSeconds"] == 600


def test_replicas_are_interchangeable_and_a_bare_pod_is_its_own_name() -> None:
    replica = pod()
    replica["metadata"]["name"] = ""
    replica["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "api-5d9f", "controller": True}]
    mutation = mutate(replica, "team-a", CONFIG)
    assert mutation.identity == "team-a/replicaset-api-5d9f/main"
    assert env_of(apply(replica, mutation.patch)["spec"]["containers"][0])["TORPOR_INTERCHANGEABLE"] == "1"
    bare = pod()
    del bare["metadata"]["ownerReferences"]
    assert mutate(bare, "team-a", CONFIG).identity == "team-a/pod-train-0/main"


@pytest.mark.parametrize(
    ("change", "warning"),
    [
        (lambda p: p["spec"]["containers"][0].pop("command"), "has no command in the pod spec"),
        (
            lambda p: p["metadata"].update(annotations={"torpor.dev/container": "nope"}),
            "no container named 'nope'",
        ),
        (lambda p: p["metadata"].update(annotations={"torpor.dev/identity": "../x"}), "torpor.dev/identity"),
        (lambda p: p["metadata"].update(annotations={"torpor.dev/checkpoint-every": "10"}), "not a duration"),
    ],
)
def test_a_pod_the_webhook_cannot_handle_is_admitted_unchanged_with_a_warning(
    change: Any, warning: str
) -> None:
    original = pod()
    change(original)
    mutation = mutate(original, "team-a", CONFIG)
    assert mutation.patch == [] and len(mutation.warnings) == 1 and warning in mutation.warnings[0]


def test_a_pod_without_the_label_is_left_alone() -> None:
    original = pod()
    original["metadata"]["labels"]["torpor.dev/checkpoint"] = "false"
    assert mutate(original, "team-a", CONFIG).patch == []


def test_a_pod_changed_already_is_left_as_it_is_and_one_only_annotated_is_changed() -> None:
    original = pod()
    changed = apply(original, mutate(original, "team-a", CONFIG).patch)
    # created again from a copy of the changed pod (the operator waking a hibernated bare pod)
    again = mutate(changed, "team-a", CONFIG)
    assert again.patch == [] and again.warnings == []
    # the annotation alone (typed by a user) is not enough to be left alone
    annotated = pod()
    annotated["metadata"]["annotations"] = {"torpor.dev/managed-identity": "team-a/other"}
    done = apply(annotated, mutate(annotated, "team-a", CONFIG).patch)
    assert done["spec"]["containers"][0]["command"][1:3] == ["pod", "--"]
    assert done["metadata"]["annotations"]["torpor.dev/managed-identity"] == "team-a/train-0"


def test_the_answer_to_the_apiserver_always_allows_and_carries_the_patch() -> None:
    review = {"request": {"uid": "u1", "kind": {"kind": "Pod"}, "namespace": "team-a", "object": pod()}}
    response = review_response(review, CONFIG)["response"]
    assert response["uid"] == "u1" and response["allowed"] is True and response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    assert apply(pod(), patch)["spec"]["containers"][0]["command"][:2] == ["/opt/torpor/bin/torpor", "pod"]
    for bad in (
        None,
        {},
        {"request": "x"},
        {"request": {"uid": "u2", "kind": {"kind": "Pod"}, "object": []}},
    ):
        answer = review_response(bad, CONFIG)["response"]
        assert answer["allowed"] is True and "patch" not in answer and answer["warnings"]


def test_the_pod_learns_its_namespace_s_uid_from_the_webhook_which_reads_it_for_opted_in_pods_only() -> None:
    asked: list[str] = []

    def uid_of(namespace: str) -> str | None:
        asked.append(namespace)
        return "ns-uid-1"

    review = {"request": {"uid": "u1", "kind": {"kind": "Pod"}, "namespace": "team-a", "object": pod()}}
    response = review_response(review, CONFIG, uid_of)["response"]
    changed = apply(pod(), json.loads(base64.b64decode(response["patch"])))
    assert env_of(changed["spec"]["containers"][0])["TORPOR_POD_NAMESPACE_UID"] == "ns-uid-1"
    assert asked == ["team-a"]
    plain = pod()
    plain["metadata"]["labels"] = {}
    review_response(
        {"request": {"uid": "u2", "kind": {"kind": "Pod"}, "namespace": "b", "object": plain}}, CONFIG, uid_of
    )
    assert asked == ["team-a"]  # a pod that did not opt in costs the apiserver nothing
    unknown = apply(pod(), mutate(pod(), "team-a", CONFIG, None).patch)
    assert "TORPOR_POD_NAMESPACE_UID" not in env_of(unknown["spec"]["containers"][0])


def test_webhook_settings_are_checked() -> None:
    assert WebhookConfig.from_dict({"torpor_paths": ["/a", "/b"]}).torpor_paths == ("/a", "/b")
    with pytest.raises(ValueError, match="unknown webhook setting"):
        WebhookConfig.from_dict({"stor": "x"})
    assert WebhookConfig.from_dict({"store_claim": "c"}).store_host_path is None
    with pytest.raises(ValueError, match="one of store_host_path and store_claim"):
        WebhookConfig.from_dict({"store_claim": "c", "store_host_path": "/x"})


S3 = WebhookConfig.from_dict(
    {"s3_url": "s3://ckpt/torpor/", "s3_endpoint": "http://minio.storage:9000", "s3_secret": "torpor-s3"}
)


def test_an_s3_cold_tier_gets_its_credentials_from_the_namespace_s_secret_and_its_key_as_a_file() -> None:
    changed = apply(pod(), mutate(pod(), "team-a", S3).patch)
    main = changed["spec"]["containers"][0]
    env = env_of(main)
    assert env["TORPOR_POD_S3"] == "s3://ckpt/torpor"  # the base: the supervisor adds each slot's prefix
    assert env["TORPOR_S3_ENDPOINT"] == "http://minio.storage:9000"
    # under torpor's own names: the job's own AWS_* (if any) stay its own
    assert env["TORPOR_S3_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "torpor-s3", "key": "AWS_ACCESS_KEY_ID", "optional": False}
    }
    assert env["TORPOR_S3_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "torpor-s3", "key": "AWS_SECRET_ACCESS_KEY", "optional": False}
    }
    assert "AWS_ACCESS_KEY_ID" not in env
    assert env["TORPOR_POD_S3_KEY"] == "/run/torpor-s3/key"
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["torpor-s3-key"] == {
        "name": "torpor-s3-key",
        "mountPath": "/run/torpor-s3",
        "readOnly": True,
    }
    assert "torpor-store" in mounts  # the slots' locks and records stay on the store volume
    volumes = {v["name"]: v for v in changed["spec"]["volumes"]}
    assert volumes["torpor-s3-key"]["secret"] == {
        "secretName": "torpor-s3",
        "items": [{"key": "key", "path": "key"}],
        "defaultMode": 0o400,
        "optional": True,  # a Secret without a key: images stored unencrypted
    }
    # torpor's own volumes are not what the job depends on
    assert json.loads(env["TORPOR_POD_NEEDS"]) == {"image": "trainer:1", "volumes": []}


def test_an_s3_cold_tier_without_a_secret_uses_the_pod_s_own_credentials() -> None:
    config = WebhookConfig.from_dict({"s3_url": "s3://ckpt"})
    changed = apply(pod(), mutate(pod(), "team-a", config).patch)
    env = env_of(changed["spec"]["containers"][0])
    assert env["TORPOR_POD_S3"] == "s3://ckpt"
    assert not {"TORPOR_S3_ENDPOINT", "TORPOR_S3_ACCESS_KEY_ID", "TORPOR_POD_S3_KEY"} & set(env)
    assert "torpor-s3-key" not in {v["name"] for v in changed["spec"]["volumes"]}
    assert "TORPOR_POD_S3" not in env_of(
        apply(pod(), mutate(pod(), "team-a", CONFIG).patch)["spec"]["containers"][0]
    )


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"s3_secret": "torpor-s3"}, "s3_secret is a setting of the S3 cold tier: give s3_url too"),
        ({"s3_endpoint": "http://m:9000"}, "s3_endpoint is a setting of the S3 cold tier"),
        ({"s3_url": "/var/lib/store"}, "is not s3://BUCKET"),
        ({"s3_url": "s3:///prefix"}, "is not s3://BUCKET"),
        ({"s3_url": "s3://Bad_Bucket/x"}, "is not an S3 bucket name"),
        ({"s3_url": "s3://ckpt/a/../b"}, "its prefix has an empty, '.' or '..' part"),
        ({"s3_url": "s3://ckpt", "s3_endpoint": "minio:9000"}, "is not an http:// or https:// URL"),
        ({"s3_url": "s3://ckpt", "s3_secret": "Torpor_S3"}, "is not a Secret's name"),
        ({"env": {"TORPOR_STORE": "s3://ckpt"}}, "env sets TORPOR_STORE: give the cold tier as s3_url"),
        (
            {"s3_url": "s3://ckpt", "s3_secret": "s", "env": {"TORPOR_KEY_FILE": "/k"}},
            "comes from the Secret",
        ),
    ],
)
def test_s3_settings_are_checked(settings: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        WebhookConfig.from_dict(settings)


def test_the_webhook_reads_a_namespace_s_uid_at_each_review_and_none_where_it_cannot() -> None:
    from torpor.adapters.kubeapi import KubeError
    from torpor.apps.webhook import namespace_uids

    class API:
        def __init__(self) -> None:
            self.uids = {"team-a": "uid-1"}

        def get(self, path: str) -> dict[str, Any] | None:
            name = path.rsplit("/", 1)[1]
            if name == "down":
                raise KubeError(f"GET {path}: connection refused")
            return {"metadata": {"uid": self.uids[name]}} if name in self.uids else None

    api = API()
    uid = namespace_uids(api)  # type: ignore[arg-type]
    assert uid("team-a") == "uid-1"
    api.uids["team-a"] = "uid-2"  # deleted and made again: never kept
    assert uid("team-a") == "uid-2"
    assert uid("gone") is None and uid("down") is None
    assert namespace_uids(None)("team-a") is None
