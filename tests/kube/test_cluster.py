"""torpor on a real two-node Kubernetes cluster (tests/kube/conftest.py): opted-in pods go through the
admission webhook, are hibernated when they are evicted and continue on the other node."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import JOBS

from .conftest import Cluster

pytestmark = [pytest.mark.k8s, pytest.mark.criu, pytest.mark.slow, pytest.mark.xdist_group("k8s")]


def steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^step (\d+)$", text, re.M)]


def counter_statefulset(namespace: str, name: str) -> dict[str, Any]:
    """A StatefulSet of one pod that counts, opted in by its label; its program comes from the host
    (the test image is an empty skeleton that mounts the host's /usr)."""
    return {
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
                            "command": ["python3", "-u", "/jobs/counter.py"],
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


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = "tpt-drain"
    cluster.namespace(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", check=False)
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
    assert re.search(r"resumed its hibernated job: restored from \w+ taken on node1", log), log
    after = steps(log)
    assert after[0] > seen[-1] and after == list(range(after[0], after[0] + len(after)))
    # the job's whole output, in the store both nodes see: every step once, none lost, none repeated
    output = (cluster.store / namespace / namespace / "counter-0/slot-0/jobs/main/output.log").read_text()
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
