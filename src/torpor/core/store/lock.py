"""A shared/exclusive lock kept *in* the backend, so that writers on several nodes and ``gc`` agree.

Writers (a destage) hold it shared; ``gc`` holds it exclusive, so it never deletes a chunk a writer has
just decided to reuse. Each holder stores ``locks/<kind>-<random>`` then lists ``locks/``: a writer that
sees an exclusive lock, or a ``gc`` that sees any other lock, withdraws and retries after a random pause.
Both sides store before they look, so with a backend that lists what was stored (a local folder, S3 since
2020) two conflicting holders can never both go ahead. A lock whose holder died is stale: its process is
gone (same host) or it was not refreshed for ``stale_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator

from torpor.adapters.system import procfs
from torpor.core.store.backend import Backend
from torpor.errors import ObjectNotFound, StoreBusy, StoreError

SHARED = "s"
EXCLUSIVE = "x"


class RepositoryLock:
    """The store's shared (writers) / exclusive (gc) lock, kept as objects in the backend itself."""

    def __init__(self, backend: Backend, stale_s: float = 600.0) -> None:
        self.backend = backend
        self.stale_s = stale_s
        self.host = socket.gethostname()

    def _record(self) -> bytes:
        return json.dumps({"host": self.host, "pid": os.getpid(), "time": time.time()}).encode()

    def _stale(self, name: str) -> bool:
        try:
            data = json.loads(self.backend.load(name))
        except ObjectNotFound:
            return True
        except (StoreError, ValueError):
            return False  # unreadable for now: assume held, it will be retried
        if not isinstance(data, dict):
            return True
        if (
            data.get("host") == self.host
            and isinstance(data.get("pid"), int)
            and not procfs.is_alive(data["pid"])
        ):
            return True
        return bool(time.time() - float(data.get("time", 0)) > self.stale_s)

    def _others(self, mine: str) -> list[str]:
        names = []
        for name in self.backend.list("locks"):
            if name == mine:
                continue
            if self._stale(name):
                with contextlib.suppress(StoreError):
                    self.backend.delete(name)
                continue
            names.append(name)
        return names

    @contextlib.contextmanager
    def hold(self, kind: str, timeout: float) -> Iterator[LockHandle]:
        deadline = time.monotonic() + timeout
        while True:
            name = f"locks/{kind}-{uuid.uuid4().hex}"
            self.backend.store(name, self._record())
            others = self._others(name)
            conflict = bool(others) if kind == EXCLUSIVE else any("/x-" in other for other in others)
            if not conflict:
                break
            self.backend.delete(name)
            if time.monotonic() > deadline:
                what = "being written" if kind == EXCLUSIVE else "being garbage-collected"
                raise StoreBusy(
                    f"the store {self.backend.url} stayed locked for {timeout:.0f} s (it is {what}); "
                    "try again later",
                    details=[f"held by: {other}" for other in others[:5]],
                )
            time.sleep(random.uniform(0.05, 0.3))
        handle = LockHandle(self, name)
        try:
            yield handle
        finally:
            with contextlib.suppress(StoreError):
                self.backend.delete(name)


class LockHandle:
    """A held lock; long holders call :meth:`refresh` so others do not take it for stale."""

    def __init__(self, lock: RepositoryLock, name: str) -> None:
        self.lock = lock
        self.name = name
        self.refreshed = time.monotonic()

    def refresh(self) -> None:
        if time.monotonic() - self.refreshed > self.lock.stale_s / 4:
            self.lock.backend.store(self.name, self.lock._record())
            self.refreshed = time.monotonic()
