"""Kubernetes: from `kubectl drain` of the job's node to the job computing again on the other node, with
torpor (hibernated by its pod's supervisor, resumed by the next pod) against the same StatefulSet's pod
without torpor (killed, started again cold), on the two-node test cluster (tests/kube/cluster.py).

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from benchdoc import median, publish, say

from kube.cluster import Cluster, counter_statefulset, kubernetes_missing, running

STEP = re.compile(r"^step \d+$", re.M)


def first_step_after(cluster: Cluster, namespace: str, pod: str, uid: str, timeout: float = 300) -> float:
    """When the pod that replaced ``uid`` first printed a step (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = cluster.get("pod", "-n", namespace, pod, "--ignore-not-found")
        if found and found["metadata"]["uid"] != uid and STEP.search(cluster.logs(namespace, pod)):
            return time.monotonic()
        time.sleep(0.1)
    raise RuntimeError(f"{namespace}/{pod} did not compute again within {timeout:.0f} s")


def sample(cluster: Cluster, torpor: bool, start_s: float) -> dict[str, float]:
    namespace = f"tpt-{uuid.uuid4().hex[:6]}"
    cluster.namespace(namespace)
    try:
        cluster.kubectl("cordon", "node2")
        command = ["python3", "-u", "/jobs/slow_start.py", str(start_s)]
        cluster.apply(counter_statefulset(namespace, "job", command=command, opted_in=torpor))
        first = cluster.running_pod(namespace, "job-0")
        cluster.wait_for(
            lambda: STEP.search(cluster.logs(namespace, "job-0")), timeout=start_s + 120, what="steps"
        )
        cluster.kubectl("uncordon", "node2")
        began = time.monotonic()
        cluster.kubectl(
            "drain", "node1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=200s", timeout=260
        )
        drained = time.monotonic()
        back = first_step_after(cluster, namespace, "job-0", first["metadata"]["uid"])
        result = {"drain_s": drained - began, "back_s": back - began}
        if torpor:
            events = [e["message"] for e in cluster.events(namespace, "job-0") if e["reason"] == "Hibernated"]
            frozen = re.search(r"frozen ([\d.]+) s, (\d+) MiB", events[0]) if events else None
            if frozen:
                result["frozen_s"], result["image_mib"] = float(frozen.group(1)), float(frozen.group(2))
        return result
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=180s", check=False)
        for node in ("node1", "node2"):
            cluster.kubectl("uncordon", node, check=False)


def _list(samples: list[dict[str, float]], key: str, digits: int = 1) -> str:
    return ", ".join(f"{s[key]:.{digits}f}" if key in s else "?" for s in samples)


def section(torpor: list[dict[str, float]], cold: list[dict[str, float]], start_s: float) -> str:
    back_t, back_c = median([s["back_s"] for s in torpor]), median([s["back_s"] for s in cold])
    lines = [
        "## Kubernetes: a drained node's pod computing again on the other node (`scripts/bench_kube.py`)",
        "",
        f"Machine: {platform.node() or 'this machine'}, {os.cpu_count()} cores, Linux {platform.release()}; "
        "the two-node test cluster of `scripts/k8s/cluster.sh` (Kubernetes v1.20.2, both nodes on this "
        "machine, the store a host folder). The job starts up for "
        f"{start_s:g} s (tests/jobs/slow_start.py: it computes and keeps 128 MiB of tables), then steps "
        "every 0.1 s; a StatefulSet of one pod on node1, `kubectl drain node1`, timed to the first step "
        "the new pod on node2 prints. Cold: the same StatefulSet without the `torpor.dev/checkpoint` label.",
        "",
        "| | drain → computing again (median) | samples (s) | drain itself (s) | frozen (s) |",
        "|---|---|---|---|---|",
        f"| torpor | {back_t:.1f} s | {_list(torpor, 'back_s')} | {_list(torpor, 'drain_s')} | "
        f"{_list(torpor, 'frozen_s', 3)} |",
        f"| cold | {back_c:.1f} s | {_list(cold, 'back_s')} | {_list(cold, 'drain_s')} | |",
        "",
        f"torpor is back computing **{back_c / back_t:.1f}×** sooner than the cold start (goal: ≥ 10×). "
        "The freeze is the hibernation's, as its event on the pod reports; the rest of torpor's time is "
        "the drain's eviction, the StatefulSet making the new pod, the kubelet starting it, the fetch "
        "and verify of the image and the restore. The drain itself (the eviction, until the kubelet has "
        f"torn the old pod down) took {_list(torpor, 'drain_s')} s with torpor and {_list(cold, 'drain_s')} s "
        f"without; after it, torpor's pod computed again within "
        f"{_list([{'d': s['back_s'] - s['drain_s']} for s in torpor], 'd')} s.",
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
    torpor: list[dict[str, float]] = []
    cold: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-kube-") as folder, running(Path(folder)) as cluster:
        for n in range(args.samples):
            for with_torpor, results in ((True, torpor), (False, cold)):
                result = sample(cluster, with_torpor, args.start_s)
                results.append(result)
                say(f"sample {n + 1} {'torpor' if with_torpor else 'cold'}: {result}")
    publish("kube", section(torpor, cold, args.start_s), print_only=args.no_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
