"""Keeping a pod hibernated on ``torpor.dev/hibernate: "true"``: what the operator does, decided from
what it sees (pure; the operator, ``torpor.apps.kubehold``, acts on the answers).

A pod is kept hibernated by having nothing run it: a controller's pod by its controller scaled to zero
(a ReplicaSet's through its Deployment, which would scale the ReplicaSet back), a bare pod by being
deleted, and created again from what the operator saved of it when the annotation goes. Each pod
stopped this way hibernates (its supervisor's SIGTERM), and comes back restored.

* :func:`target` — what is scaled to zero for a pod: its controller, its Deployment, or (``None``) the
  pod itself; ``ValueError`` for a controller that cannot be kept at zero pods (a Job, a DaemonSet).
* :func:`scale` — a controller's replicas (and those it had before, kept in an annotation beside
  them, written in one patch with them) for whether it is to be hibernated.
* :func:`bare_pod` — for a bare pod: delete it (saved first), create it again, or forget what was saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from torpor.policy.pod import Owner

#: on a pod, a controller, or a TorporIdentity: "true" hibernates its pods and keeps them hibernated
HIBERNATE_ANNOTATION = "torpor.dev/hibernate"
#: on a controller the operator scaled to zero: how many replicas it had
REPLICAS_ANNOTATION = "torpor.dev/replicas-before-hibernation"
#: controllers whose replicas the operator sets
SCALABLE = ("StatefulSet", "Deployment", "ReplicaSet", "ReplicationController")


def wanted(annotations: Mapping[str, str] | None) -> bool:
    return str((annotations or {}).get(HIBERNATE_ANNOTATION, "")).lower() == "true"


def target(owner: Owner | None, owners_owner: Owner | None = None) -> Owner | None:
    """What keeps a pod whose controller is ``owner`` (whose own controller is ``owners_owner``)
    hibernated when it has no pods: that controller, a Deployment above a ReplicaSet, or ``None`` for
    a bare pod (deleted itself). ``ValueError`` says why another controller cannot."""
    if owner is None:
        return None
    if owner.kind == "ReplicaSet" and owners_owner is not None:
        owner = owners_owner
    if owner.kind not in SCALABLE:
        raise ValueError(
            f"a pod of a {owner.kind} cannot be kept hibernated: a {owner.kind} cannot be scaled to "
            "zero pods; delete the pod to hibernate it once"
        )
    return owner


def scale(hibernate: bool, replicas: int, saved: int | None) -> tuple[int, int | None] | None:
    """A controller's new (replicas, replicas saved before hibernation) — ``None``: leave it as it is.

    Hibernated, it has none and remembers how many it had (the latest count: one scaled up while it
    is hibernated is scaled to zero again, and that count is the one it gets back); woken, it gets
    that count back — unless someone scaled it already, whose count stands.
    """
    if hibernate:
        return (0, replicas) if replicas > 0 else None
    if saved is None:
        return None
    return (replicas if replicas > 0 else saved, None)


class PodStep(StrEnum):
    NOTHING = "nothing"
    SAVE_AND_DELETE = "save-and-delete"  # save the pod, then delete it: it hibernates
    CREATE = "create"  # create it again from what was saved: it restores
    FORGET = "forget"  # drop what was saved: the pod is back


def bare_pod(hibernate: bool, exists: bool, saved: bool) -> PodStep:
    """For a bare pod: ``hibernate`` whether it is to be hibernated (its annotation or its identity's
    resource's), ``exists`` whether the pod is in the API, ``saved`` whether the operator holds a copy."""
    if hibernate:
        return PodStep.SAVE_AND_DELETE if exists else PodStep.NOTHING
    if not saved:
        return PodStep.NOTHING
    return PodStep.FORGET if exists else PodStep.CREATE
