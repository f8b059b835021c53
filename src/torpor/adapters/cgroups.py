"""PROVISIONAL: replaced by the cgroup adapter before this lands (the scheduler runs without cgroups here)."""

from __future__ import annotations

from pathlib import Path

DUMP_MARGIN = 64 << 20


class JobCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    def exists(self) -> bool:
        return False

    def create(self, limit: int) -> None:
        raise NotImplementedError

    def set_limit(self, limit: int) -> None:
        raise NotImplementedError

    def limit(self) -> int | None:
        raise NotImplementedError

    def usage(self) -> int:
        raise NotImplementedError

    def make_room(self, extra: int) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError


class MemoryController:
    def job(self, name: str) -> JobCgroup:
        raise NotImplementedError


def find_memory_controller() -> MemoryController | None:
    return None


def mem_available() -> int | None:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def memory_pressure() -> tuple[float, float] | None:
    return None
