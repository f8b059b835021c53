"""A pod's identity, what its supervisor does when it starts, and where each slot's checkpoints go in a
shared S3 cold tier (torpor.policy.pod)."""

from __future__ import annotations

import pytest

from torpor.policy.pod import (
    Owner,
    SlotChoice,
    SlotView,
    Start,
    choose_slot,
    exit_after_hibernation,
    grace_for,
    identity,
    mismatch,
    needs,
    on_start,
    orphaned,
    resource_name,
    s3_clean_up,
    slot_cold_tier,
    slot_name,
)


def test_an_identity_is_the_annotation_else_the_statefulset_pod_else_the_controller_else_the_pod() -> None:
    sts = Owner("StatefulSet", "web")
    assert identity("team-a", "web-0", "main", sts, annotation="trainer") == "team-a/trainer"
    assert identity("team-a", "web-0", "main", sts) == "team-a/web-0"
    assert (
        identity("team-a", "", "main", Owner("ReplicaSet", "api-5d9f")) == "team-a/replicaset-api-5d9f/main"
    )
    assert identity("team-a", "", "worker", Owner("Job", "etl")) == "team-a/job-etl/worker"
    assert identity("team-a", "notebook", "main") == "team-a/pod-notebook/main"


@pytest.mark.parametrize(
    ("namespace", "pod", "annotation", "why"),
    [
        ("team-a", "nb", "../team-b/x", "must be lowercase"),
        ("team-a", "nb", "Trainer", "must be lowercase"),
        ("team-a", "", None, "no name yet"),  # a bare pod named by generateName: nothing stays the same
        ("Team_A", "nb", None, "not a DNS label"),
    ],
)
def test_what_cannot_name_an_identity_is_refused_saying_why(
    namespace: str, pod: str, annotation: str | None, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        identity(namespace, pod, "main", None, annotation)


def test_a_hibernated_job_resumes_a_lost_one_is_recovered_an_ended_one_starts_over() -> None:
    assert on_start(None, has_checkpoint=False, ended=False) == Start.COLD
    assert on_start("hibernated", has_checkpoint=True, ended=False) == Start.RESUME
    # its pod went away while it ran (grace period 0, node lost): the latest periodic checkpoint
    assert on_start("running", has_checkpoint=True, ended=False) == Start.RECOVER
    assert on_start("hibernating", has_checkpoint=True, ended=False) == Start.RECOVER
    assert (
        on_start("failed", has_checkpoint=True, ended=False) == Start.RECOVER
    )  # stopped when it could not hibernate
    assert on_start("running", has_checkpoint=False, ended=False) == Start.COLD
    # a job that exited by itself ended its identity: whatever is left, nothing restores
    assert on_start("exited", has_checkpoint=True, ended=True) == Start.COLD
    assert on_start("hibernated", has_checkpoint=True, ended=True) == Start.COLD


def test_the_grace_is_long_enough_to_hibernate() -> None:
    assert grace_for(None, 60) == 60
    assert grace_for(10, 60) == 60
    assert grace_for(300, 60) == 300
    assert grace_for(None, 5) == 30  # Kubernetes' default when the pod asks nothing
    assert slot_name(0) == "slot-0"


def test_a_pod_continues_a_job_only_with_the_same_image_and_volumes() -> None:
    volumes = [
        {"name": "data", "persistentVolumeClaim": {"claimName": "data-web-0"}},
        {"name": "conf", "configMap": {"name": "web", "items": []}},
        {"name": "scratch", "emptyDir": {}},
    ]
    mounts = [
        {"name": "data", "mountPath": "/data"},
        {"name": "conf", "mountPath": "/etc/web", "subPath": "web.conf"},
        {"name": "scratch", "mountPath": "/tmp"},
    ]
    then = needs("web:1", mounts, volumes)
    assert then == {
        "image": "web:1",
        "volumes": [
            "/data <- persistentVolumeClaim:data-web-0",
            "/etc/web <- configMap:web/web.conf",
            "/tmp <- emptyDir:",
        ],
    }
    assert (
        mismatch(then, needs("web:1", list(reversed(mounts)), volumes)) is None
    )  # order is not a difference
    assert mismatch(then, needs("web:2", mounts, volumes)) == "its image differs (web:1 then, web:2 now)"
    other = [{**volumes[0], "persistentVolumeClaim": {"claimName": "data-web-1"}}, *volumes[1:]]
    assert mismatch(then, needs("web:1", mounts, other)) == (
        "its volumes differ (-/data <- persistentVolumeClaim:data-web-0, +/data <- persistentVolumeClaim:data-web-1)"
    )
    assert mismatch({}, then) is None and mismatch(then, {}) is None  # a pod the webhook did not make


def test_the_operator_names_an_identity_s_resource_and_removes_it_only_with_its_controller() -> None:
    assert resource_name("team-a/web-0") == "web-0"
    assert resource_name("team-a/replicaset-api-5d9f/main") == "replicaset-api-5d9f.main"
    assert orphaned(Owner("StatefulSet", "web"), owner_exists=False)
    assert not orphaned(Owner("StatefulSet", "web"), owner_exists=True)
    assert not orphaned(None, owner_exists=False)  # a bare pod's: the same pod may come again
    # a deleted namespace takes every identity of it, a bare pod's too
    assert orphaned(None, owner_exists=True, namespace_exists=False)
    assert orphaned(Owner("StatefulSet", "web"), owner_exists=True, namespace_exists=False)


def test_an_interchangeable_pod_continues_a_job_waits_for_one_being_hibernated_or_takes_a_free_slot() -> None:
    view = SlotView
    assert choose_slot([]) == SlotChoice(0)
    assert choose_slot([view(0, False, True, False)]) == SlotChoice(1)  # held: a new slot
    assert choose_slot([view(0, False, True, True)]) == SlotChoice(0, wait=True)  # being hibernated
    free_job = [view(0, True, False, False), view(1, False, True, True), view(2, True, True, False)]
    assert choose_slot(free_job) == SlotChoice(2)  # a free job to continue comes first
    assert choose_slot(free_job[:2]) == SlotChoice(1, wait=True)  # then one about to be free
    assert choose_slot([view(1, True, False, False), view(0, False, True, False)]) == SlotChoice(1)
    assert choose_slot([view(0, False, True, False), view(2, False, True, False)]) == SlotChoice(1)


def test_each_slot_has_its_own_s3_prefix_under_its_namespace_s() -> None:
    assert slot_cold_tier("s3://ckpt", "team-a/web-0", 0) == "s3://ckpt/team-a/web-0/slot-0"
    assert (
        slot_cold_tier("s3://ckpt/torpor/", "team-a/replicaset-api-5d9f/main", 2)
        == "s3://ckpt/torpor/team-a/replicaset-api-5d9f/main/slot-2"
    )
    # two slots of one identity, or one name in two namespaces: never the same prefix
    assert slot_cold_tier("s3://b", "team-a/web-0", 1) != slot_cold_tier("s3://b", "team-a/web-0", 0)
    assert slot_cold_tier("s3://b", "team-b/web-0", 0) != slot_cold_tier("s3://b", "team-a/web-0", 0)


@pytest.mark.parametrize(
    ("base", "identity", "why"),
    [
        ("s3://b", "team-a/../team-b/web-0", "cannot name an S3 prefix"),
        ("s3://b", "team-a/.hidden", "cannot name an S3 prefix"),
        ("s3://b", "team-a/Web_0", "cannot name an S3 prefix"),
        ("s3://b", "team-a//web-0", "cannot name an S3 prefix"),
        ("s3://b", "web-0", "must be NAMESPACE/NAME"),
        ("/var/lib/store", "team-a/web-0", "is not an S3 cold tier"),
        ("s3:///prefix", "team-a/web-0", "is not an S3 cold tier"),
    ],
)
def test_what_cannot_make_a_slot_s_s3_prefix_is_refused_saying_why(
    base: str, identity: str, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        slot_cold_tier(base, identity, 0)


def test_a_job_s_hibernated_pod_exits_as_stopped_so_that_its_job_replaces_it_instead_of_ending() -> None:
    assert exit_after_hibernation("Job/batch") == 143
    for owner in ("", "StatefulSet/web", "ReplicaSet/web-5d8f", "DaemonSet/Job"):
        assert exit_after_hibernation(owner) == 0


def test_the_pods_own_file_systems_are_carried_and_volumes_are_not() -> None:
    from torpor.policy.pod import pod_local

    assert pod_local("/", "overlay", "/")  # the container's root file system
    assert pod_local("/scratch", "ext4", "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/scratch")
    assert pod_local("/dev/shm", "tmpfs", "/")
    assert not pod_local("/data", "ext4", "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pvc-1/mount")
    assert not pod_local("/store", "nfs4", "/exports/torpor")
    assert not pod_local("/host", "ext4", "/srv/shared")  # a hostPath


def test_checkpoints_of_an_earlier_namespace_of_the_same_name_are_told_apart_where_both_uids_are_known() -> (
    None
):
    from torpor.policy.pod import Owner, orphaned, remade_namespace

    assert remade_namespace("uid-1", "uid-2")
    assert not remade_namespace("uid-1", "uid-1")
    assert (
        not remade_namespace(None, "uid-2")
        and not remade_namespace("uid-1", "")
        and not remade_namespace("", "")
    )
    bare = None
    assert orphaned(bare, True, namespace_exists=True, namespace_remade=True)
    assert not orphaned(bare, True, namespace_exists=True)
    assert orphaned(Owner("StatefulSet", "web"), True, namespace_exists=True, namespace_remade=True)


def test_the_operator_deletes_only_the_prefix_and_endpoint_the_webhook_gives_the_slot() -> None:
    base, at = "s3://ckpt/torpor", "http://minio:9000"
    ours = "s3://ckpt/torpor/team-a/web-0/slot-1"
    assert s3_clean_up(ours, at, base, at, "team-a/web-0", 1) is None
    assert s3_clean_up(ours + "/", at, base, at, "team-a/web-0", 1) is None
    assert s3_clean_up("s3://ckpt/team-a/web-0/slot-1", None, "s3://ckpt", None, "team-a/web-0", 1) is None
    refused = {
        "no s3_url": s3_clean_up(ours, at, None, at, "team-a/web-0", 1),
        "another slot's": s3_clean_up(ours, at, base, at, "team-a/web-0", 0),
        "another namespace's": s3_clean_up(
            "s3://ckpt/torpor/team-b/web-0/slot-1", at, base, at, "team-a/web-0", 1
        ),
        "the whole bucket": s3_clean_up("s3://ckpt", at, base, at, "team-a/web-0", 1),
        "above its prefix": s3_clean_up("s3://ckpt/torpor/team-a", at, base, at, "team-a/web-0", 1),
        "another server": s3_clean_up(ours, "http://evil:9000", base, at, "team-a/web-0", 1),
        "AWS instead": s3_clean_up(ours, None, base, at, "team-a/web-0", 1),
        "a bad identity": s3_clean_up(ours, at, base, at, "team-a/../b", 1),
    }
    assert all(refused.values()), refused
    assert "no s3_url" in str(refused["no s3_url"]) and "not at its prefix" in str(refused["another slot's"])
    assert "endpoint http://evil:9000" in str(refused["another server"])
