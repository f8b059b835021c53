"""What torpor does for a Kubernetes pod, decided from what it is told: pure.

* :func:`identity` — which checkpoints a pod's job is the continuation of (its *identity*): the
  ``torpor.dev/identity`` annotation, else a StatefulSet's pod name, else the pod's controller and the
  container, else the bare pod's name and the container. Always within the pod's namespace.
* :func:`on_start` — what the in-pod supervisor does when its pod starts: resume a hibernated job,
  recover the job of a pod that went away without hibernating it (its latest checkpoint), or start
  the command cold.
* :func:`grace_for` — the termination grace a pod gets, long enough to hibernate its job.
* :func:`mismatch` — why a pod cannot continue the job of an earlier one: its image or its volumes
  differ (the job's files would not be there, or not the same).
* :func:`resource_name`, :func:`orphaned` — the operator's: the name of an identity's resource, and
  whether its checkpoints go because the controller whose pods it was is gone.
* :func:`slot_cold_tier` — where a slot's checkpoint images go in a shared S3 cold tier: a prefix of
  its own, under its namespace's; :func:`s3_clean_up` — whether the operator may delete that prefix.

The supervisor (``torpor.core.pod``) reads records and signals and acts on these answers; the admission
webhook (``torpor.core.admission``) computes the identity once, when the pod is created.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

#: the label a user puts on a pod (or a pod template) to have it hibernated instead of killed
OPT_IN_LABEL = "torpor.dev/checkpoint"
IDENTITY_ANNOTATION = "torpor.dev/identity"
EVERY_ANNOTATION = "torpor.dev/checkpoint-every"
LAZY_ANNOTATION = "torpor.dev/lazy-restore"

#: what an identity's parts may be: a DNS label, as namespaces and most object names are
_PART = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class Owner:
    """A controller that owns the pod (its ``ownerReferences`` entry with ``controller: true``)."""

    kind: str
    name: str


def identity(
    namespace: str, pod_name: str, container: str, owner: Owner | None = None, annotation: str | None = None
) -> str:
    """The identity ``NAMESPACE/…`` of a pod's container; ``ValueError`` (saying why) if none can be made.

    - ``torpor.dev/identity: NAME``: ``NAMESPACE/NAME`` — the user says which pods continue each other.
    - a StatefulSet's pod: ``NAMESPACE/POD`` — its name (``web-0``) is what is stable across nodes.
    - another controller's (a Job, a ReplicaSet): ``NAMESPACE/KIND-NAME/CONTAINER``. Its pods are
      interchangeable; each running one takes a free slot of the identity (:func:`slot_name`), and a
      new pod continues one whose pod went away.
    - a bare pod: ``NAMESPACE/pod-NAME/CONTAINER``: the same pod created again.
    """
    if not _PART.match(namespace):
        raise ValueError(f"namespace '{namespace}' is not a DNS label")
    if annotation is not None:
        if not _PART.match(annotation):
            raise ValueError(
                f"{IDENTITY_ANNOTATION} '{annotation}' must be lowercase letters, digits, '-' and '.'"
            )
        return f"{namespace}/{annotation}"
    if owner is not None and owner.kind == "StatefulSet":
        parts = [pod_name]
    elif owner is not None:
        parts = [f"{owner.kind.lower()}-{owner.name}", container]
    else:
        parts = [f"pod-{pod_name}", container]
    for part in parts:
        if not _PART.match(part):
            raise ValueError(f"'{part}' cannot name an identity (no name yet, or not a DNS label)")
    return "/".join([namespace, *parts])


def slot_name(n: int) -> str:
    """The folder of an identity's ``n``-th slot: one per pod of that identity running at once."""
    return f"slot-{n}"


def slot_cold_tier(base: str, identity: str, n: int) -> str:
    """The S3 cold tier of slot ``n`` of ``identity`` in the shared one ``base`` (``s3://BUCKET[/PREFIX]``):
    ``BASE/NAMESPACE/NAME[/...]/slot-N``; ``ValueError`` (saying why) for what cannot name one.

    Each slot is a state directory of its own, whose garbage collection deletes the chunks none of *its*
    checkpoints use: two slots sharing a prefix would delete each other's. The namespace always comes
    first, so tenants sharing a bucket never share a prefix, and each namespace's credentials can be
    limited to ``BASE/NAMESPACE/``. Every part of the identity must be a DNS label, as
    :func:`identity` makes them: nothing else (``..``, ``/``, a dot first) can reach another's prefix.
    """
    if not base.startswith("s3://") or not base.removeprefix("s3://").split("/")[0]:
        raise ValueError(f"'{base}' is not an S3 cold tier: s3://BUCKET[/PREFIX]")
    parts = identity.split("/")
    if len(parts) < 2:
        raise ValueError(f"identity '{identity}' must be NAMESPACE/NAME[/...]")
    for part in parts:
        if not _PART.match(part) or ".." in part:
            raise ValueError(f"'{part}' of identity '{identity}' cannot name an S3 prefix (not a DNS label)")
    if n < 0:
        raise ValueError(f"no slot {n}")
    return "/".join([base.rstrip("/"), *parts, slot_name(n)])


@dataclass(frozen=True)
class SlotView:
    """What an interchangeable pod sees of one slot of its identity as it starts."""

    n: int
    #: no pod holds it now
    free: bool
    #: it has a job to continue: one that did not end by itself (hibernated, or left by a pod that
    #: went away without hibernating it)
    continuable: bool
    #: the pod that holds it is hibernating its job now (it was asked to stop), or is being deleted
    #: and will be asked to
    stopping: bool


@dataclass(frozen=True)
class SlotChoice:
    n: int
    #: wait for the pod that holds it to let go
    wait: bool = False


def choose_slot(slots: Sequence[SlotView]) -> SlotChoice:
    """Which slot a starting pod of interchangeable ones (a Deployment's replicas) takes: a free one
    with a job to continue; else one whose pod is hibernating its job now or is being deleted, waited
    for — a replacement made at the eviction may start before the evicted pod is told to stop, and
    continues its job a moment later instead of starting cold beside it; else the first free one, or a
    new one after the last."""
    ordered = sorted(slots, key=lambda slot: slot.n)
    for slot in ordered:
        if slot.free and slot.continuable:
            return SlotChoice(slot.n)
    for slot in ordered:
        if not slot.free and slot.stopping:
            return SlotChoice(slot.n, wait=True)
    for slot in ordered:
        if slot.free:
            return SlotChoice(slot.n)
    taken = {slot.n for slot in ordered}
    return SlotChoice(next(n for n in range(len(taken) + 1) if n not in taken))


class Start(StrEnum):
    COLD = "cold"  # run the command: there is nothing to continue
    RESUME = "resume"  # restore the hibernated job
    RECOVER = "recover"  # its pod went away without hibernating it: restore its latest checkpoint


def on_start(state: str | None, has_checkpoint: bool, ended: bool) -> Start:
    """What a pod's supervisor does with its slot's job when it starts.

    ``state``: the job's recorded state (``None``: no job yet). ``ended``: the job exited by itself in
    an earlier pod, which ends the identity: nothing restores. A hibernated job resumes. A job recorded
    in any other state was left by a pod that went away without hibernating it (deleted with
    ``--grace-period=0``, its node gone, its supervisor killed): its latest checkpoint is restored,
    or the command starts cold if it has none.
    """
    if state is None or ended:
        return Start.COLD
    if state == "hibernated" and has_checkpoint:
        return Start.RESUME
    return Start.RECOVER if has_checkpoint else Start.COLD


#: the exit status of a container stopped by SIGTERM, as a shell reports it (128 + 15)
STOPPED_EXIT = 143


def exit_after_hibernation(owner: str) -> int:
    """The status the pod exits with once its job is hibernated, given its controller (``KIND/NAME``,
    "" for a bare pod).

    A Job's controller counts a pod that exits 0 as a completion: the Job would end, and no pod would
    ever resume the hibernated job. Its pod exits :data:`STOPPED_EXIT` instead, a failure the Job
    replaces with a new pod, which resumes it (each counts against the Job's ``backoffLimit``). Any
    other pod exits 0: its controller replaces it whatever its status.
    """
    return STOPPED_EXIT if owner.split("/", 1)[0] == "Job" else 0


def grace_for(requested_s: float | None, minimum_s: float) -> float:
    """The termination grace a pod gets: what it asked, or ``minimum_s`` where that is longer (the
    Kubernetes default, 30 s, when it asked nothing)."""
    return max(30.0 if requested_s is None else requested_s, minimum_s)


def needs(
    image: str, mounts: Sequence[Mapping[str, object]], volumes: Sequence[Mapping[str, object]]
) -> dict[str, object]:
    """What a container's job depends on, to compare between pods: its image, and each of its mounts as
    ``PATH <- KIND:SOURCE`` (a PersistentVolumeClaim's name, a host path, a ConfigMap's name...;
    an ``emptyDir`` is new in every pod, and listed as such)."""
    by_name = {str(v.get("name")): v for v in volumes}
    listed = []
    for mount in mounts:
        volume = by_name.get(str(mount.get("name")), {})
        kind = next((k for k in sorted(volume) if k != "name"), "unknown")
        source = volume.get(kind)
        key = ""
        if isinstance(source, Mapping):
            for field in ("claimName", "path", "name", "secretName", "server"):
                if field in source:
                    key = str(source[field])
                    break
        sub = f"/{mount['subPath']}" if mount.get("subPath") else ""
        listed.append(f"{mount.get('mountPath')} <- {kind}:{key}{sub}")
    return {"image": image, "volumes": sorted(listed)}


def mismatch(then: Mapping[str, object], now: Mapping[str, object]) -> str | None:
    """Why a pod whose job depends on ``now`` cannot continue one that depended on ``then`` (None: it
    can). A side that says nothing (a pod not made by the webhook) is not compared."""
    if not then or not now:
        return None
    if then.get("image") != now.get("image"):
        return f"its image differs ({then.get('image')} then, {now.get('image')} now)"
    before, after = _strings(then.get("volumes")), _strings(now.get("volumes"))
    if before != after:
        changes = [f"-{v}" for v in sorted(before - after)] + [f"+{v}" for v in sorted(after - before)]
        return f"its volumes differ ({', '.join(changes)})"
    return None


def _strings(value: object) -> set[str]:
    return {str(item) for item in value} if isinstance(value, list | tuple) else set()


def resource_name(identity: str) -> str:
    """The name of the TorporIdentity resource of ``identity`` in its namespace: the rest of it, its
    parts joined by dots (``team-a/replicaset-api/main`` -> ``replicaset-api.main``)."""
    return ".".join(identity.split("/")[1:])[:253]


def orphaned(
    owner: Owner | None, owner_exists: bool, namespace_exists: bool = True, namespace_remade: bool = False
) -> bool:
    """Whether an identity's checkpoints go: its namespace is deleted (whatever its pods were: the
    images are the namespace's, and a namespace made later with the same name may be someone else's)
    or was made again since (``namespace_remade``: :func:`remade_namespace`), or the controller whose
    pods it was is. A bare pod's (no owner) or one named by annotation otherwise stays until it is
    removed by hand: the same pod may be created again."""
    return not namespace_exists or namespace_remade or (owner is not None and not owner_exists)


def s3_clean_up(
    recorded_url: str,
    recorded_endpoint: str | None,
    base: str | None,
    endpoint: str | None,
    identity: str,
    n: int,
) -> str | None:
    """Why the operator may not delete the S3 prefix slot ``n`` of ``identity`` stored its images under
    (``recorded_url``, at ``recorded_endpoint``), or None: it may. Only the prefix the webhook's settings
    (``base``, ``endpoint``) give that slot (:func:`slot_cold_tier`), and only at that endpoint: what a
    slot's own files say is not trusted to name what gets deleted, nor a server the operator calls."""
    if base is None:
        return f"its images are in S3 ({recorded_url}) and the operator was given no s3_url (--config)"
    try:
        expected = slot_cold_tier(base, identity, n)
    except ValueError as exc:
        return str(exc)
    if recorded_url.rstrip("/") != expected:
        return f"its images are at {recorded_url}, not at its prefix of {base} ({expected})"
    if (recorded_endpoint or None) != (endpoint or None):
        return f"its images are at the endpoint {recorded_endpoint or 'of AWS'}, not at {endpoint or 'AWS'}"
    return None


def remade_namespace(recorded: str | None, current: str | None) -> bool:
    """Whether checkpoints taken in the namespace whose UID was ``recorded`` are of an earlier namespace
    of the same name than the one of UID ``current``: deleted since, and made again, perhaps by someone
    else. Where either UID is not known (a slot of an older torpor, a pod the webhook could not ask the
    API server about) they cannot be told apart, and are not."""
    return bool(recorded) and bool(current) and recorded != current


#: the part of a mount's root (the folder of its file system it shows) that kubelet gives an emptyDir
EMPTY_DIR = "/kubernetes.io~empty-dir/"


def pod_local(point: str, fstype: str, root: str) -> bool:
    """Whether a file on the mount at ``point`` (of type ``fstype``, showing ``root`` of its file
    system) is the pod's own, gone when the pod is made again on another node: the container's root
    file system, an ``emptyDir`` (on the node's disk, or a tmpfs), another tmpfs (``/dev/shm``). A
    PersistentVolumeClaim, NFS, a hostPath or the store volume is not: its files stay where they are."""
    return point == "/" or EMPTY_DIR in root or fstype == "tmpfs"
