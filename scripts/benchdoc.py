"""What the benchmark scripts share: their page (docs/benchmarks.md, one marked section per script)
and a few small helpers. Imported by ``scripts/bench*.py``, which run with this folder on sys.path.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
NEW_PAGE = (
    "# torpor benchmarks\n\n"
    "Each section is written by its own benchmark script, between its own markers, and compares torpor "
    "with an anchor measured in the same run, as a ratio: these machines are shared and noisy.\n"
)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def splice(text: str | None, name: str, section: str) -> str:
    """``text`` (the page, or None for a new one) with section ``name`` put in or replaced."""
    begin, end = markers(name)
    text = NEW_PAGE if text is None else text
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + block + tail
    return text.rstrip("\n") + "\n\n" + block + "\n"


def write_section(name: str, section: str, doc: Path = DOC) -> None:
    """Put section ``name`` into ``doc`` atomically, leaving every other section as it is."""
    text = splice(doc.read_text() if doc.exists() else None, name, section)
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, doc)


def publish(name: str, section: str, doc: Path = DOC, print_only: bool = False) -> None:
    """Write section ``name`` into ``doc`` and show it, or only show it (``--no-write``)."""
    if print_only:
        say("\n" + section)
    else:
        write_section(name, section, doc)
        say(f"\n{section.rstrip()}\n\nwrote {doc}")


def say(text: str) -> None:
    print(text, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def dir_bytes(path: Path) -> int:
    """The bytes of the files under ``path``, at any depth (a CRIU image folder is flat; a borg repository is not)."""
    return sum(
        entry.stat().st_size for entry in path.rglob("*") if entry.is_file() and not entry.is_symlink()
    )


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 300, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(every)


def cpu_model() -> str | None:
    """The processor's model name, from /proc/cpuinfo; None when it says none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def memory_total() -> int | None:
    """The machine's memory in bytes (MemTotal of /proc/meminfo); None when it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None
