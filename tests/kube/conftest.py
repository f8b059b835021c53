"""The cluster the tests marked ``k8s`` run on: brought up once per test session (tests/kube/cluster.py)
and torn down after; skipped where it cannot be made, unless the run needs it (TORPOR_TESTS_NEED_K8S=1,
as ``make suite`` sets)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .cluster import Cluster, kubernetes_missing, running


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = kubernetes_missing()
    if why is not None:
        if os.environ.get("TORPOR_TESTS_NEED_K8S") == "1":
            pytest.fail(f"TORPOR_TESTS_NEED_K8S=1, but {why}")
        pytest.skip(why)
    with running(tmp_path_factory.mktemp("k8s")) as instance:
        yield instance
