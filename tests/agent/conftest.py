"""A real ``torpor agent`` for the agent's tests: started as a user would (the CLI, in the foreground),
on the test's own state directory, and stopped (or killed) by the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import TORPOR, Torpor
from torpor.apps.agent.client import answers


class AgentProcess:
    """``torpor agent`` in a subprocess, its log in a file; ``api`` speaks to its unix socket."""

    def __init__(self, torpor: Torpor, log: Path) -> None:
        self.torpor = torpor
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None
        self.api = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://agent", timeout=120
        )

    @property
    def socket(self) -> Path:
        return self.torpor.home / "agent.sock"

    def start(self, *flags: str) -> AgentProcess:
        assert self.process is None or self.process.poll() is not None, "an agent runs already"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [TORPOR, "agent", "--round", "200ms", *flags],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.torpor.env,
            )
        self.wait_for(self._answers, 30, "the agent to answer on its socket")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the agent exited {self.process.returncode}:\n{self.log()}")
        return answers(self.socket) and self.api.get("/v1/health", timeout=10).status_code == 200

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        """Send ``sig`` and wait for the agent to exit; its exit code."""
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def events(self, job: str | None = None) -> list[dict[str, Any]]:
        args = ["events", "--json"] + (["--job", job] if job else [])
        return list(json.loads(self.torpor.run(*args).stdout))

    def wait_event(
        self, action: str, job: str | None = None, timeout: float = 60, after: int = 0
    ) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.events(job) if e["action"] == action and e["id"] > after]
            return bool(found)

        self.wait_for(seen, timeout, f"a {action} event" + (f" of {job}" if job else ""))
        return found[0]

    def last_event_id(self) -> int:
        events = self.events()
        return int(events[-1]["id"]) if events else 0

    def wait_for(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\nagent log:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # leaves the jobs running, for the torpor fixture's rm
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.api.close()


@pytest.fixture
def agent(torpor: Torpor, tmp_path: Path) -> Iterator[AgentProcess]:
    """An agent on the test's state directory, not started yet: ``agent.start(flags…)``."""
    process = AgentProcess(torpor, tmp_path / "agent.log")
    yield process
    process.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


__all__ = ["AgentProcess", "pid_alive", "signal"]
