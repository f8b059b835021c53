"""Keeping a pod hibernated (torpor.policy.hold): what is scaled, to what, and a bare pod's steps."""

from __future__ import annotations

import pytest

from torpor.policy.hold import PodStep, bare_pod, scale, target, wanted
from torpor.policy.pod import Owner


def test_the_annotation_is_true_or_not() -> None:
    assert wanted({"torpor.dev/hibernate": "true"}) and wanted({"torpor.dev/hibernate": "True"})
    assert not wanted({"torpor.dev/hibernate": "false"}) and not wanted({}) and not wanted(None)


def test_a_pod_is_kept_hibernated_by_its_controller_or_a_replicaset_s_deployment() -> None:
    assert target(None) is None  # a bare pod: deleted itself
    assert target(Owner("StatefulSet", "web")) == Owner("StatefulSet", "web")
    assert target(Owner("ReplicaSet", "api-5d9f"), Owner("Deployment", "api")) == Owner("Deployment", "api")
    assert target(Owner("ReplicaSet", "lone")) == Owner("ReplicaSet", "lone")
    for kind in ("Job", "DaemonSet"):
        with pytest.raises(ValueError, match=f"a {kind} cannot be scaled to zero"):
            target(Owner(kind, "x"))
    with pytest.raises(ValueError, match="Rollout"):
        target(Owner("ReplicaSet", "r-1"), Owner("Rollout", "r"))


def test_a_controller_goes_to_zero_remembering_its_count_and_gets_it_back() -> None:
    assert scale(True, 3, None) == (0, 3)
    assert scale(True, 0, 3) is None  # hibernated already
    assert scale(True, 0, None) is None  # nothing to hibernate, nothing to remember
    assert scale(True, 2, 3) == (0, 2)  # scaled up while hibernated: down again, and that count kept
    assert scale(False, 0, 3) == (3, None)
    assert scale(False, 5, 3) == (5, None)  # someone scaled it already: their count stands
    assert scale(False, 3, None) is None


def test_a_bare_pod_is_saved_and_deleted_then_created_again_once() -> None:
    assert bare_pod(True, exists=True, saved=False) == PodStep.SAVE_AND_DELETE
    assert bare_pod(True, exists=True, saved=True) == PodStep.SAVE_AND_DELETE  # still terminating
    assert bare_pod(True, exists=False, saved=True) == PodStep.NOTHING  # hibernated
    assert bare_pod(False, exists=False, saved=True) == PodStep.CREATE
    assert bare_pod(False, exists=True, saved=True) == PodStep.FORGET  # it is back
    assert bare_pod(False, exists=True, saved=False) == PodStep.NOTHING
    assert bare_pod(False, exists=False, saved=False) == PodStep.NOTHING
