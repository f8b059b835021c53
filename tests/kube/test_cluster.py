"""torpor on a real two-node Kubernetes cluster (tests/kube/conftest.py): opted-in pods go through the
admission webhook, are hibernated when they are evicted and continue on the other node."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from conftest import JOBS, S3_ENV, TORPOR, moto_server

from .cluster import NODE_HOST, ROOT, Cluster, counter_deployment, counter_statefulset

pytestmark = [pytest.mark.k8s, pytest.mark.criu, pytest.mark.slow, pytest.mark.xdist_group("k8s")]


def steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^step (\d+)$", text, re.M)]


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"tpt-{uuid.uuid4().hex[:6]}"  # tpt-: what cluster.sh down clears of pod logs
    cluster.namespace(name)
    yield name
    cluster.remove_namespace(name)
    for node in ("node1", "node2"):
        cluster.kubectl("uncordon", node, check=False)


def test_a_drained_node_s_statefulset_pod_is_hibernated_and_continues_on_the_other_node(
    cluster: Cluster, namespace: str
) -> None:
    cluster.kubectl("cordon", "node2")  # it starts on node1
    cluster.apply(counter_statefulset(namespace, "counter"))
    first = cluster.running_pod(namespace, "counter-0")
    assert first["spec"]["nodeName"] == "node1"
    main = first["spec"]["containers"][0]
    assert main["command"][1:4] == ["pod", "--", "python3"]  # the webhook put it under torpor
    assert first["metadata"]["annotations"]["torpor.dev/managed-identity"] == f"{namespace}/counter-0"
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, "counter-0"))) > 5, what="the job to count")
    seen = steps(cluster.logs(namespace, "counter-0"))
    assert seen[0] == 0

    cluster.kubectl("uncordon", "node2")
    cluster.kubectl(
        "drain", "node1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s", timeout=200
    )
    second = cluster.running_pod(namespace, "counter-0", not_uid=first["metadata"]["uid"])
    assert second["spec"]["nodeName"] == "node2"

    def counting() -> str | None:
        text = cluster.logs(namespace, "counter-0")
        return text if len(steps(text)) > 3 else None

    log = cluster.wait_for(counting, what="the job to count on node2")
    assert re.search(r"resumed its hibernated job: restored from \w+ taken on node1", log), (
        log + cluster.story(namespace, "counter-0")
    )
    after = steps(log)
    assert after[0] > seen[-1] and after == list(range(after[0], after[0] + len(after)))
    # the job's whole output, in the store both nodes see: every step once, none lost, none repeated
    output = (cluster.store / namespace / "counter-0/slot-0/jobs/main/output.log").read_text()
    everything = steps(output)
    assert everything == list(range(len(everything))) and everything[-1] >= after[-1]
    # what torpor did, the Kubernetes way: events on the pod (the first one's outlive it), and when its
    # job was last checkpointed
    messages = {(e["reason"], e["message"]) for e in cluster.events(namespace, "counter-0")}
    assert any(r == "Hibernated" and m.startswith("hibernated by torpor: checkpoint") for r, m in messages), (
        messages,
        log,
    )
    assert any(r == "Restored" and "taken on node1" in m for r, m in messages), messages
    stamp = cluster.wait_for(
        lambda: cluster.get("pod", "-n", namespace, "counter-0")["metadata"]["annotations"].get(
            "torpor.dev/last-checkpoint"
        ),
        what="a periodic checkpoint on node2",
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp)


def test_a_deployment_s_drained_replica_is_continued_by_the_replacement_made_at_its_eviction(
    cluster: Cluster, namespace: str
) -> None:
    cluster.kubectl("cordon", "node2")
    cluster.apply(counter_deployment(namespace, "api"))

    def pod_on(node: str) -> str | None:
        for pod in cluster.get("pods", "-n", namespace, "-l", "app=api")["items"]:
            running = pod["status"].get("phase") == "Running" and "deletionTimestamp" not in pod["metadata"]
            if running and pod["spec"].get("nodeName") == node:
                return str(pod["metadata"]["name"])
        return None

    first = cluster.wait_for(lambda: pod_on("node1"), what="the replica to run on node1")
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, first))) > 3, what="the job to count")
    cluster.kubectl("uncordon", "node2")
    cluster.kubectl(
        "drain", "node1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s", timeout=200
    )
    second = cluster.wait_for(lambda: pod_on("node2"), what="the replacement to run on node2")

    def counting() -> str | None:
        text = cluster.logs(namespace, second)
        return text if len(steps(text)) > 3 else None

    log = cluster.wait_for(counting, what="the job to count on node2")
    assert "resumed its hibernated job" in log, log + cluster.story(namespace, second)
    (folder,) = (cluster.store / namespace).glob("replicaset-api-*/main")
    everything = steps((folder / "slot-0/jobs/main/output.log").read_text())
    assert everything == list(range(len(everything)))  # one job, continued: none lost or repeated
    assert not (folder / "slot-1").exists()  # no second job started cold beside it


@pytest.mark.s3
def test_a_drained_pod_with_an_s3_cold_tier_continues_on_the_other_node_from_its_images_in_the_bucket(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    import boto3

    with moto_server(NODE_HOST) as endpoint:  # on the host, where the pods reach it
        bucket = f"torpor-{uuid.uuid4().hex[:8]}"
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
        )
        s3.create_bucket(Bucket=bucket)
        key = tmp_path / "key"
        key.write_bytes(os.urandom(32))
        cluster.kubectl(
            "create", "secret", "generic", "torpor-s3", "-n", namespace,
            f"--from-literal=AWS_ACCESS_KEY_ID={S3_ENV['AWS_ACCESS_KEY_ID']}",
            f"--from-literal=AWS_SECRET_ACCESS_KEY={S3_ENV['AWS_SECRET_ACCESS_KEY']}",
            f"--from-file=key={key}",
        )  # fmt: skip
        settings = {
            "s3_url": f"s3://{bucket}/torpor",
            "s3_endpoint": endpoint,
            "s3_secret": "torpor-s3",
            "env": {"AWS_DEFAULT_REGION": S3_ENV["AWS_DEFAULT_REGION"]},
        }
        with cluster.webhook(namespace, **settings):
            cluster.kubectl("cordon", "node2")  # it starts on node1
            cluster.apply(counter_statefulset(namespace, "counter"))
            first = cluster.running_pod(namespace, "counter-0")
            assert first["spec"]["nodeName"] == "node1"
            cluster.wait_for(
                lambda: len(steps(cluster.logs(namespace, "counter-0"))) > 5, what="the job to count"
            )
            seen = steps(cluster.logs(namespace, "counter-0"))
            cluster.kubectl("uncordon", "node2")
            cluster.kubectl(
                "drain",
                "node1",
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--timeout=150s",
                timeout=200,
            )
            second = cluster.running_pod(namespace, "counter-0", not_uid=first["metadata"]["uid"])
            assert second["spec"]["nodeName"] == "node2"

            def counting() -> str | None:
                text = cluster.logs(namespace, "counter-0")
                return text if len(steps(text)) > 3 else None

            log = cluster.wait_for(counting, what="the job to count on node2")
            found = re.search(r"resumed its hibernated job: restored from (\w+) taken on node1", log)
            assert found, log
            assert steps(log)[0] > seen[-1]

            # its images are in the bucket, under its namespace's and slot's prefix; the store volume
            # has the slot's records only
            prefix = f"torpor/{namespace}/counter-0/slot-0/"
            listed = {item["Key"] for item in s3.list_objects_v2(Bucket=bucket)["Contents"]}
            assert f"{prefix}manifests/{found.group(1)}" in listed
            assert all(name.startswith(prefix) for name in listed), listed
            slot = cluster.store / namespace / "counter-0/slot-0"
            assert (slot / "torpor.db").is_file() and not (slot / "images").exists()
            config = json.loads((slot / "store.json").read_text())
            assert config["url"] == f"s3://{bucket}/{prefix.rstrip('/')}"
            assert config["key_file"] == "/run/torpor-s3/key"  # the Secret's key: encrypted images
            # the credentials are under torpor's own names, which the supervisor keeps from the job
            main = second["spec"]["containers"][0]
            assert "AWS_ACCESS_KEY_ID" not in {e["name"] for e in main["env"]}
            # the StatefulSet deleted, its pod hibernates into the bucket as it goes; the session's
            # operator, without the webhook's settings, leaves the identity whole, saying why
            cluster.kubectl("delete", "statefulset", "-n", namespace, "counter", "--wait=true")
            cluster.wait_for(
                lambda: not cluster.get("pods", "-n", namespace, "--ignore-not-found").get("items"),
                what="the pod to be gone",
            )
            identity = f"{namespace}/counter-0"
            cluster.wait_for(
                lambda: f"{identity}: slot-0 of {identity} has its images in S3" in cluster.operator_log(),
                what="the session's operator to leave the S3 identity",
            )
            assert (cluster.store / identity).is_dir()
            assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents")
            # given them, an operator empties the slot's prefix with the namespace's Secret, then the rest
            once = [TORPOR, "operator", "--once", "--store", str(cluster.store), "--kubeconfig",
                    cluster.env["KUBECONFIG"], "--config", str(cluster.folder / f"torpor-test-{namespace}/webhook.json")]  # fmt: skip
            plain = {
                k: v
                for k, v in cluster.env.items()
                if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
            }
            region = {k: S3_ENV[k] for k in ("AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")}
            ran = subprocess.run(once, capture_output=True, text=True, timeout=120, env={**plain, **region})
            assert f"{identity}: its StatefulSet counter is gone: removed" in ran.stdout + ran.stderr, ran
            assert not s3.list_objects_v2(Bucket=bucket).get("Contents")  # nothing of it left in the bucket
            assert not (cluster.store / identity).exists()
            cluster.wait_for(
                lambda: (
                    not cluster.get("torporidentities", "-n", namespace, "--ignore-not-found").get("items")
                ),
                what="the operator to drop the identity's resource",
            )


def test_a_preempted_pod_is_hibernated_and_resumes_once_the_higher_one_is_gone(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(
        *(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": name},
                "value": value,
            }
            for name, value in ((f"{namespace}-low", 1000), (f"{namespace}-high", 100000))
        )
    )
    cluster.kubectl("cordon", "node2")  # one node: the two pods cannot both have their CPU
    resources = {"requests": {"cpu": "1200m"}}
    low = counter_statefulset(namespace, "low", priorityClassName=f"{namespace}-low")
    low["spec"]["template"]["spec"]["containers"][0]["resources"] = resources
    cluster.apply(low)
    first = cluster.running_pod(namespace, "low-0")
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, "low-0"))) > 5, what="the low job to count")
    seen = steps(cluster.logs(namespace, "low-0"))
    high = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "high", "namespace": namespace},
        "spec": {
            "priorityClassName": f"{namespace}-high",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": "localhost/hostusr:1", "imagePullPolicy": "Never",
                 "command": ["sleep", "3600"], "resources": resources,
                 "volumeMounts": [{"name": "usr", "mountPath": "/usr", "readOnly": True}]}
            ],
            "volumes": [{"name": "usr", "hostPath": {"path": "/usr", "type": "Directory"}}],
        },
    }  # fmt: skip
    cluster.apply(high)
    cluster.running_pod(namespace, "high")  # once the low one has gone: it was hibernated meanwhile
    messages = {(e["reason"], e["message"]) for e in cluster.events(namespace, "low-0")}
    assert any(reason == "Preempted" or "preempt" in message.lower() for reason, message in messages), (
        messages
    )
    assert any(reason == "Hibernated" for reason, _ in messages), messages
    pending = cluster.get("pod", "-n", namespace, "low-0")
    assert pending["status"]["phase"] == "Pending"  # its StatefulSet made it again; no room yet
    cluster.kubectl("delete", "pod", "-n", namespace, "high", "--wait=true")
    cluster.running_pod(namespace, "low-0", not_uid=first["metadata"]["uid"])

    def counting() -> str | None:
        text = cluster.logs(namespace, "low-0")
        return text if len(steps(text)) > 3 else None

    log = cluster.wait_for(counting, what="the low job to count again")
    assert "resumed its hibernated job" in log
    assert steps(log)[0] > seen[-1]  # where it was, not from the start


@pytest.mark.torch
def test_a_training_pod_drained_mid_run_finishes_on_the_other_node_with_bit_identical_losses(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    total, gate_step = 80, 40
    reference = subprocess.run(
        [sys.executable, "-u", str(JOBS / "train.py"), str(total)], capture_output=True, text=True, check=True
    ).stdout
    gate = tmp_path / "gate"
    gate.mkdir()
    # it waits before step 40 until the test lets it go on: drained mid-run however slow the machine
    script = f"{sys.executable} -u /jobs/train.py {total} 0 {gate_step} /gate/go && exec sleep 3600"
    train = counter_statefulset(namespace, "train")
    pod_spec = train["spec"]["template"]["spec"]
    pod_spec["containers"][0]["command"] = ["sh", "-c", script]
    pod_spec["containers"][0]["volumeMounts"].append({"name": "gate", "mountPath": "/gate"})
    pod_spec["volumes"].append({"name": "gate", "hostPath": {"path": str(gate), "type": "Directory"}})
    cluster.kubectl("cordon", "node2")
    cluster.apply(train)
    first = cluster.running_pod(namespace, "train-0")
    cluster.wait_for(
        lambda: f"step {gate_step - 1} " in cluster.logs(namespace, "train-0"),
        timeout=180,
        what="the gate",
        story=lambda: cluster.logs(namespace, "train-0")[-3000:] + cluster.story(namespace, "train-0"),
    )
    before = cluster.logs(namespace, "train-0")
    cluster.kubectl("uncordon", "node2")
    cluster.kubectl(
        "drain", "node1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=150s", timeout=200
    )
    second = cluster.running_pod(namespace, "train-0", not_uid=first["metadata"]["uid"])
    assert second["spec"]["nodeName"] == "node2"
    cluster.wait_for(
        lambda: "resumed its hibernated job" in cluster.logs(namespace, "train-0"), what="the resume"
    )
    (gate / "go").touch()
    after = cluster.wait_for(
        lambda: text if "done" in (text := cluster.logs(namespace, "train-0")) else None,
        timeout=180,
        what="the training to finish on node2",
    )
    losses = re.findall(r"^step \d+ loss \S+$", before + after, re.M)
    assert losses == re.findall(r"^step \d+ loss \S+$", reference, re.M)  # every step once, bit for bit


def test_a_pod_whose_processes_all_died_at_once_comes_back_from_its_last_periodic_checkpoint(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(counter_statefulset(namespace, "crash"))  # a checkpoint every 3 s
    first = cluster.running_pod(namespace, "crash-0")
    uid = first["metadata"]["uid"]
    cluster.wait_for(
        lambda: (
            cluster.get("pod", "-n", namespace, "crash-0")["metadata"]
            .get("annotations", {})
            .get("torpor.dev/last-checkpoint")
        ),
        what="a periodic checkpoint",
    )
    # everything of the container at once, as when its node loses power: no SIGTERM, no hibernation
    # found first, then killed: the first one killed may be its PID namespace's init, which takes the rest along
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"TORPOR_POD_UID={uid}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    assert len(found) >= 2, found  # the supervisor (and its init), the launcher, the job
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def restarted() -> str | None:
        text = cluster.logs(namespace, "crash-0")
        return text if "recovered" in text and len(steps(text)) > 2 else None

    log = cluster.wait_for(restarted, what="the container to come back")  # the kubelet restarts it
    assert re.search(r"recovered: restored from \w+ taken on node\d \d+ s ago", log), log
    assert steps(log)[0] > 0  # from the checkpoint, not from the start
    messages = {(e["reason"], e["message"]) for e in cluster.events(namespace, "crash-0")}
    assert any(reason == "Restored" and "recovered" in message for reason, message in messages), messages


def test_a_pod_whose_job_cannot_be_hibernated_is_deleted_normally_with_a_warning(
    cluster: Cluster, namespace: str
) -> None:
    sts = counter_statefulset(namespace, "ring")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ring", "namespace": namespace, "labels": {"torpor.dev/checkpoint": "true"}},
        "spec": sts["spec"]["template"]["spec"],
    }
    pod["spec"]["containers"][0]["command"] = ["python3", "-u", "/jobs/io_uring_job.py", "fd"]
    cluster.apply(pod)
    cluster.running_pod(namespace, "ring")
    cluster.wait_for(lambda: "tick 3" in cluster.logs(namespace, "ring"), what="the job to tick")
    started = time.monotonic()
    cluster.kubectl("delete", "pod", "-n", namespace, "ring", "--wait=true", timeout=120)
    assert time.monotonic() - started < 60  # within its grace period: not killed at its end
    warnings = [e for e in cluster.events(namespace, "ring") if e["reason"] == "HibernateFailed"]
    assert warnings and warnings[0]["type"] == "Warning" and "io_uring" in warnings[0]["message"]


def test_the_operator_keeps_a_resource_per_identity_and_removes_a_deleted_statefulset_s_checkpoints(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(counter_statefulset(namespace, "owned"))  # a checkpoint every 3 s
    cluster.running_pod(namespace, "owned-0")

    def listed() -> dict[str, Any] | None:
        found = cluster.get("torporidentities", "-n", namespace, "owned-0", "--ignore-not-found")
        return found if found and found.get("status", {}).get("lastCheckpoint") else None

    identity = cluster.wait_for(listed, what="the operator to list the identity's checkpoints")
    assert identity["spec"] == {"identity": f"{namespace}/owned-0", "owner": "StatefulSet/owned"}
    (slot,) = identity["status"]["slots"]
    assert slot["pod"] == "owned-0" and slot["node"] in ("node1", "node2") and slot["held"] is True
    assert slot["checkpoints"] and slot["checkpoints"][-1]["id"] == identity["status"]["lastCheckpoint"]["id"]
    folder = cluster.store / namespace / "owned-0"
    assert folder.is_dir()

    cluster.kubectl("delete", "statefulset", "-n", namespace, "owned", "--wait=true")  # its pod hibernates
    cluster.wait_for(
        lambda: (
            not folder.exists()
            and not cluster.get("torporidentities", "-n", namespace, "--ignore-not-found").get("items")
        ),
        what="the operator to remove the deleted StatefulSet's checkpoints",
    )


def _hibernated_state(cluster: Cluster, namespace: str, name: str) -> bool:
    found = cluster.get("torporidentities", "-n", namespace, name, "--ignore-not-found")
    slots = (found or {}).get("status", {}).get("slots", [])
    return bool(slots) and all(slot["state"] == "hibernated" and not slot["held"] for slot in slots)


def test_a_statefulset_s_identity_annotated_to_hibernate_stays_hibernated_until_the_annotation_goes(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(counter_statefulset(namespace, "sleepy"))
    first = cluster.running_pod(namespace, "sleepy-0")
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, "sleepy-0"))) > 3, what="the job to count")
    cluster.wait_for(
        lambda: cluster.get("torporidentities", "-n", namespace, "sleepy-0", "--ignore-not-found"),
        what="the operator to make the identity's resource",
    )
    # on its TorporIdentity (a pod's annotation goes the same way): moved to the StatefulSet
    cluster.kubectl("annotate", "torporidentities", "-n", namespace, "sleepy-0", "torpor.dev/hibernate=true")

    def scaled_down() -> dict[str, Any] | None:
        found = cluster.get("statefulset", "-n", namespace, "sleepy")
        return found if found["spec"]["replicas"] == 0 else None

    statefulset = cluster.wait_for(scaled_down, what="the operator to scale the StatefulSet to zero")
    annotations = statefulset["metadata"]["annotations"]
    assert annotations["torpor.dev/hibernate"] == "true"
    assert annotations["torpor.dev/replicas-before-hibernation"] == "1"
    resource = cluster.get("torporidentities", "-n", namespace, "sleepy-0")
    assert "torpor.dev/hibernate" not in resource["metadata"].get("annotations", {})  # moved
    cluster.wait_for(
        lambda: not cluster.get("pod", "-n", namespace, "sleepy-0", "--ignore-not-found"),
        what="the pod to go",
    )
    cluster.wait_for(lambda: _hibernated_state(cluster, namespace, "sleepy-0"), what="the job hibernated")
    assert any(e["reason"] == "Hibernated" for e in cluster.events(namespace, "sleepy-0"))
    seen = steps((cluster.store / namespace / "sleepy-0/slot-0/jobs/main/output.log").read_text())
    time.sleep(3)  # several passes of the operator: it stays hibernated
    assert cluster.get("statefulset", "-n", namespace, "sleepy")["spec"]["replicas"] == 0

    cluster.kubectl("annotate", "statefulset", "-n", namespace, "sleepy", "torpor.dev/hibernate-")
    cluster.running_pod(namespace, "sleepy-0", not_uid=first["metadata"]["uid"])

    def counting() -> str | None:
        text = cluster.logs(namespace, "sleepy-0")
        return text if len(steps(text)) > 2 else None

    log = cluster.wait_for(counting, what="the job to count again")
    assert "resumed its hibernated job" in log, log
    assert steps(log)[0] == seen[-1] + 1
    woken = cluster.get("statefulset", "-n", namespace, "sleepy")
    assert woken["spec"]["replicas"] == 1
    assert "torpor.dev/replicas-before-hibernation" not in woken["metadata"].get("annotations", {})


def test_a_bare_pod_annotated_to_hibernate_is_deleted_and_created_again_when_the_annotation_goes(
    cluster: Cluster, namespace: str
) -> None:
    template = counter_statefulset(namespace, "lone")["spec"]["template"]
    metadata = {**template["metadata"], "name": "lone", "namespace": namespace}
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
    first = cluster.running_pod(namespace, "lone")
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, "lone"))) > 3, what="the job to count")
    resource = "pod-lone.main"  # its identity is team/pod-lone/main
    cluster.wait_for(
        lambda: cluster.get("torporidentities", "-n", namespace, resource, "--ignore-not-found"),
        what="the operator to make the identity's resource",
    )
    cluster.kubectl("annotate", "pod", "-n", namespace, "lone", "torpor.dev/hibernate=true")
    cluster.wait_for(
        lambda: not cluster.get("pod", "-n", namespace, "lone", "--ignore-not-found"), what="the pod to go"
    )
    cluster.wait_for(lambda: _hibernated_state(cluster, namespace, resource), what="the job hibernated")
    held = cluster.get("torporidentities", "-n", namespace, resource)
    assert held["metadata"]["annotations"]["torpor.dev/hibernate"] == "true"
    copy = cluster.store / ".operator/hibernated" / namespace / "lone.json"
    assert copy.is_file() and copy.stat().st_mode & 0o077 == 0
    time.sleep(3)
    assert not cluster.get("pod", "-n", namespace, "lone", "--ignore-not-found")  # kept hibernated

    cluster.kubectl("annotate", "torporidentities", "-n", namespace, resource, "torpor.dev/hibernate-")
    second = cluster.running_pod(namespace, "lone", not_uid=first["metadata"]["uid"])
    assert second["spec"]["containers"][0]["command"][1:4] == ["pod", "--", "python3"]  # changed once
    assert "torpor.dev/hibernate" not in second["metadata"]["annotations"]

    def counting() -> str | None:
        text = cluster.logs(namespace, "lone")
        return text if len(steps(text)) > 2 else None

    log = cluster.wait_for(counting, what="the job to count again")
    assert "resumed its hibernated job" in log, log
    cluster.wait_for(lambda: not copy.exists(), what="the operator to drop its copy")


def test_a_namespace_deleted_and_made_again_under_its_name_does_not_get_the_old_one_s_job(
    cluster: Cluster, namespace: str
) -> None:
    template = counter_statefulset(namespace, "lone")["spec"]["template"]
    metadata = {**template["metadata"], "name": "lone", "namespace": namespace}
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
    cluster.apply(bare)
    first = cluster.running_pod(namespace, "lone")
    env = {e["name"]: e.get("value") for e in first["spec"]["containers"][0]["env"]}
    old_uid = cluster.get("namespace", namespace)["metadata"]["uid"]
    assert env["TORPOR_POD_NAMESPACE_UID"] == old_uid  # the webhook read it for the pod
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, "lone"))) > 3, what="the job to count")
    cluster.kubectl("delete", "pod", "-n", namespace, "lone", "--wait=true", timeout=120)  # hibernated
    cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")
    cluster.namespace(namespace)  # the same name, perhaps someone else's: another UID
    assert cluster.get("namespace", namespace)["metadata"]["uid"] != old_uid
    cluster.apply(bare)
    cluster.running_pod(namespace, "lone")

    def counting() -> str | None:
        text = cluster.logs(namespace, "lone")
        return text if len(steps(text)) > 2 else None

    log = cluster.wait_for(
        counting, what="the new namespace's pod to count", story=lambda: cluster.story(namespace, "lone")
    )
    # cold: the operator removed the old namespace's checkpoints, or the pod told them apart by its UID
    assert steps(log)[0] == 0 and "resumed its hibernated job" not in log, log


def counter_job(cluster: Cluster, namespace: str, name: str, backoff_limit: int) -> None:
    """A Job of one counter pod (the counter StatefulSet's template, never restarted in place)."""
    template = counter_statefulset(namespace, name)["spec"]["template"]
    template["spec"]["restartPolicy"] = "Never"
    cluster.apply(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"backoffLimit": backoff_limit, "template": template},
        }
    )


def test_a_job_s_pod_annotated_to_hibernate_is_refused_with_a_warning(
    cluster: Cluster, namespace: str
) -> None:
    counter_job(cluster, namespace, "batch", backoff_limit=0)
    name = cluster.wait_for(
        lambda: next(iter(cluster.get("pods", "-n", namespace, "-l", "job-name=batch")["items"]), None),
        what="the Job's pod",
    )["metadata"]["name"]
    cluster.running_pod(namespace, name)
    cluster.kubectl("annotate", "pod", "-n", namespace, name, "torpor.dev/hibernate=true")

    def refused() -> list[dict[str, Any]]:
        return [e for e in cluster.events(namespace, name) if e["reason"] == "HibernateRefused"]

    (event,) = cluster.wait_for(refused, what="the operator to refuse")
    assert event["type"] == "Warning" and "a Job cannot be scaled to zero" in event["message"]
    time.sleep(3)
    assert len(refused()) == 1  # said once
    assert cluster.get("pod", "-n", namespace, name)["status"]["phase"] == "Running"


def test_a_job_s_deleted_pod_is_hibernated_and_the_job_s_next_pod_resumes_it_instead_of_the_job_completing(
    cluster: Cluster, namespace: str
) -> None:
    counter_job(cluster, namespace, "batch", backoff_limit=4)

    def running_pod(but: str = "") -> str | None:
        for pod in cluster.get("pods", "-n", namespace, "-l", "job-name=batch")["items"]:
            live = pod["status"].get("phase") == "Running" and "deletionTimestamp" not in pod["metadata"]
            if live and pod["metadata"]["name"] != but:
                return str(pod["metadata"]["name"])
        return None

    first = cluster.wait_for(running_pod, what="the Job's pod")
    cluster.wait_for(lambda: len(steps(cluster.logs(namespace, first))) > 3, what="the job to count")
    cluster.kubectl("delete", "pod", "-n", namespace, first, timeout=120)
    second = cluster.wait_for(lambda: running_pod(but=first), what="the Job's next pod")

    def counting() -> str | None:
        text = cluster.logs(namespace, second)
        return text if len(steps(text)) > 3 else None

    cluster.wait_for(counting, what="the job to count in the Job's next pod")

    def restored() -> list[dict[str, Any]]:
        return [e for e in cluster.events(namespace, second) if e["reason"] == "Restored"]

    # the event, not the log: once (CI) the log of a pod that had waited for the slot showed the job's
    # output but not the supervisor's lines before it, its events did
    story = partial(cluster.story, namespace, second)
    (event,) = cluster.wait_for(restored, what="the Restored event", story=story)
    assert "resumed its hibernated job" in event["message"]
    assert not cluster.get("job", "-n", namespace, "batch")["status"].get("succeeded")
    (folder,) = (cluster.store / namespace).glob("job-batch*/main")
    everything = steps((folder / "slot-0/jobs/main/output.log").read_text())
    assert everything == list(range(len(everything)))  # one job, continued: none lost or repeated


def test_the_manifests_are_valid_for_the_cluster(cluster: Cluster) -> None:
    manifests = ROOT / "deploy/kubernetes"
    bundle = base64.b64encode(cluster.certificate.read_bytes()).decode()
    text = "\n---\n".join(
        (manifests / name).read_text().replace("CA_BUNDLE", bundle)
        for name in ("webhook.yaml", "operator.yaml")
    )
    cluster.kubectl("create", "namespace", "torpor-system")
    try:
        out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=text)
        assert (
            "mutatingwebhookconfiguration.admissionregistration.k8s.io/torpor created (server dry run)" in out
        )
        access = (manifests / "pod-access.yaml").read_text().replace("NAMESPACE", "torpor-system")
        cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=access)
    finally:
        cluster.kubectl("delete", "namespace", "torpor-system", "--wait=false", check=False)
