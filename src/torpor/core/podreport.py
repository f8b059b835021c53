"""What a pod's supervisor tells Kubernetes: events on its pod, the last-checkpoint annotation, and
whether another pod of its namespace is being deleted (:class:`Reporter`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from torpor.adapters import kubeapi

#: the annotation on the pod that says when its job was last checkpointed (RFC 3339), for schedulers
#: that prefer as victims the pods that checkpointed recently
LAST_CHECKPOINT_ANNOTATION = "torpor.dev/last-checkpoint"


_POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class Reporter:
    """Events on the pod and its last-checkpoint annotation, through the Kubernetes API where the pod can
    reach it (:mod:`torpor.adapters.kubeapi`). A failure is said once in the supervisor's log and never
    stops anything: the job comes first."""

    def __init__(
        self, namespace: str, name: str, uid: str, api: kubeapi.KubeAPI | None, say: Callable[[str], None]
    ) -> None:
        self.namespace, self.name, self.uid = namespace, name, uid
        self.api = api if name and namespace else None
        self._say = say
        self._failed = False

    def _try(self, call: Callable[[kubeapi.KubeAPI], None]) -> None:
        if self.api is None:
            return
        try:
            call(self.api)
        except kubeapi.KubeError as exc:
            if not self._failed:
                self._say(f"cannot tell Kubernetes (events, annotations): {exc}")
            self._failed = True

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self._try(lambda api: api.event(self.namespace, self.name, self.uid, reason, message, warning))

    def deleting(self, holder: dict[str, Any]) -> bool:
        """Whether ``holder`` (a slot file's pod: its name and uid) is a pod of this namespace that is being
        deleted; False where Kubernetes cannot be asked."""
        name, uid = holder.get("name"), holder.get("uid")
        if self.api is None or not isinstance(name, str) or not _POD_NAME.fullmatch(name) or not uid:
            return False
        try:
            pod = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        except kubeapi.KubeError:
            return False
        metadata = (pod or {}).get("metadata", {})
        return bool(metadata.get("uid") == uid and metadata.get("deletionTimestamp"))

    def checkpointed(self, at: float) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
        self._try(lambda api: api.annotate(self.namespace, self.name, {LAST_CHECKPOINT_ANNOTATION: stamp}))
